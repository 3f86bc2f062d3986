"""OpenAI requests -> engine sub-requests, engine outputs -> OpenAI responses and stream chunks.

One OpenAI request may become several engine requests: one per prompt of a batched completion,
times `n`. The engine serves one sample per request (`SamplingParams.n` must be 1), so `n`
copies are submitted; with a `seed`, copy j gets seed + j, so the samples differ and the request
is still reproducible (without a seed each copy draws its own from the engine's random_seed).
Choices are numbered prompt-major, as OpenAI numbers them.
"""

from __future__ import annotations

import json
import time
import uuid

from jspec.server.errors import RequestError

SEED_LIMIT = 2**31  # the engine's seed range
MAX_N = 128  # choices per request: more would be one client filling the whole batch

# OpenAI / SGLang body fields that are engine sampling keys of the same name.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos",
                 "repetition_penalty", "frequency_penalty", "presence_penalty", "seed", "skip_special_tokens",
                 "regex", "json_schema", "ebnf", "logit_bias", "no_stop_trim", "stop_regex")


def engine_names(kind: str, max_tokens_field: str = "max_tokens") -> dict[str, str]:
    """Engine field -> the endpoint's field, for error messages (see `errors.from_engine`)."""
    prompt = "messages" if kind == "chat" else "prompt"
    return {"max_new_tokens": max_tokens_field, "sampling_params.max_new_tokens": max_tokens_field,
            "sampling_params.min_new_tokens": "min_tokens",
            "return_logprob": "logprobs", "top_logprobs_num": "top_logprobs" if kind == "chat" else "logprobs",
            "input_ids": prompt, "prompt": prompt, "stream": "stream"}


def sampling_params(body, max_new_tokens: int | None) -> dict:
    sp = {k: getattr(body, k) for k in SAMPLING_KEYS if getattr(body, k) is not None}
    if body.min_tokens is not None:  # SGLang's extra, the engine's min_new_tokens
        sp["min_new_tokens"] = body.min_tokens
    if max_new_tokens is not None:
        sp["max_new_tokens"] = max_new_tokens
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type != "text":
        # OpenAI's JSON modes become the engine's json_schema ("json_object": any JSON object).
        if fmt.type == "json_schema" and (fmt.json_schema is None or fmt.json_schema.schema_ is None):
            raise RequestError("response_format.json_schema.schema: required for type json_schema",
                               "response_format")
        schema = {"type": "object"} if fmt.type == "json_object" else fmt.json_schema.schema_
        if any(k in sp for k in ("regex", "json_schema", "ebnf")):
            raise RequestError("response_format: give either response_format or regex / json_schema / ebnf",
                               "response_format")
        sp["json_schema"] = json.dumps(schema)
    return sp


def check_n(n: int) -> None:
    if not 1 <= n <= MAX_N:
        raise RequestError(f"n: must be in [1, {MAX_N}], got {n}", "n")


def fan_out(sp: dict, n: int) -> list[dict]:
    """n sampling dicts for n samples of one prompt (distinct seeds when one is given)."""
    seed = sp.get("seed")
    if n == 1 or seed is None:
        return [sp] * n
    # The first copy keeps the seed as given, so the engine still validates it.
    return [sp] + [{**sp, "seed": (seed + j) % SEED_LIMIT} for j in range(1, n)]


def prompt_ids(prompt, tokenizer) -> list[list[int]]:
    """A completion's prompt (text, ids, or a batch of either) as token ids per prompt."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif not prompt:
        raise RequestError("prompt: must not be empty", "prompt")
    elif isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], str):
        if tokenizer is None:
            raise RequestError("prompt: this server has no tokenizer (--skip-tokenizer-init); send token ids",
                               "prompt")
        return [tokenizer.encode(p).ids for p in prompt]
    return [list(p) for p in prompt]


def prompt_texts(prompt, ids: list[list[int]], tokenizer) -> list[str]:
    """The text each prompt echoes: as sent, or its token ids decoded ("" without a tokenizer)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], str):
        return list(prompt)
    return ["" if tokenizer is None else tokenizer.decode(p, skip_special_tokens=False) for p in ids]


def check_context(ids: list[int], context_length: int, param: str) -> None:
    if len(ids) > context_length:
        raise RequestError(f"{param}: the prompt has {len(ids)} tokens, over the context length {context_length}",
                           param)


def finish_reason(reason) -> str | None:
    if not isinstance(reason, dict):
        return None
    return {"stop": "stop", "length": "length"}.get(reason.get("type"), reason.get("type"))


def abort_message(meta: dict) -> str | None:
    """The engine's message for a request it ended early (its step failed, it shut down)."""
    reason = meta.get("finish_reason")
    if isinstance(reason, dict) and reason.get("type") == "abort":
        return str(reason.get("message", "aborted"))
    return None


