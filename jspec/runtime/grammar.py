"""Structured output: SGLang's `regex`, `json_schema` and `ebnf` sampling keys through llguidance.

llguidance (chosen over xgrammar because its bitmasks are plain numpy int32 arrays, so torch stays
out of serving) compiles a request's grammar against the model's tokenizer and tracks, per request,
which tokens may come next. The device never sees the grammar, only a bitmask per verified node
(`Bucket.grammar_nodes`; bit v of word v // 32 allows token v), applied to the target's logits
before sampling, acceptance and reported logprobs; the host advances the grammar with the tokens a
step emitted (`Grammar.accept`).

Under speculation the host does not know the drafter's tokens when it dispatches a step, so it
cannot mask the nodes they lead to. A constrained row instead verifies the grammar's own forced
continuation (`Grammar.forced`: tokens the grammar admits alone, e.g. JSON keys and punctuation),
whose node masks the host can compute, and accepts no deeper than that run; the bonus is drawn at
the node where the run ends, from the masked target distribution. Output is exactly what the
non-speculative constrained engine produces; the drafter's own proposals go unused for such rows.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from jspec.errors import ConfigError, InvalidRequestError

GRAMMAR_KEYS = ("regex", "json_schema", "ebnf")  # SGLang's sampling_params keys
BACKENDS = ("llguidance",)


def mask_words(vocab_size: int) -> int:
    """int32 words of one token bitmask."""
    return -(-vocab_size // 32)


class Grammar:
    """One request's grammar state (an llguidance matcher), advanced by accepted tokens only."""

    def __init__(self, matcher, spec: tuple[str, str]):
        self.matcher = matcher
        self.spec = spec  # (key, text): what the request asked for, for errors and copies

    def copy(self) -> Grammar:
        """A fresh matcher in the same state (parallel samples each get one)."""
        return Grammar(self.matcher.deep_copy(), self.spec)

    def fill(self, row: np.ndarray) -> None:
        """The allowed next tokens into `row` `[W]` int32 (contiguous)."""
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces from here (none when it allows a choice)."""
        return [] if limit <= 0 or self.matcher.is_stopped() else self.matcher.compute_ff_tokens()[:limit]

    def fill_path(self, rows: np.ndarray, tokens: list[int]) -> None:
        """Masks of the nodes along `tokens` (rows[0]: here, rows[i]: after tokens[:i]), with the
        matcher returned to where it was."""
        self.fill(rows[0])
        for i, tok in enumerate(tokens):
            if not self.matcher.consume_token(tok):
                raise AssertionError(f"grammar refused its own forced token {tok}: {self.matcher.get_error()}")
            self.fill(rows[i + 1])
        if tokens:
            self.matcher.rollback(len(tokens))

    def accept(self, token: int) -> bool:
        """Advance by an emitted token; False if the grammar refuses it (it never should: every
        emitted token was drawn under its mask)."""
        return self.matcher.consume_token(token)

    @property
    def finished(self) -> bool:
        """The grammar has ended (its EOS consumed, or nothing may follow)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


@dataclasses.dataclass
class GrammarBackend:
    """Compiles grammars for one model's tokenizer. tokenizer_json: the model's tokenizer.json text;
    vocab_size: the model's (logits) vocabulary, which the bitmasks cover."""

    tokenizer_json: str
    vocab_size: int
    eos_token_ids: list[int]

    def __post_init__(self):
        import llguidance

        self._llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(self.tokenizer_json, n_vocab=self.vocab_size,
                                                eos_token=sorted(self.eos_token_ids) or None)
        self._checked: dict[tuple[str, str], str] = {}  # (key, text) -> llguidance grammar (valid ones)

    @classmethod
    def create(cls, name: str | None, *, tokenizer_path: str | None, vocab_size: int, eos_token_ids) -> \
            GrammarBackend | None:
        """The backend an engine was started with (`grammar_backend`), or None."""
        if name is None or name == "none":
            return None
        if name not in BACKENDS:
            raise ConfigError(f"grammar_backend must be one of {', '.join(BACKENDS)} or None, got {name!r}")
        if tokenizer_path is None:
            raise ConfigError("grammar_backend: the model has no tokenizer.json; structured output needs one")
        with open(tokenizer_path) as f:
            return cls(f.read(), vocab_size, list(eos_token_ids))

    def _grammar(self, key: str, text: str) -> str:
        llg = self._llg
        if key == "regex":
            return llg.LLMatcher.grammar_from_regex(text)
        if key == "json_schema":
            try:
                json.loads(text)
            except ValueError as e:
                raise InvalidRequestError(f"sampling_params.json_schema: not valid JSON: {e}") from None
            try:
                return llg.LLMatcher.grammar_from_json_schema(text)
            except ValueError as e:
                raise InvalidRequestError(f"sampling_params.json_schema: {e}") from None
        try:
            return llg.LLMatcher.grammar_from_lark(llg.gbnf_to_lark.any_to_lark(text))
        except Exception as e:  # noqa: BLE001 - the converter raises its own parse errors
            raise InvalidRequestError(f"sampling_params.ebnf: {e}") from None

    def compile(self, key: str, text: str) -> Grammar:
        """A matcher for the request's grammar; InvalidRequestError naming the key when it does not compile."""
        spec = (key, text)
        grammar = self._checked.get(spec)
        if grammar is None:
            grammar = self._grammar(key, text)
            err = self._llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
            if err and not err.startswith("WARNING"):
                raise InvalidRequestError(f"sampling_params.{key}: the grammar does not compile: {err.strip()}")
            self._checked[spec] = grammar
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"sampling_params.{key}: {matcher.get_error().strip()}")
        return Grammar(matcher, spec)


def step_inputs(plan, bucket) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """The grammar inputs of one step: masks `[B, M, W]` int32 (None: no constrained row, the
    device uses its all-allowed mask), and for a speculative bucket with M > 1 the forced tokens
    `[B, M - 1]` and each row's accepted-run limit `[B]` (-1: unconstrained). Rows that sample
    nothing this step (a prompt chunk that does not end) keep all tokens allowed."""
    m = bucket.grammar_nodes
    rows = [(i, s.req.grammar) for i, s in enumerate(plan.reqs) if s.req.grammar is not None and s.sample]
    spec = bucket.grammar_forced
    forced = np.zeros((bucket.batch_size, max(m - 1, 0)), np.int32) if spec else None
    limit = np.full((bucket.batch_size,), -1, np.int32) if spec else None
    if not rows:
        return None, forced, limit
    masks = np.full((bucket.batch_size, m, bucket.mask_words), -1, np.int32)
    for i, g in rows:
        path = g.forced(m - 1) if spec else []
        g.fill_path(masks[i], path)
        if spec:
            forced[i, :len(path)] = path
            limit[i] = len(path)
    return masks, forced, limit
