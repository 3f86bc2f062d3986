"""OpenAI's endpoints: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

Both generation endpoints turn their body into engine sub-requests (`openai_adapter`), then answer
in one of two ways: a JSON response once every sub-request is done, or server-sent events, one
chunk per engine chunk that adds text (or tokens, when logprobs are asked for), a finish chunk per
choice, a usage chunk when `stream_options.include_usage` asks for one, and `data: [DONE]`.
"""

from __future__ import annotations

import contextlib

from fastapi import APIRouter, Request

from jspec.errors import InvalidRequestError
from jspec.server import openai_adapter as oa
from jspec.server.chat_template import ChatTemplateError
from jspec.server.engine_bridge import new_rid
from jspec.server.errors import RequestError, error_body, from_engine
from jspec.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, unsupported_field
from jspec.server.state import DONE, ServerState, event_stream, get_state, sse

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request):
    st = get_state(request)
    return {"object": "list", "data": [{"id": st.model_name, "object": "model", "created": 0, "owned_by": "jspec",
                                        "root": st.model_path, "max_model_len": st.context_length}]}


def _refuse_unsupported(body) -> None:
    field = unsupported_field(body)
    if field is not None:
        raise RequestError(f"{field}: not supported by this server", field)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    st = get_state(request)
    st.check_accepting()
    _refuse_unsupported(body)
    oa.check_n(body.n)
    prompts = oa.prompt_ids(body.prompt, st.tokenizer)
    for ids in prompts:
        oa.check_context(ids, st.context_length, "prompt")
    logprobs = body.logprobs is not None
    echo = None
    if body.echo:
        if logprobs and not st.engine.engine_config.enable_input_logprobs:
            raise RequestError("echo: the prompt's logprobs (echo with logprobs) need a server started with "
                               "--enable-input-logprobs", "echo")
        echo = oa.prompt_texts(body.prompt, prompts, st.tokenizer)
    responder = oa.Responder("completion", st.model_name, st.tokenizer, logprobs=logprobs, top=body.logprobs or 0,
                             echo=echo, n=body.n)
    return await _answer(st, request, body, prompts, oa.sampling_params(body, body.max_tokens), responder,
                         oa.engine_names("completion"))


def _message(m: ChatMessage) -> dict:
    """A message as the template sees it: text parts joined (images and audio are refused by the
    body model), a missing content as the empty string (Jinja would print None)."""
    d = m.model_dump(exclude_none=True)
    content = m.content
    if isinstance(content, list):
        content = "\n".join(part.text for part in content)
    d["content"] = content or ""
    return d


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    st = get_state(request)
    st.check_accepting()
    _refuse_unsupported(body)
    oa.check_n(body.n)
    if st.chat_template is None:
        raise RequestError("messages: this model has no chat template (tokenizer_config.json chat_template); "
                           "use /v1/completions", "messages")
    if st.tokenizer is None:
        raise RequestError("messages: this server has no tokenizer (--skip-tokenizer-init)", "messages")
    if not body.messages:
        raise RequestError("messages: must not be empty", "messages")
    try:
        text = st.chat_template.render([_message(m) for m in body.messages], add_generation_prompt=True,
                                       tools=body.tools)
    except ChatTemplateError as e:
        raise RequestError(f"messages: {e}", "messages") from None
    # As transformers' apply_chat_template: the template writes every special token itself.
    ids = st.tokenizer.encode(text, add_special_tokens=False).ids
    oa.check_context(ids, st.context_length, "messages")
    max_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_new = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_new is None:  # as much as the context (and the pool) has room for
        max_new = st.room(len(ids))
        if max_new < 1:
            raise RequestError(f"messages: the prompt ({len(ids)} tokens) leaves no room to generate", "messages")
    if body.top_logprobs is not None and not body.logprobs:
        raise RequestError("top_logprobs: needs logprobs: true", "top_logprobs")
    top = (body.top_logprobs or 0) if body.logprobs else 0
    responder = oa.Responder("chat", st.model_name, st.tokenizer, logprobs=body.logprobs, top=top)
    return await _answer(st, request, body, [ids], oa.sampling_params(body, max_new), responder,
                         oa.engine_names("chat", max_field))


async def _answer(st: ServerState, request: Request, body, prompts: list[list[int]], sp: dict,
                  responder: oa.Responder, names: dict):
    """Submit n samples of each prompt; answer whole or streamed."""
    sps = oa.fan_out(sp, body.n)
    ids = [p for p in prompts for _ in sps]
    sps = sps * len(prompts)
    lp = dict(return_logprob=responder.logprobs, top_logprobs_num=responder.top)
    if responder.echo is not None and responder.logprobs:
        lp["logprob_start_len"] = 0  # the prompt's own logprobs, from its first token
    try:
        if body.stream:
            streams = st.bridge.open_streams([dict(input_ids=i, sampling_params=s, **lp) for i, s in zip(ids, sps)])
        else:
            outs = await st.bridge.generate(request, rid=[new_rid() for _ in ids], input_ids=ids, sampling_params=sps,
                                            **lp)
    except InvalidRequestError as e:
        raise from_engine(e, names, flat_sampling=True) from None
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    if body.stream:
        return event_stream(_stream(st, streams, responder, body.n, include_usage), streams, st.bridge)
    for o in outs:
        message = oa.abort_message(o["meta_info"])
        if message is not None:
            raise RequestError(f"the engine ended this request: {message}", status=500)
    return responder.response(outs, [o["meta_info"] for o in outs[::body.n]])


async def _stream(st: ServerState, streams, responder: oa.Responder, n: int, include_usage: bool):
    count = len(streams.rids)
    tokens, chars, finals = [0] * count, [responder.echo_len(i) for i in range(count)], [None] * count
    for i in range(count):
        first = responder.first_chunk(i)
        if first is not None:
            yield sse(first)
    async with contextlib.aclosing(st.bridge.events(streams)) as events:
        async for ev in events:
            message = ev.error or (oa.abort_message(ev.meta) if ev.final else None)
            if message is not None:  # the stream has started: the error travels as an event
                yield sse(error_body(500, f"the engine ended this request: {message}"))
                break
            start, tokens[ev.index] = tokens[ev.index], tokens[ev.index] + len(ev.ids)
            if ev.text or ev.final or (responder.logprobs and ev.ids):
                yield sse(responder.chunk(ev.index, ev.text, ev.meta, start, tokens[ev.index], chars[ev.index],
                                          ev.final))
            chars[ev.index] += len(ev.text)
            if ev.final:
                finals[ev.index] = ev.meta
    if include_usage and all(m is not None for m in finals):
        yield sse(responder.usage_chunk(finals, finals[::n]))
    yield DONE