class Responder:
    """Builds the OpenAI answers of one request: kind "completion" or "chat"; logprobs: whether
    the client asked for them (top: alternatives per token)."""

    def __init__(self, kind: str, model: str, tokenizer, *, logprobs: bool = False, top: int = 0,
                 echo: list[str] | None = None, n: int = 1):
        self.kind, self.model, self.tokenizer = kind, model, tokenizer
        self.logprobs, self.top = logprobs, top
        # Completions' echo: each prompt's text (choice i answers prompt i // n) goes before its
        # choices' text, with the prompt tokens' logprobs (the engine's input token logprobs) first.
        self.echo, self.n = echo, n
        self._echoed: set[int] = set()  # stream choices whose prompt went out
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if kind == "chat" else "text_completion"

    def _token(self, tok: int) -> str:
        if self.tokenizer is None:
            return str(tok)
        return self.tokenizer.decode([int(tok)], skip_special_tokens=False)

    def _logprobs(self, meta: dict, start: int, end: int, text_offset: int = 0):
        """The logprobs of output tokens [start, end), in the endpoint's format."""
        if not self.logprobs:
            return None
        rows = meta.get("output_token_logprobs", [])[start:end]
        tops = meta.get("output_top_logprobs", [])[start:end] if self.top else [[] for _ in rows]
        if self.kind == "chat":
            def entry(lp, tok):
                s = self._token(tok)
                return {"token": s, "logprob": lp, "bytes": list(s.encode())}
            return {"content": [{**entry(lp, tok), "top_logprobs": [entry(a, t) for a, t, _ in top]}
                                for (lp, tok, _), top in zip(rows, tops)]}
        tokens = [self._token(tok) for _, tok, _ in rows]
        offsets = []
        for s in tokens:
            offsets.append(text_offset)
            text_offset += len(s)
        return {"tokens": tokens, "token_logprobs": [lp for lp, _, _ in rows],
                "top_logprobs": [{self._token(t): a for a, t, _ in top} for top in tops] if self.top else None,
                "text_offset": offsets}

    def echo_len(self, index: int) -> int:
        """Characters of choice index's echoed prompt (its output's text offsets start there)."""
        return 0 if self.echo is None else len(self.echo[index // self.n])

    def _echo(self, index: int, meta: dict, text: str, lp: dict | None) -> tuple[str, dict | None]:
        """Choice index's text and logprobs with its prompt's put before them."""
        prompt = self.echo[index // self.n]
        if not self.logprobs:
            return prompt + text, lp
        rows = meta.get("input_token_logprobs", [])
        tops = meta.get("input_top_logprobs", []) if self.top else [None] * len(rows)
        tokens = [self._token(tok) for _, tok, _ in rows]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        top = [None if row is None else {self._token(t): a for a, t, _ in row} for row in tops]
        return prompt + text, {"tokens": tokens + lp["tokens"], "token_logprobs": [a for a, _, _ in rows] +
                               lp["token_logprobs"], "top_logprobs": top + lp["top_logprobs"] if self.top else None,
                               "text_offset": offsets + lp["text_offset"]}

    def _envelope(self, choices: list, **extra) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    # ------------------------------------------------------------------------- whole answers
    def response(self, outs: list[dict], prompt_metas: list[dict]) -> dict:
        """The answer to a non-streamed request: outs are the engine's results in choice order;
        prompt_metas one meta_info per distinct prompt (prompt tokens count once per prompt)."""
        choices = []
        for i, o in enumerate(outs):
            meta = o["meta_info"]
            text, lp = o["text"], self._logprobs(meta, 0, len(o["output_ids"]), self.echo_len(i))
            if self.echo is not None:
                text, lp = self._echo(i, meta, text, lp)
            choice = {"index": i, "logprobs": lp, "finish_reason": finish_reason(meta.get("finish_reason")),
                      "matched_stop": (meta.get("finish_reason") or {}).get("matched")}
            if self.kind == "chat":
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        return self._envelope(choices, usage=self.usage([o["meta_info"] for o in outs], prompt_metas))

    @staticmethod
    def usage(metas: list[dict], prompt_metas: list[dict]) -> dict:
        prompt = sum(m.get("prompt_tokens", 0) for m in prompt_metas)
        completion = sum(m.get("completion_tokens", 0) for m in metas)
        cached = sum(m.get("cached_tokens", 0) for m in prompt_metas)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    # ------------------------------------------------------------------------- stream chunks
    def first_chunk(self, index: int) -> dict | None:
        """Chat streams open each choice with the assistant role, as OpenAI's do."""
        if self.kind != "chat":
            return None
        return self._chunk(index, {"role": "assistant", "content": ""}, None, None)

    def chunk(self, index: int, text: str, meta: dict, start: int, end: int, text_offset: int,
              final: bool) -> dict:
        """One stream chunk of choice index: new text, the logprobs of tokens [start, end) (under
        echo, the choice's first chunk carries its prompt before them)."""
        lp = self._logprobs(meta, start, end, text_offset)
        if self.echo is not None and index not in self._echoed:
            self._echoed.add(index)
            text, lp = self._echo(index, meta, text, lp)
        reason = finish_reason(meta.get("finish_reason")) if final else None
        body = {"content": text} if self.kind == "chat" else text
        out = self._chunk(index, body, lp, reason)
        if final:
            out["choices"][0]["matched_stop"] = (meta.get("finish_reason") or {}).get("matched")
        return out

    def _chunk(self, index: int, body, lp, reason) -> dict:
        choice = {"index": index, "logprobs": lp, "finish_reason": reason}
        choice["delta" if self.kind == "chat" else "text"] = body
        return self._envelope([choice], object=f"{self.object}.chunk" if self.kind == "chat" else self.object)

    def usage_chunk(self, metas: list[dict], prompt_metas: list[dict]) -> dict:
        return self._envelope([], usage=self.usage(metas, prompt_metas),
                              object=f"{self.object}.chunk" if self.kind == "chat" else self.object)
