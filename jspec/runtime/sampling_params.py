"""Per-request sampling parameters: SGLang's keys and defaults, checked once at admission.

A bad value is rejected here with an `InvalidRequestError` whose message starts with the field
name, so it never reaches the device (where a NaN temperature or top_p = 0 would silently produce
garbage for that row). `jspec.runtime.step_inputs.pack` sends validated params to the device,
where they become a `jspec.runtime.sampler.SamplingBatch`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import re
from collections.abc import Mapping

from jspec.errors import InvalidRequestError

# SGLang samples greedily below this temperature: dividing logits by ~0 would overflow.
GREEDY_TEMPERATURE = 1e-5
# Seeds are folded into a PRNG key as 32-bit data; the int32 range is what every client can send.
SEED_LIMIT = 2**31
PENALTY_LIMIT = 2.0
# logit_bias: OpenAI's range of a bias, and the most tokens one request may bias (each prompt step
# carries every admitted request's entries to the device: a bound keeps that input small).
LOGIT_BIAS_LIMIT = 100.0
MAX_LOGIT_BIAS = 128


def _fail(field: str, message: str):
    raise InvalidRequestError(f"sampling_params.{field}: {message}")


def _show(value) -> str:
    return f"{value!r} ({type(value).__name__})"


def _is_int(value) -> bool:
    # bool is an int subclass in Python, but `top_k: true` is a client bug, not 1.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _as_int(field: str, value) -> int:
    if not _is_int(value):
        _fail(field, f"must be an integer, got {_show(value)}")
    return int(value)


def _as_float(field: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(field, f"must be a number, got {_show(value)}")
    if not math.isfinite(value):
        _fail(field, f"must be finite, got {value!r}")
    return float(value)


def _as_bool(field: str, value) -> bool:
    if not isinstance(value, bool):
        _fail(field, f"must be true or false, got {_show(value)}")
    return value


def _strings(field: str, value) -> tuple[str, ...] | None:
    """A string or a list of strings as a tuple (None stays None)."""
    if value is None:
        return None
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        _fail(field, f"must be a string or a list of strings, got {_show(value)}")
    return tuple(items)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """SGLang's sampling keys with SGLang's defaults.

    Construction validates every field except the upper bound of token ids (`stop_token_ids`,
    `logit_bias`), which needs the vocabulary (`check_vocab`, called by `from_dict`). `stop`,
    `stop_regex` and `stop_token_ids` are stored as tuples so the params stay hashable; a single
    `stop` or `stop_regex` string becomes a 1-tuple; `logit_bias` ({token id: bias}, the id an int or its decimal string as in
    OpenAI's JSON) becomes a tuple of (id, bias) pairs sorted by id.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0  # EOS and stop_token_ids are held back (and stops ignored) until this many
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    # Python regular expressions: the request stops once its text holds a match (cut before it)
    stop_regex: tuple[str, ...] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the stop string (or stop-regex match) that ended the request in its text
    n: int = 1
    # Added to the token's logit after the penalties, before temperature and filters (SGLang's order).
    logit_bias: tuple[tuple[int, float], ...] | None = None
    # Structured output (at most one; `jspec.runtime.grammar`): a regular expression, a JSON schema
    # (a JSON string, or a dict that is serialised), an EBNF grammar (GBNF as llama.cpp, or Lark).
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None

    def __post_init__(self):
        # Frozen: normalised values are written through object.__setattr__ once, here.
        for field, value in self._validated().items():
            object.__setattr__(self, field, value)

    def _validated(self) -> dict:
        v = {}
        v["max_new_tokens"] = _as_int("max_new_tokens", self.max_new_tokens)
        if v["max_new_tokens"] < 0:
            _fail("max_new_tokens", f"must be >= 0, got {self.max_new_tokens!r}")
        v["min_new_tokens"] = _as_int("min_new_tokens", self.min_new_tokens)
        if v["min_new_tokens"] < 0:
            _fail("min_new_tokens", f"must be >= 0, got {self.min_new_tokens!r}")
        v["temperature"] = _as_float("temperature", self.temperature)
        if v["temperature"] < 0:
            _fail("temperature", f"must be >= 0, got {self.temperature!r}")
        v["top_p"] = _as_float("top_p", self.top_p)
        if not 0 < v["top_p"] <= 1:
            _fail("top_p", f"must be in (0, 1], got {self.top_p!r}")
        v["top_k"] = _as_int("top_k", self.top_k)
        if v["top_k"] == 0 or v["top_k"] < -1:
            _fail("top_k", f"must be -1 (off) or >= 1, got {self.top_k!r}")
        v["min_p"] = _as_float("min_p", self.min_p)
        if not 0 <= v["min_p"] <= 1:
            _fail("min_p", f"must be in [0, 1], got {self.min_p!r}")
        v["stop"] = self._validated_stop()
        v["stop_token_ids"] = self._validated_stop_token_ids()
        v["stop_regex"] = self._validated_stop_regex()
        v["ignore_eos"] = _as_bool("ignore_eos", self.ignore_eos)
        v["repetition_penalty"] = _as_float("repetition_penalty", self.repetition_penalty)
        if v["repetition_penalty"] <= 0:
            _fail("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        for field in ("frequency_penalty", "presence_penalty"):
            v[field] = _as_float(field, getattr(self, field))
            if not -PENALTY_LIMIT <= v[field] <= PENALTY_LIMIT:
                _fail(field, f"must be in [-2, 2], got {getattr(self, field)!r}")
        if self.seed is not None:
            v["seed"] = _as_int("seed", self.seed)
            if not 0 <= v["seed"] < SEED_LIMIT:
                _fail("seed", f"must be in [0, 2**31), got {self.seed!r}")
        v["skip_special_tokens"] = _as_bool("skip_special_tokens", self.skip_special_tokens)
        v["no_stop_trim"] = _as_bool("no_stop_trim", self.no_stop_trim)
        v["n"] = _as_int("n", self.n)
        if v["n"] < 1:
            _fail("n", f"must be >= 1, got {self.n!r}")
        v["logit_bias"] = self._validated_logit_bias()
        v.update(self._validated_grammar())
        return v

    def _validated_logit_bias(self) -> tuple[tuple[int, float], ...] | None:
        bias = self.logit_bias
        if bias is None:
            return None
        if isinstance(bias, Mapping):
            items = list(bias.items())
        elif isinstance(bias, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in bias):
            items = list(bias)  # the normalised form, as `normalized` hands it back
        else:
            _fail("logit_bias", f"must map token ids to numbers, got {_show(bias)}")
        if len(items) > MAX_LOGIT_BIAS:
            _fail("logit_bias", f"at most {MAX_LOGIT_BIAS} tokens, got {len(items)}")
        out = {}
        for key, value in items:
            if _is_int(key):
                tok = int(key)
            elif isinstance(key, str) and key.strip().isdigit():
                tok = int(key)
            else:
                _fail("logit_bias", f"keys must be token ids (integers or their decimal strings), got {key!r}")
            if tok < 0:
                _fail("logit_bias", f"token ids must be >= 0, got {tok}")
            if tok in out:
                _fail("logit_bias", f"token {tok} is given twice")
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
                    not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:  # NaN fails the range too
                _fail("logit_bias", f"the bias of token {tok} must be a number in [-100, 100], got {_show(value)}")
            out[tok] = float(value)
        return tuple(sorted(out.items())) or None

    def _validated_grammar(self) -> dict:
        v = {}
        for field in ("regex", "json_schema", "ebnf"):
            value = getattr(self, field)
            if field == "json_schema" and isinstance(value, Mapping):
                value = json.dumps(value)
            if value is not None and (not isinstance(value, str) or not value):
                _fail(field, f"must be a non-empty string, got {_show(value)}")
            v[field] = value
        given = [f for f, value in v.items() if value is not None]
        if len(given) > 1:
            _fail(given[1], f"only one of regex, json_schema and ebnf may be given, got {' and '.join(given)}")
        if given and self.min_new_tokens:
            # A grammar that has ended allows only EOS, which min_new_tokens would forbid.
            _fail("min_new_tokens", f"cannot be combined with {given[0]}")
        return v

    def _validated_stop(self) -> tuple[str, ...] | None:
        stop = _strings("stop", self.stop)
        # An empty stop string matches everywhere and would end every request at once.
        if stop is not None and any(s == "" for s in stop):
            _fail("stop", "must not contain empty strings")
        return stop

    def _validated_stop_regex(self) -> tuple[str, ...] | None:
        patterns = _strings("stop_regex", self.stop_regex)
        for p in patterns or ():
            try:
                compiled = re.compile(p)
            except re.error as e:
                _fail("stop_regex", f"{p!r} is not a valid regular expression: {e}")
            # One that matches the empty string matches everywhere: every request would end at once.
            if compiled.search("") is not None:
                _fail("stop_regex", f"{p!r} matches the empty string")
        return patterns or None

    def _validated_stop_token_ids(self) -> tuple[int, ...] | None:
        ids = self.stop_token_ids
        if ids is None:
            return None
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) for i in ids):
            _fail("stop_token_ids", f"must be a list of integers, got {_show(ids)}")
        ids = tuple(int(i) for i in ids)
        if any(i < 0 for i in ids):
            _fail("stop_token_ids", f"must be >= 0, got {min(ids)}")
        return ids

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids must index the model's vocabulary."""
        for i in self.stop_token_ids or ():
            if i >= vocab_size:
                _fail("stop_token_ids", f"must be in [0, {vocab_size}) (the vocabulary), got {i}")
        for i, _ in self.logit_bias or ():
            if i >= vocab_size:
                _fail("logit_bias", f"token ids must be in [0, {vocab_size}) (the vocabulary), got {i}")

    @classmethod
    def from_dict(cls, d: Mapping | None, *, vocab_size: int) -> SamplingParams:
        """Validate a request's `sampling_params` dict (None means all defaults)."""
        if d is None:
            d = {}
        if not isinstance(d, Mapping):
            raise InvalidRequestError(f"sampling_params: must be a dict, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        for key in d:
            if key not in known:
                _fail(str(key), f"unknown key (known keys: {', '.join(sorted(known))})")
        params = cls(**d)
        params.check_vocab(vocab_size)
        return params

    def needs_sort(self, vocab_size: int) -> bool:
        """Whether sampling this request needs the sampler's full sort (top-k below the vocabulary
        or top-p below 1, on a non-greedy row): the host picks the step variant from it."""
        return not self.is_greedy and (0 < self.top_k < vocab_size or self.top_p < 1.0)

    @property
    def is_greedy(self) -> bool:
        """SGLang samples greedily for a near-zero temperature and for top_k = 1 alike."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def normalized(self) -> SamplingParams:
        """Greedy params in one canonical form (temperature 0, top_k 1), so the device sampler
        recognises them by temperature alone and never divides by a near-zero temperature."""
        if not self.is_greedy:
            return self
        return dataclasses.replace(self, temperature=0.0, top_k=1)
