"""What every route needs: the server's state (one per application) and server-sent events."""

from __future__ import annotations

import dataclasses
import json

from fastapi import Request
from fastapi.responses import StreamingResponse

from jspec.server.chat_template import ChatTemplate
from jspec.server.engine_bridge import EngineBridge
from jspec.server.errors import RequestError
from jspec.server.metrics import ServerMetrics

DONE = "data: [DONE]\n\n"


@dataclasses.dataclass
class ServerState:
    engine: object  # jspec.api.Engine
    bridge: EngineBridge
    metrics: ServerMetrics
    model_name: str  # the id /v1/models lists (SGLang's served_model_name; default: the model path)
    model_path: str
    chat_template: ChatTemplate | None
    stream_output: bool = False  # /generate streams disjoint segments instead of cumulative text and ids

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def context_length(self) -> int:
        return self.engine.context_length

    def room(self, prompt_tokens: int) -> int:
        """New tokens a prompt of this length can ask for: the context length, and the KV pool
        minus what speculation writes ahead, both bound prompt + output."""
        limits = self.engine.limits
        return min(limits.context_length, limits.pool_tokens - limits.spec_extra) - prompt_tokens

    def check_accepting(self) -> None:
        """New generation requests are refused once a SIGTERM has started the drain."""
        if self.bridge.draining:
            raise RequestError("the server is shutting down", status=503)


def get_state(request: Request) -> ServerState:
    return request.app.state.jspec


def sse(obj) -> str:
    """One server-sent event carrying obj as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events; on_close runs however the response ends. The events' own generator
    aborts its requests when it is closed, but one that never started (the client left, or the
    server shut down, before the first event) runs no code at all: on_close covers that case."""

    def __init__(self, events, on_close=None):
        # no-cache / no buffering: proxies must pass each event on as it comes.
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.on_close is not None:
                self.on_close()


def event_stream(events, streams, bridge: EngineBridge) -> EventStream:
    """The response streaming events of streams (whose requests are aborted if it ends early:
    aborting a finished request does nothing)."""
    return EventStream(events, on_close=lambda: bridge.abort(streams.rids))
