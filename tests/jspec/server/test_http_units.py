"""The server's parts that need no running engine: chat templates against transformers (the
oracle), streamed text against the engine's rule for the final text, error bodies, the OpenAI
logprobs formats, and the command lines' checks."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from jspec.cli import main
from jspec.errors import InvalidRequestError
from jspec.runtime.detokenizer import find_stop, find_stop_regex
from jspec.server.chat_template import ChatTemplate, ChatTemplateError
from jspec.server.errors import from_engine, validation_message
from jspec.server.openai_adapter import Responder, fan_out
from jspec.server.stream_text import StreamText
from jspec.tiny import tiny_dir

# A template that uses what real ones use: a system message handled apart, tojson, loop controls,
# raise_exception, whitespace control, a special token variable.
RICH = """{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}\
{% set rest = messages[1:] %}{% else %}{% set sys = '' %}{% set rest = messages %}{% endif %}
{% if tools %}Tools: {{ tools | tojson }}
{% endif %}
{% for m in rest %}
  {% if m['role'] == 'tool' %}{% continue %}{% endif %}
  {% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('roles must alternate') }}{% endif %}
  <|{{ m['role'] }}|>{{ (sys + ' ' if loop.first and sys else '') + m['content'] | trim }}
{% endfor %}
{% if add_generation_prompt %}<|assistant|>{% endif %}"""


@pytest.fixture(scope="module")
def hf_tokenizer():
    return AutoTokenizer.from_pretrained(tiny_dir("qwen3"))


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(tiny_dir("qwen3") + "/tokenizer.json")


CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "And?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Why?  "}],
]


@pytest.mark.parametrize("messages", CHATS)
def test_shipped_chat_template_renders_as_transformers(messages, hf_tokenizer):
    ours = ChatTemplate.from_dir(tiny_dir("qwen3"))
    for gen in (True, False):
        want = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours.render(messages, add_generation_prompt=gen) == want


@pytest.mark.parametrize("messages", CHATS + [[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                              {"role": "tool", "content": "x"}]])
def test_a_richer_template_renders_as_transformers(messages, hf_tokenizer):
    tools = [{"type": "function", "function": {"name": "f", "description": "<é>"}}]
    ours = ChatTemplate(RICH, {"bos_token": "<s>"})
    want = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, chat_template=RICH,
                                            tools=tools, bos_token="<s>")
    assert ours.render(messages, tools=tools) == want


def test_template_errors_and_the_sandbox():
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ChatTemplate(RICH).render([{"role": "assistant", "content": "x"}])
    with pytest.raises(ChatTemplateError):  # the sandbox: no way from a string to Python's internals
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}").render([])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")
    assert ChatTemplate.from_dir("/nonexistent") is None


def _engine_text(tokenizer, ids, stops, patterns=(), min_new=0, keep=False):
    """`Engine.generate`'s final text, the tokens it keeps and its finish reason: decoded token by
    token, cut at the first stop string or stop-regex match found once `min_new` tokens are out
    (kept in the text with `keep`, `no_stop_trim`)."""
    st = StreamText(tokenizer)  # no stops: only its detokenizer, as the engine's
    for k in range(1, len(ids) + 1):
        before = len(st.state.text)
        st.detok.step(st.state, ids[:k])
        found = [f for f in (find_stop(st.state.text, stops, before), find_stop_regex(st.state.text, patterns, before))
                 if f is not None and k >= min_new]
        if found:
            start, matched = min(found)
            return st.detok.decode(ids[:k]) if keep else st.state.text[:start], ids[:k], {"type": "stop",
                                                                                         "matched": matched}
    return st.detok.decode(ids), ids, {"type": "length"}


STOPS = [dict(stops=s) for s in ([], ["."], [" capital of", "xyz"], ["s a", "e c"], ["France is a capital"])] + [
    dict(stops=[], patterns=[r"capital\b"]),  # a bounded stop regex: the text streams as it grows
    dict(stops=[], patterns=[r"Fr[a-z]*"]),  # an unbounded one: held back to the end
    dict(stops=["."], patterns=[r"of F"]),  # the earlier of a string and a match
    dict(stops=[" capital of"], min_new=6),  # the first " capital of" completes too early to count
    dict(stops=[" capital of"], patterns=[r"which"], keep=True),  # no_stop_trim: nothing cut, nothing held
]


@pytest.mark.parametrize("case", STOPS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_text_adds_up_to_the_final_text(tokenizer, case, chunk):
    ids = tokenizer.encode("The capital of France is a capital of France, which is a capital.").ids
    final, used, reason = _engine_text(tokenizer, ids, **case)
    st = StreamText(tokenizer, stop=case["stops"], stop_regex=case.get("patterns"), min_new_tokens=case.get("min_new", 0),
                    no_stop_trim=case.get("keep", False))
    pieces = []
    for i in range(0, len(used), chunk):
        st.add(used[i:i + chunk])
        piece = st.delta()
        pieces.append(piece)
        # Nothing sent may be taken back: every prefix sent is a prefix of the final text.
        assert final.startswith("".join(pieces)), (pieces, final)
    pieces.append(st.finish(reason))
    assert "".join(pieces) == final and st.text == final
    if case.get("min_new") or case.get("keep"):  # the case does what it says: a later stop, or a kept one
        assert reason["type"] == "stop" and case["stops"][0] in final


def test_engine_errors_name_the_endpoint_field():
    e = from_engine(InvalidRequestError("sampling_params.top_p: must be in (0, 1], got 1.5"), {}, flat_sampling=True)
    assert (e.param, e.message) == ("top_p", "top_p: must be in (0, 1], got 1.5")
    e = from_engine(InvalidRequestError("max_new_tokens: too many"), {"max_new_tokens": "max_tokens"})
    assert (e.param, e.message) == ("max_tokens", "max_tokens: too many")
    e = from_engine(InvalidRequestError("sampling_params.seed: bad"))  # native: the engine's own names
    assert e.param == "sampling_params.seed"
    msg, param = validation_message([{"type": "string_type", "loc": ("body", "prompt", "str"), "msg": "A", "input": 1},
                                     {"type": "list_type", "loc": ("body", "prompt", "list[int]"), "msg": "B"}])
    assert param == "prompt" and msg == "prompt: does not match any allowed type (A; B), got 1"
    msg, param = validation_message([{"type": "literal_error", "loc": ("body", "messages", 2, "role"), "msg": "C",
                                      "input": "x"}])
    assert param == "messages[2].role" and msg == "messages[2].role: C, got 'x'"


def test_n_copies_get_consecutive_seeds():
    assert [s.get("seed") for s in fan_out({"seed": 2**31 - 1}, 3)] == [2**31 - 1, 0, 1]
    assert fan_out({"temperature": 1.0}, 2) == [{"temperature": 1.0}] * 2


def test_logprobs_formats(tokenizer):
    ids = tokenizer.encode("Hello world").ids
    meta = {"output_token_logprobs": [(-0.5, ids[0], None), (-1.25, ids[1], None)],
            "output_top_logprobs": [[(-0.5, ids[0], None), (-2.0, 7, None)], [(-1.25, ids[1], None), (-3.0, 8, None)]],
            "finish_reason": {"type": "length"}, "prompt_tokens": 3, "completion_tokens": 2}
    tok = [tokenizer.decode([i], skip_special_tokens=False) for i in (*ids, 7, 8)]
    comp = Responder("completion", "m", tokenizer, logprobs=True, top=2)
    lp = comp.response([{"text": "Hello world", "output_ids": ids, "meta_info": meta}], [meta])["choices"][0]["logprobs"]
    assert lp == {"tokens": tok[:2], "token_logprobs": [-0.5, -1.25],
                  "top_logprobs": [{tok[0]: -0.5, tok[2]: -2.0}, {tok[1]: -1.25, tok[3]: -3.0}],
                  "text_offset": [0, len(tok[0])]}
    chat = Responder("chat", "m", tokenizer, logprobs=True, top=2)
    # the second token of a streamed chunk: logprobs of tokens [1, 2)
    c = chat.chunk(0, " world", meta, 1, 2, 5, final=True)["choices"][0]
    assert c["finish_reason"] == "length" and c["delta"] == {"content": " world"}
    entry = [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in ((tok[1], -1.25), (tok[3], -3.0))]
    assert c["logprobs"] == {"content": [{**entry[0], "top_logprobs": entry}]}


def test_echo_puts_the_prompt_and_its_logprobs_first(tokenizer):
    ids = tokenizer.encode("Hello world").ids
    meta = {"output_token_logprobs": [(-0.5, 7, None)], "output_top_logprobs": [[(-0.5, 7, None)]],
            "input_token_logprobs": [(None, ids[0], None), (-2.5, ids[1], None)],
            "input_top_logprobs": [None, [(-1.5, 8, None)]],
            "finish_reason": {"type": "length"}, "prompt_tokens": 2, "completion_tokens": 1}
    tok = {i: tokenizer.decode([i], skip_special_tokens=False) for i in (*ids, 7, 8)}
    want = {"tokens": [tok[ids[0]], tok[ids[1]], tok[7]], "token_logprobs": [None, -2.5, -0.5],
            "top_logprobs": [None, {tok[8]: -1.5}, {tok[7]: -0.5}],
            "text_offset": [0, len(tok[ids[0]]), len("Hello world")]}
    comp = Responder("completion", "m", tokenizer, logprobs=True, top=1, echo=["Hello world"], n=2)
    out = comp.response([{"text": "!", "output_ids": [7], "meta_info": meta}] * 2, [meta])
    assert [c["text"] for c in out["choices"]] == ["Hello world!"] * 2
    assert out["choices"][1]["logprobs"] == want
    # Streamed: the choice's first chunk carries the prompt, later chunks only their tokens.
    first = comp.chunk(1, "!", meta, 0, 1, comp.echo_len(1), final=False)["choices"][0]
    assert first["text"] == "Hello world!" and first["logprobs"] == want
    later = comp.chunk(1, "?", meta, 0, 1, 12, final=True)["choices"][0]
    assert later["text"] == "?" and later["logprobs"]["text_offset"] == [12]


@pytest.mark.parametrize("argv,flag", [
    (["bench", "serve", "--backend", "http", "--model-path", "x"], "--base-url"),
    (["bench", "serve", "--backend", "http", "--base-url", "http://127.0.0.1:1", "--model-path", "x",
      "--page-size", "8"], "--page-size"),
    (["bench", "serve", "--backend", "http", "--base-url", "http://127.0.0.1:1", "--model-path", "x",
      "--speculative-algorithm", "EAGLE3"], "--speculative-algorithm"),
    (["bench", "serve", "--backend", "http", "--base-url", "http://127.0.0.1:1", "--model-path", "x",
      "--profile", "/tmp/t"], "--profile"),
    (["bench", "serve", "--base-url", "http://127.0.0.1:1", "--model-path", "x"], "--base-url"),
    (["serve", "--model-path", "x", "--speculative-num-steps", "2"], "--speculative-num-steps"),
    (["serve", "--model-path", "x", "--port", "70000"], "--port"),
])
def test_command_line_errors_name_the_flag(argv, flag, capsys):
    assert main(argv) == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("value", ["fast", "0", "-1"])
def test_a_bad_switch_interval_names_the_variable(value, monkeypatch, capsys):
    monkeypatch.setenv("JSPEC_SWITCH_INTERVAL", value)
    assert main(["serve", "--model-path", "x"]) == 2
    assert "JSPEC_SWITCH_INTERVAL" in capsys.readouterr().err


def test_the_switch_interval_defaults_and_can_be_set(monkeypatch):
    from jspec.runtime.gil import SWITCH_INTERVAL, switch_interval

    monkeypatch.delenv("JSPEC_SWITCH_INTERVAL", raising=False)
    assert switch_interval() == SWITCH_INTERVAL
    monkeypatch.setenv("JSPEC_SWITCH_INTERVAL", "0.002")
    assert switch_interval() == 0.002


def test_an_event_stream_left_before_its_first_event_still_closes():
    """The client is gone before the first event is sent: the events' generator never starts (its
    own cleanup never runs), and on_close (the abort of its requests) runs all the same."""
    import asyncio

    from jspec.server.state import EventStream

    started, closed = [], []

    async def events():
        started.append(True)
        yield "data: x\n\n"

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        await asyncio.sleep(5)  # a slow client: the disconnect wins

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
    asyncio.run(asyncio.wait_for(EventStream(events(), on_close=lambda: closed.append(True))(scope, receive, send), 10))
    assert closed == [True] and started == []
