"""The FastAPI application over one running `Engine`: routes, error handlers, request metrics.

`build_app(engine)` does not own the engine: whoever started it (`jspec.server.launch`, a test)
shuts it down after the HTTP server has stopped, so in-flight requests can finish first.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from jspec.server import errors, native_routes, openai_routes
from jspec.server.chat_template import ChatTemplate
from jspec.server.engine_bridge import ClientDisconnected, EngineBridge
from jspec.server.metrics import RequestCounter, ServerMetrics
from jspec.server.state import ServerState

CLIENT_CLOSED = 499  # nginx's status for "the client closed the connection before the answer"


async def _client_gone(request: Request, exc: ClientDisconnected) -> Response:
    return Response(status_code=CLIENT_CLOSED)


def build_app(engine, *, served_model_name: str | None = None, stream_output: bool = False) -> FastAPI:
    """The HTTP application serving engine. served_model_name: the model id clients see (default:
    the model path, as SGLang); stream_output: `/generate` streams disjoint segments."""
    model_path = str(engine.get_server_info()["model_path"])
    metrics = ServerMetrics(engine)
    state = ServerState(engine=engine, bridge=EngineBridge(engine, metrics), metrics=metrics,
                        model_name=served_model_name or model_path, model_path=model_path,
                        chat_template=ChatTemplate.from_dir(model_path), stream_output=stream_output)
    app = FastAPI(title="jspec", summary="OpenAI-compatible and SGLang-native endpoints over a jspec Engine")
    app.state.jspec = state
    errors.install(app)
    app.add_exception_handler(ClientDisconnected, _client_gone)
    app.include_router(openai_routes.router)
    app.include_router(native_routes.router)
    app.add_middleware(RequestCounter, metrics=metrics)
    return app
