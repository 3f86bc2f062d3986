"""`jspec serve` over HTTP on loopback, driven by real clients (the `openai` package, httpx, the
bench's HTTP backend): one server for the whole module, the shipped tiny Qwen3 target with its
EAGLE3 drafter, served by uvicorn in a thread; its `Engine` is at hand for references and for the
no-leak checks. The SIGTERM drain runs `jspec serve` as a subprocess with the same settings, which
finds this module's compiled steps in a persistent compilation cache and starts in seconds.

Every request has a bounded token count and a client timeout; every wait loop a deadline.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import jax
import openai
import pytest
import uvicorn
from jax.experimental.compilation_cache import compilation_cache
from prometheus_client.parser import text_string_to_metric_families

from jspec.api import Engine
from jspec.cli import main
from jspec.server.app import build_app
from jspec.tiny import tiny_dir
from tests.support.engines import check_no_leaks

# One decode bucket and no top-k / top-p sort variants: the fewest steps to compile.
SETTINGS = dict(dtype="float32", cuda_graph_bs=[4], max_running_requests=4, chunked_prefill_size=64,
                prefill_token_buckets=[64], context_length=256, disable_top_k_top_p=True, speculative_adaptive=False,
                speculative_algorithm="EAGLE3", speculative_draft_model_path=tiny_dir("qwen3-eagle3"),
                speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                grammar_backend="llguidance")
# The same settings as `jspec serve` flags (the SIGTERM test's subprocess).
FLAGS = ["--dtype", "float32", "--cuda-graph-bs", "4", "--max-running-requests", "4", "--chunked-prefill-size", "64",
         "--prefill-token-buckets", "64", "--context-length", "256", "--disable-top-k-top-p",
         "--speculative-adaptive", "off", "--speculative-algorithm", "EAGLE3",
         "--speculative-draft-model-path", tiny_dir("qwen3-eagle3"), "--speculative-num-steps", "3",
         "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4", "--grammar-backend", "llguidance",
         "--quiet"]
GREEDY = dict(temperature=0.0)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TIMEOUT = 60.0  # seconds any one HTTP request may take


class Served:
    def __init__(self, engine, server, thread, port, cache_dir):
        self.engine, self.server, self.thread, self.cache_dir = engine, server, thread, cache_dir
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
        self.http = httpx.Client(base_url=self.url, timeout=TIMEOUT)

    def info(self) -> dict:
        return self.http.get("/get_server_info").json()

    def metrics(self) -> dict:
        """Every sample of /metrics: (name, sorted labels) -> value."""
        text = self.http.get("/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cache_dir = str(tmp_path_factory.mktemp("xla"))
    engine = Engine(tiny_dir("qwen3"), show_progress=False, compilation_cache_dir=cache_dir, **SETTINGS)
    # Every step is compiled by now (and written to cache_dir for the subprocess); other modules
    # in this process must not use or fill the cache.
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(engine), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    s = Served(engine, server, thread, sock.getsockname()[1], cache_dir)
    yield s
    s.http.close()
    server.should_exit = True
    thread.join(timeout=30)
    engine.shutdown()


def _stream_text(chunks, chat: bool) -> tuple[str, str | None]:
    text, reason = "", None
    for ch in chunks:
        for c in ch.choices:
            text += (c.delta.content or "") if chat else c.text
            reason = c.finish_reason or reason
    return text, reason


def _idle(served) -> None:
    """No request running or waiting, every page back once cached prefixes are dropped."""
    check_no_leaks(served.engine)


# ----------------------------------------------------------------------------- OpenAI endpoints
def test_models_lists_the_served_model(served):
    models = served.client.models.list().data
    assert [m.id for m in models] == [tiny_dir("qwen3")]


def test_greedy_completion_equals_engine_generate(served):
    prompt = "Hello, how are"
    ref = served.engine.generate(prompt=prompt, sampling_params={"max_new_tokens": 24, **GREEDY})
    r = served.client.completions.create(model="m", prompt=prompt, max_tokens=24, **GREEDY)
    assert r.choices[0].text == ref["text"] and ref["text"]
    assert r.usage.completion_tokens == ref["meta_info"]["completion_tokens"]
    assert r.usage.prompt_tokens == len(served.engine.tokenizer.encode(prompt).ids) == ref["meta_info"]["prompt_tokens"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_echo_puts_the_prompt_before_each_choice(served):
    prompt = "Hello, how are"
    ref = served.engine.generate(prompt=prompt, sampling_params={"max_new_tokens": 5, **GREEDY})
    r = served.client.completions.create(model="m", prompt=[prompt, "Hi"], max_tokens=5, echo=True, n=2, **GREEDY)
    assert [c.text for c in r.choices[:2]] == [prompt + ref["text"]] * 2 and r.choices[2].text.startswith("Hi")
    chunks = served.client.completions.create(model="m", prompt=prompt, max_tokens=5, echo=True, stream=True,
                                              **GREEDY)
    assert _stream_text(chunks, chat=False)[0] == prompt + ref["text"]
    ids = served.engine.tokenizer.encode(prompt).ids
    r = served.client.completions.create(model="m", prompt=ids, max_tokens=0, echo=True)
    assert r.choices[0].text == served.engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert r.usage.completion_tokens == 0


def test_chat_renders_the_template_and_equals_engine_generate(served):
    # The tiny tokenizer's template: <|user|>...<|assistant|> and a generation prompt.
    ref = served.engine.generate(prompt="<|user|>What is the capital of France?<|assistant|>",
                                 sampling_params={"max_new_tokens": 20, **GREEDY})
    r = served.client.chat.completions.create(model="m", messages=CHAT, max_tokens=20, **GREEDY)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref["text"] and ref["text"]
    assert r.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
    # max_completion_tokens wins over max_tokens
    r = served.client.chat.completions.create(model="m", messages=CHAT, max_tokens=20, max_completion_tokens=3,
                                              **GREEDY)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stop", [None, ["."], [" capital of", "xyz"], ["France,"]])
def test_streamed_text_equals_the_whole_answer(served, stop):
    """Stop strings cut the text; streamed pieces must not run into a stop string's first
    characters before it is known whether it completes."""
    for chat in (False, True):
        kw = dict(model="m", max_tokens=40, stop=stop, **GREEDY)
        if chat:
            whole = served.client.chat.completions.create(messages=CHAT, **kw)
            text, reason = _stream_text(served.client.chat.completions.create(messages=CHAT, stream=True, **kw), True)
            want = whole.choices[0].message.content
        else:
            prompt = "The capital of France is"
            whole = served.client.completions.create(prompt=prompt, **kw)
            text, reason = _stream_text(served.client.completions.create(prompt=prompt, stream=True, **kw), False)
            want = whole.choices[0].text
        assert (text, reason) == (want, whole.choices[0].finish_reason), (chat, stop)
        if stop:
            assert not any(s in text for s in stop)
    # The stops above do end replies (else this test would not test cutting).
    r = served.client.chat.completions.create(messages=CHAT, model="m", max_tokens=40, stop=[" capital of"], **GREEDY)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].matched_stop == " capital of"


def test_streamed_text_equals_the_whole_answer_under_every_stop(served):
    """Stop regexes, stops kept in the text (no_stop_trim) and stops that count only after
    min_tokens: streamed pieces add up to the whole answer's text as well."""
    prompt, kw = "The capital of France is", dict(model="m", max_tokens=40, **GREEDY)
    for extra in ({"stop_regex": [r"capital\b"]}, {"stop_regex": r"Fr[a-z]*"},
                  {"stop_regex": r"capital\b", "no_stop_trim": True}, {"stop": ["."], "no_stop_trim": True},
                  {"stop": [" capital of"], "min_tokens": 8}):
        whole = served.client.completions.create(prompt=prompt, **kw, extra_body=extra)
        assert whole.choices[0].finish_reason == "stop", extra
        text, reason = _stream_text(served.client.completions.create(prompt=prompt, stream=True, **kw,
                                                                     extra_body=extra), False)
        assert (text, reason) == (whole.choices[0].text, "stop"), extra


