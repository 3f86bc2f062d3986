"""SGLang's native endpoints: `/generate`, `/health`, `/health_generate`, `/get_server_info`,
`/get_model_info`, `/flush_cache`, and Prometheus' `/metrics`.

`/generate` takes `Engine.generate`'s arguments as JSON (`text` is its `prompt`) and answers with
its dicts. Streamed, it sends SGLang's events: `data: {"text", "output_ids", "meta_info"}` with the
text and ids so far (cumulative, as SGLang by default; disjoint segments with `--stream-output`,
SGLang's `incremental_streaming_output`, where the logprob lists of meta_info come in segments too),
then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from jspec.errors import InvalidRequestError
from jspec.server.engine_bridge import new_rid
from jspec.server.errors import RequestError, error_body, from_engine
from jspec.server.protocol import GenerateRequest
from jspec.server.state import DONE, ServerState, event_stream, get_state, sse

router = APIRouter()
HEALTH_GENERATE_TIMEOUT = 20.0  # seconds a one-token request may take before the engine counts as stuck
NAMES = {"prompt": "text"}  # engine field -> this endpoint's field


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request):
    st = get_state(request)
    st.check_accepting()
    if body.text is not None and body.input_ids is not None:
        raise RequestError("text: give text or input_ids, not both", "text")
    kw = dict(prompt=body.text, input_ids=body.input_ids, sampling_params=body.sampling_params,
              return_logprob=body.return_logprob, top_logprobs_num=body.top_logprobs_num,
              logprob_start_len=body.logprob_start_len)
    batch = isinstance(body.text, list) or (bool(body.input_ids) and isinstance(body.input_ids[0], list))
    try:
        if body.stream:
            if batch or isinstance(body.rid, list):
                raise RequestError("stream: streaming takes one prompt at a time", "stream")
            streams = st.bridge.open_streams([{**kw, "rid": body.rid}])
            return event_stream(_stream(st, streams), streams, st.bridge)
        size = len(body.text if body.text is not None else body.input_ids) if batch else 0
        rid = body.rid or ([new_rid() for _ in range(size)] if batch else new_rid())
        out = await st.bridge.generate(request, rid=rid, **kw)
    except InvalidRequestError as e:
        raise from_engine(e, NAMES) from None
    return JSONResponse(out)


LOGPROB_LISTS = ("input_token_logprobs", "input_top_logprobs", "output_token_logprobs", "output_top_logprobs")


async def _stream(st: ServerState, streams):
    text, ids = "", []
    sent = dict.fromkeys(LOGPROB_LISTS, 0)  # segments: entries of each list already sent
    async with contextlib.aclosing(st.bridge.events(streams)) as events:
        async for ev in events:
            if ev.error is not None:
                yield sse(error_body(500, ev.error))
                break
            meta = ev.meta
            if st.stream_output:
                text, ids = ev.text, ev.ids
                meta = dict(meta)
                for key in LOGPROB_LISTS:
                    if key in meta:  # the entries not sent yet: each once, over the events
                        meta[key], sent[key] = meta[key][sent[key]:], len(meta[key])
            else:
                text, ids = text + ev.text, ids + ev.ids
            yield sse({"text": text, "output_ids": ids, "meta_info": meta})
    yield DONE


@router.get("/health")
async def health(request: Request):
    st = get_state(request)
    if st.bridge.draining:
        return PlainTextResponse("shutting down", status_code=503)
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request):
    """Healthy when the engine generates one token in time (its loop is alive and stepping)."""
    st = get_state(request)
    if st.bridge.draining:
        return PlainTextResponse("shutting down", status_code=503)
    rid = new_rid()
    try:
        out = await asyncio.wait_for(st.bridge.generate(None, rid=rid, input_ids=[0],
                                                        sampling_params={"max_new_tokens": 1}),
                                     HEALTH_GENERATE_TIMEOUT)
    except asyncio.TimeoutError:
        st.bridge.abort(rid)
        return PlainTextResponse("generation timed out", status_code=503)
    reason = out["meta_info"].get("finish_reason") or {}
    if reason.get("type") == "abort":
        return PlainTextResponse(f"generation failed: {reason.get('message')}", status_code=503)
    return Response(status_code=200)


@router.get("/get_server_info")
async def get_server_info(request: Request):
    st = get_state(request)
    info = await asyncio.to_thread(st.engine.get_server_info)
    return {**info, "served_model_name": st.model_name, "stream_output": st.stream_output,
            "num_http_requests_in_flight": st.bridge.inflight}


@router.get("/get_model_info")
async def get_model_info(request: Request):
    st = get_state(request)
    config = st.engine.config
    return {"model_path": st.model_path, "tokenizer_path": st.model_path, "is_generation": True,
            "served_model_name": st.model_name, "architecture": config.architecture,
            "vocab_size": config.vocab_size, "context_length": st.context_length,
            "has_chat_template": st.chat_template is not None}


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request):
    st = get_state(request)
    if await asyncio.to_thread(st.engine.flush_cache):
        return PlainTextResponse("Cache flushed.\n")
    info = await asyncio.to_thread(st.engine.get_server_info)
    why = ("requests are running or waiting (SGLang refuses then too)" if info.get("radix_cache")
           else "this engine runs without a prefix cache")
    return JSONResponse(error_body(400, f"not flushed: {why}"), status_code=400)


@router.get("/metrics")
async def metrics(request: Request):
    st = get_state(request)
    # Collecting reads the engine's server info: a thread, not the event loop.
    data = await asyncio.to_thread(generate_latest, st.metrics.registry)
    return Response(data, media_type=CONTENT_TYPE_LATEST)