def test_stream_usage_chunk_and_done(served):
    body = dict(model="m", prompt="Once upon a time", max_tokens=12, stream=True, stream_options={"include_usage": True},
                **GREEDY)
    with served.http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    usage = events[-1]["usage"]
    assert events[-1]["choices"] == [] and usage["completion_tokens"] == 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + 12
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]][-1] == "length"


def test_n_samples_with_a_seed_differ_and_repeat(served):
    kw = dict(model="m", prompt=["Hello", "The cat"], max_tokens=10, n=3, seed=11, temperature=1.0)
    a = served.client.completions.create(**kw)
    b = served.client.completions.create(**kw)
    assert [c.index for c in a.choices] == list(range(6))
    texts = [c.text for c in a.choices]
    assert texts == [c.text for c in b.choices]  # seeded: reproducible
    assert len(set(texts[:3])) > 1 and len(set(texts[3:])) > 1  # copy j has seed + j
    # Copy j is the engine's request with seed + j.
    refs = [served.engine.generate(prompt=p, sampling_params={"max_new_tokens": 10, "temperature": 1.0, "seed": 11 + j})
            for p in ("Hello", "The cat") for j in range(3)]
    assert texts == [r["text"] for r in refs]
    assert a.usage.completion_tokens == sum(r["meta_info"]["completion_tokens"] for r in refs)
    # One prompt's tokens count once, however many samples it has.
    assert a.usage.prompt_tokens == sum(len(served.engine.tokenizer.encode(p).ids) for p in ("Hello", "The cat"))


def test_concurrent_clients(served):
    """32 clients at once (streamed and not) against 4 running slots: all answered, and every copy
    of a greedy prompt gets the same text."""
    prompts = ["Hello", "The cat", "Once upon a time", "What is"]
    results: dict[int, tuple] = {}

    def one(i: int) -> None:
        kw = dict(model="m", prompt=prompts[i % 4], max_tokens=12, **GREEDY)
        if i % 2:
            results[i] = _stream_text(served.client.completions.create(stream=True, **kw), False)
        else:
            c = served.client.completions.create(**kw).choices[0]
            results[i] = (c.text, c.finish_reason)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(results) == list(range(32))
    for p in range(4):
        assert len({results[i] for i in range(p, 32, 4)}) == 1, [results[i] for i in range(p, 32, 4)]
    _idle(served)


def test_logprobs_and_penalties_under_speculation(served):
    """The server passes logprobs, penalties, a logit bias, min_tokens and stop_regex to the
    speculative engine: the same logprobs, tokens and text as Engine.generate on the same request."""
    ref = served.engine.generate(prompt="Hello", sampling_params={"max_new_tokens": 6, **GREEDY},
                                 return_logprob=True, top_logprobs_num=2)
    r = served.client.completions.create(model="m", prompt="Hello", max_tokens=6, logprobs=2, **GREEDY)
    assert r.choices[0].logprobs.token_logprobs == [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]]
    c = served.client.chat.completions.create(model="m", messages=CHAT, max_tokens=6, logprobs=True, top_logprobs=2,
                                              **GREEDY)
    assert len(c.choices[0].logprobs.content) == c.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in c.choices[0].logprobs.content)
    for field in ("frequency_penalty", "presence_penalty"):
        want = served.engine.generate(prompt="Hello", sampling_params={"max_new_tokens": 4, **GREEDY, field: 1.5})
        got = served.client.completions.create(model="m", prompt="Hello", max_tokens=4, **GREEDY, **{field: 1.5})
        assert got.choices[0].text == want["text"], field
    # OpenAI's logit_bias (token ids as strings): the tokens the free output starts with, banned.
    free = served.engine.generate(prompt="Hello", sampling_params={"max_new_tokens": 4, **GREEDY})["output_ids"]
    bias = {str(t): -100 for t in free}
    want = served.engine.generate(prompt="Hello", sampling_params={"max_new_tokens": 4, **GREEDY, "logit_bias": bias})
    assert not set(want["output_ids"]) & set(free)
    got = served.client.completions.create(model="m", prompt="Hello", max_tokens=4, logit_bias=bias, **GREEDY)
    assert got.choices[0].text == want["text"]
    # SGLang's min_tokens: the first free token as a stop token, held back for three tokens.
    sp = {"max_new_tokens": 6, **GREEDY, "stop_token_ids": free[:1], "min_new_tokens": 3}
    want = served.engine.generate(prompt="Hello", sampling_params=sp)
    assert len(want["output_ids"]) >= 3 and want["output_ids"][0] != free[0]
    got = served.client.completions.create(model="m", prompt="Hello", max_tokens=6, **GREEDY,
                                           extra_body={"stop_token_ids": free[:1], "min_tokens": 3})
    assert got.choices[0].text == want["text"]
    # SGLang's stop_regex under speculation: the first token whose text completes a match ends the
    # request (tokens accepted after it in the same step are dropped), the text cut before the match.
    sp = {"max_new_tokens": 12, **GREEDY, "ignore_eos": True}
    whole = served.engine.generate(prompt="Hello", sampling_params=sp)
    text = whole["text"]
    pattern = re.escape(text[len(text) // 2:len(text) // 2 + 2])
    m = re.search(pattern, text)
    want = served.engine.generate(prompt="Hello", sampling_params={**sp, "stop_regex": pattern})
    assert want["text"] == text[:m.start()] and want["meta_info"]["finish_reason"]["matched"] == m.group(0)
    assert want["output_ids"] == whole["output_ids"][:len(want["output_ids"])]
    got = served.client.completions.create(model="m", prompt="Hello", max_tokens=12, **GREEDY,
                                           extra_body={"stop_regex": pattern, "ignore_eos": True})
    assert got.choices[0].text == want["text"]


# ----------------------------------------------------------------------------- bad requests
COMPLETION = {"model": "m", "prompt": "Hello", "max_tokens": 4}
BAD = [  # (endpoint, body or raw bytes, the param the 400 must name)
    ("/v1/completions", {**COMPLETION, "temperature": "hot"}, "temperature"),
    ("/v1/completions", {**COMPLETION, "top_k": True}, "top_k"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 2.5}, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "stop": 3}, "stop"),
    ("/v1/completions", {**COMPLETION, "ignore_eos": "yes"}, "ignore_eos"),
    ("/v1/completions", {**COMPLETION, "top_p": 1.5}, "top_p"),
    ("/v1/completions", {**COMPLETION, "top_p": 0.5}, "top_p"),  # this engine compiled no top-p step
    ("/v1/completions", {**COMPLETION, "temperature": -1}, "temperature"),
    ("/v1/completions", {**COMPLETION, "min_p": 2}, "min_p"),
    ("/v1/completions", {**COMPLETION, "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 256}, "max_tokens"),  # prompt + 256 > context 256
    ("/v1/completions", {**COMPLETION, "seed": -3}, "seed"),
    ("/v1/completions", {**COMPLETION, "n": 0}, "n"),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": [10**6]}, "stop_token_ids"),
    ("/v1/completions", {**COMPLETION, "prompt": []}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [1, -5]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [7] * 300}, "prompt"),  # over the context length
    ("/v1/completions", {**COMPLETION, "prompt": None}, "prompt"),
    ("/v1/completions", {"model": "m"}, "prompt"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"5": 101.0}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {str(10**6): 1.0}}, "logit_bias"),  # past the vocabulary
    ("/v1/completions", {**COMPLETION, "suffix": "!"}, "suffix"),  # known, not implemented
    ("/v1/completions", {**COMPLETION, "min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {**COMPLETION, "no_stop_trim": "yes"}, "no_stop_trim"),
    ("/v1/completions", {**COMPLETION, "stop_regex": "(a"}, "stop_regex"),
    ("/v1/completions", {**COMPLETION, "echo": True, "logprobs": 1}, "echo"),  # no input logprobs on this engine
    ("/v1/completions", b'{"prompt": "Hello", ', None),  # malformed JSON
    ("/v1/completions", [1, 2], None),  # not an object
    ("/v1/chat/completions", {"model": "m"}, "messages"),
    ("/v1/chat/completions", {"model": "m", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages[0].content"),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "max_completion_tokens": -2}, "max_completion_tokens"),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "response_format": {"type": "json_schema"}},
     "response_format"),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "response_format": {"type": "xml"}},
     "response_format.type"),
    ("/v1/completions", {**COMPLETION, "regex": "a(b"}, "regex"),
    ("/generate", {"text": "Hello", "sampling_params": {"json_schema": "{oops"}}, "sampling_params.json_schema"),
    ("/generate", {"text": "Hello", "logprob_start_len": 0}, "logprob_start_len"),  # not enabled on this engine
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x " * 400}]}, "messages"),
    ("/generate", {"text": "Hello", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ("/generate", {"text": "Hello", "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
    ("/generate", {"text": "Hello", "input_ids": [1]}, "text"),
    ("/generate", {"input_ids": [-1]}, "input_ids"),
    ("/generate", {"text": ["a", "b"], "stream": True}, "stream"),
    ("/generate", {"text": 5}, "text"),
]


def test_bad_requests_get_a_400_naming_the_field(served):
    for path, body, param in BAD:
        for stream in (False, True) if path.startswith("/v1") and isinstance(body, dict) else (None,):
            send = {**body, "stream": stream} if stream is not None else body
            kw = {"content": send, "headers": {"content-type": "application/json"}} if isinstance(send, bytes) \
                else {"json": send}
            r = served.http.post(path, **kw)
            err = r.json().get("error") if r.headers.get("content-type", "").startswith("application/json") else None
            assert r.status_code == 400 and err is not None, (path, body, r.status_code, r.text[:300])
            assert err["param"] == param and err["type"] == "invalid_request_error" and err["code"] == 400, (body, err)
            assert param is None or err["message"].startswith(param), err
    # Unknown fields are ignored (clients send `user`, `metadata`, ...), whatever their type.
    r = served.http.post("/v1/completions", json={**COMPLETION, "user": 5, "metadata": [1], "not_a_field": {"a": 1}})
    assert r.status_code == 200, r.text
    r = served.http.post("/nowhere", json={})
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    _idle(served)


def test_structured_output_through_openai_and_native_endpoints(served):
    """response_format json_schema (OpenAI), regex (SGLang's extra) and /generate's sampling_params:
    the texts follow them, greedy and streamed alike, under EAGLE3."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                               "year": {"type": "integer", "minimum": 1000, "maximum": 2100}},
              "required": ["city", "year"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    for stream in (False, True):
        r = served.client.chat.completions.create(model="m", messages=CHAT, max_tokens=64, response_format=fmt,
                                                  stream=stream, **GREEDY)
        text = _stream_text(r, chat=True)[0] if stream else r.choices[0].message.content
        doc = json.loads(text)
        assert doc["city"] in ("Paris", "Rome") and 1000 <= doc["year"] <= 2100, text
    r = served.client.completions.create(model="m", prompt="The answer:", max_tokens=16, **GREEDY,
                                         extra_body={"regex": "(yes|no)[.!]"})
    assert re.fullmatch("(yes|no)[.!]", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = served.http.post("/generate", json={"text": "Say:", "sampling_params": {
        "max_new_tokens": 16, "temperature": 0, "ebnf": 'root ::= "A" [0-9] [0-9]'}})
    assert re.fullmatch("A[0-9][0-9]", r.json()["text"]), r.text
    _idle(served)


def test_an_internal_failure_is_a_500_for_that_request_only(served, monkeypatch):
    real = served.engine.generate_stream_async

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(served.engine, "generate", broken)  # whole answers
    monkeypatch.setattr(served.engine, "generate_stream_async", broken)  # streams
    for stream in (False, True):
        r = served.http.post("/v1/completions", json={**COMPLETION, "stream": stream})
        assert r.status_code == 500 and "boom" in r.json()["error"]["message"], r.text

    def breaks_mid_stream(*args, **kwargs):
        chunks = real(*args, **kwargs)

        async def gen():
            yield await anext(chunks)
            raise RuntimeError("lost mid-stream")
        return gen()

    monkeypatch.setattr(served.engine, "generate_stream_async", breaks_mid_stream)
    with pytest.raises(openai.APIError, match="lost mid-stream"):
        _stream_text(served.client.completions.create(model="m", prompt="Hello", max_tokens=30, stream=True,
                                                      extra_body={"ignore_eos": True}, **GREEDY), False)
    monkeypatch.undo()
    r = served.client.completions.create(**COMPLETION, **GREEDY)
    assert r.choices[0].text
    _idle(served)  # the stream that failed was aborted


# ----------------------------------------------------------------------------- disconnects
def _generated(served) -> int:
    return served.info()["num_generated_tokens"]


def _wait_idle(served, deadline: float = 20.0) -> None:
    end = time.time() + deadline
    while True:
        info = served.info()
        if info["num_running_requests"] == 0 and info["num_waiting_requests"] == 0:
            return
        assert time.time() < end, info
        time.sleep(0.02)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": "m", "prompt": "Hello", "max_tokens": 240, "ignore_eos": True, "stream": True}),
    ("/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 240, "ignore_eos": True}, "stream": True}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT, "max_tokens": 240, "ignore_eos": True}),
])
def test_a_client_that_disconnects_has_its_request_aborted(served, path, body):
    """Streamed: the client reads one event and closes. Not streamed: the client gives up waiting.
    Either way the engine stops the request long before its max tokens and every page is free."""
    before = _generated(served)
    if body.get("stream"):
        with httpx.Client(base_url=served.url, timeout=TIMEOUT) as c, c.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            next(r.iter_lines())
    else:
        with httpx.Client(base_url=served.url, timeout=0.1) as c, pytest.raises(httpx.ReadTimeout):
            c.post(path, json=body)
    _wait_idle(served)
    assert _generated(served) - before < 200, "the request ran on after its client left"
    _idle(served)


# ----------------------------------------------------------------------------- SGLang's endpoints
def test_generate_whole_and_streamed(served):
    sp = {"max_new_tokens": 16, **GREEDY}
    ref = served.engine.generate(prompt="Once upon a time", sampling_params=sp)
    r = served.http.post("/generate", json={"text": "Once upon a time", "sampling_params": sp})
    assert r.status_code == 200
    out = r.json()
    assert out["text"] == ref["text"] and out["output_ids"] == ref["output_ids"]
    assert out["meta_info"]["completion_tokens"] == len(ref["output_ids"])
    # input_ids, a batch
    ids = served.engine.tokenizer.encode("Once upon a time").ids
    r = served.http.post("/generate", json={"input_ids": [ids, ids], "sampling_params": sp})
    assert [o["output_ids"] for o in r.json()] == [ref["output_ids"]] * 2
    # streamed: SGLang's events carry the text and ids so far
    with served.http.stream("POST", "/generate", json={"input_ids": ids, "sampling_params": sp, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and len(lines) > 2
    events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    for a, b in zip(events, events[1:]):
        assert b["text"].startswith(a["text"]) and b["output_ids"][:len(a["output_ids"])] == a["output_ids"]
    assert events[-1]["text"] == ref["text"] and events[-1]["output_ids"] == ref["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]


def test_generate_streams_segments_with_stream_output(served):
    """`--stream-output` (SGLang's incremental_streaming_output): each event carries only what is
    new: its text, ids and the logprob entries not sent before; joined, they are the whole answer."""
    sp = {"max_new_tokens": 12, "ignore_eos": True, **GREEDY}
    ids = served.engine.tokenizer.encode("Once upon a time").ids
    ref = served.engine.generate(input_ids=ids, sampling_params=sp, return_logprob=True, top_logprobs_num=2)
    state = served.server.config.app.state.jspec
    state.stream_output = True
    try:
        with served.http.stream("POST", "/generate", json={"input_ids": ids, "sampling_params": sp, "stream": True,
                                                           "return_logprob": True, "top_logprobs_num": 2}) as r:
            lines = [line for line in r.iter_lines() if line]
    finally:
        state.stream_output = False
    events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]" and len(events) >= 2
    joined = lambda key: [e for ev in events for e in ev["meta_info"][key]]  # noqa: E731
    assert [t for ev in events for t in ev["output_ids"]] == ref["output_ids"]
    assert "".join(ev["text"] for ev in events) == ref["text"]
    want = ref["meta_info"]
    assert [t for _, t, _ in joined("output_token_logprobs")] == ref["output_ids"]
    assert [lp for lp, _, _ in joined("output_token_logprobs")] == pytest.approx(
        [lp for lp, _, _ in want["output_token_logprobs"]], abs=1e-5)
    assert [[t for _, t, _ in row] for row in joined("output_top_logprobs")] == \
        [[t for _, t, _ in row] for row in want["output_top_logprobs"]]
    assert sum(len(ev["meta_info"]["output_token_logprobs"]) > 0 for ev in events) >= 2  # in segments, not at once
    assert events[-1]["meta_info"]["completion_tokens"] == len(ref["output_ids"])


def test_health_info_and_flush(served):
    assert served.http.get("/health").status_code == 200
    assert served.http.get("/health_generate").status_code == 200
    info = served.info()
    assert info["speculative_algorithm"] == "EAGLE3" and info["served_model_name"] == tiny_dir("qwen3")
    assert info["num_total_pages"] > 0 and "num_http_requests_in_flight" in info
    model = served.http.get("/get_model_info").json()
    assert model["model_path"] == tiny_dir("qwen3") and model["vocab_size"] == served.engine.config.vocab_size
    assert model["has_chat_template"] and model["context_length"] == 256
    served.client.completions.create(**COMPLETION, **GREEDY)
    _wait_idle(served)
    for method in ("GET", "POST"):  # SGLang takes both
        r = served.http.request(method, "/flush_cache")
        assert r.status_code == 200, r.text
    info = served.info()
    assert info["num_cached_pages"] == 0 and info["num_free_pages"] == info["num_total_pages"]


def test_metrics_count_requests_tokens_and_latencies(served):
    _wait_idle(served)
    before = served.metrics()
    r = served.client.completions.create(model="m", prompt="The cat", max_tokens=9, extra_body={"ignore_eos": True}, **GREEDY)
    _stream_text(served.client.completions.create(model="m", prompt="The cat", max_tokens=5, extra_body={"ignore_eos": True},
                                                  stream=True, **GREEDY), False)
    served.http.post("/v1/completions", json={**COMPLETION, "top_k": 0})  # a 400
    after = served.metrics()

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("jspec:num_requests_total", endpoint="/v1/completions", status="200") == 2
    assert delta("jspec:num_requests_total", endpoint="/v1/completions", status="400") == 1
    assert delta("jspec:generation_tokens_total") == 14
    assert delta("jspec:prompt_tokens_total") == 2 * r.usage.prompt_tokens
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert delta(f"jspec:{name}_count") == 2, name
        assert delta(f"jspec:{name}_bucket", le="+Inf") == 2, name
    # Speculative steps: the accept-length histogram grew; gauges come from the engine at scrape time.
    assert delta("jspec:spec_accept_length_count") >= 3
    info = served.info()
    assert after[("jspec:num_total_pages", ())] == info["num_total_pages"]
    assert after[("jspec:num_running_reqs", ())] == 0 and after[("jspec:num_queue_reqs", ())] == 0
    # The server process's garbage collections, timed (serving allocates: young ones happened).
    young = (("generation", "0"),)
    assert after[("jspec:gc_pauses_total", young)] > 0
    assert 0 < after[("jspec:gc_pause_max_seconds", young)] <= after[("jspec:gc_pause_seconds_total", young)]


def test_bench_serve_through_http(served, tmp_path):
    out = tmp_path / "http.jsonl"
    rc = main(["bench", "serve", "--backend", "http", "--base-url", served.url, "--model-path", tiny_dir("qwen3"),
               "--dataset-name", "random", "--num-prompts", "6", "--random-input-len", "12", "--random-output-len", "7",
               "--random-range-ratio", "1.0", "--max-concurrency", "3", "--output-file", str(out)])
    assert rc == 0
    rec = [json.loads(line) for line in open(out)][-1]
    m = rec["metrics"]
    assert rec["backend"] == "http" and rec["base_url"] == served.url and rec["errors"] == []
    assert m["completed"] == 6 and m["total_output_tokens"] == 42 == rec["engine_generated_tokens"]
    assert m["mean_ttft_ms"] > 0 and m["mean_tpot_ms"] > 0 and m["accept_length"] > 1.0
    assert rec["engine_args"]["speculative_algorithm"] == "EAGLE3" and rec["engine_args"]["page_size"] == 16
    # Logprobs asked over HTTP: /generate takes them beside the sampling parameters.
    lp = tmp_path / "lp.jsonl"
    assert main(["bench", "serve", "--backend", "http", "--base-url", served.url, "--model-path", tiny_dir("qwen3"),
                 "--dataset-name", "random", "--num-prompts", "2", "--random-input-len", "12", "--random-output-len",
                 "4", "--random-range-ratio", "1.0", "--top-logprobs-num", "2", "--output-file", str(lp)]) == 0
    rec = [json.loads(line) for line in open(lp)][-1]
    assert rec["errors"] == [] and rec["metrics"]["completed"] == 2 and rec["settings"]["top_logprobs_num"] == 2
    # The constraint alternated on the server's engine, the client in this process.
    alt = tmp_path / "alt.jsonl"
    assert main(["bench", "serve", "--backend", "http", "--base-url", served.url, "--model-path", tiny_dir("qwen3"),
                 "--dataset-name", "random", "--num-prompts", "3", "--random-input-len", "12", "--random-output-len",
                 "5", "--random-range-ratio", "1.0", "--max-concurrency", "3", "--regex", "[a-z]+",
                 "--alternate-constraint", "1", "--output-file", str(alt)]) == 0
    recs = [json.loads(line) for line in open(alt)]
    assert [(r["constraint"], r["backend"]) for r in recs] == [("off", "http"), ("on", "http")]
    for r in recs:
        assert r["metrics"]["completed"] == 3 and r["errors"] == [] and r["base_url"] == served.url
        assert r["settings"]["regex"] == ("[a-z]+" if r["constraint"] == "on" else None)
        # The server reports its EOS ids, which both sides bias away (a grammar ends at EOS).
        assert r["settings"]["eos_logit_bias"] == {str(t): -100.0 for t in served.info()["eos_token_ids"]} != {}


# ----------------------------------------------------------------------------- SIGTERM
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_in_flight_requests_then_exits(served, tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "jspec.cli", "serve", "--model-path", tiny_dir("qwen3"), *FLAGS,
                             "--compilation-cache-dir", served.cache_dir, "--port", str(port), "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None and time.time() < deadline, open(tmp_path / "serve.log").read()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        events: list = []
        body = {"text": "Hello", "sampling_params": {"max_new_tokens": 230, "ignore_eos": True, **GREEDY},
                "stream": True}
        first = threading.Event()

        def read():
            with httpx.stream("POST", url + "/generate", json=body, timeout=TIMEOUT) as r:
                for line in r.iter_lines():
                    if line:
                        events.append(line)
                        first.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert first.wait(TIMEOUT)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        # Draining: no new connections (or, on a connection still open, a 503).
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2)
        reader.join(TIMEOUT)
        assert proc.wait(TIMEOUT) == 0, open(tmp_path / "serve.log").read()[-3000:]
        assert not reader.is_alive() and events[-1] == "data: [DONE]"
        last = json.loads(events[-2][len("data: "):])
        assert last["meta_info"]["completion_tokens"] == 230 and last["meta_info"]["finish_reason"]["type"] == "length"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
