"""Structured output: SGLang's `regex`, `json_schema` and `ebnf` sampling keys through llguidance.

llguidance (chosen over xgrammar because its bitmasks are plain numpy int32 arrays, so torch stays
out of serving) compiles a request's grammar against the model's tokenizer and tracks, per request,
which tokens may come next. The device never sees the grammar, only a bitmask per verified node
(`Bucket.grammar_nodes`; bit v of word v // 32 allows token v), applied to the target's logits
before sampling, acceptance and reported logprobs; the host advances the grammar with the tokens a
step emitted (`Grammar.accept`), so a constrained request's next masks are filled only once its
last step has been read; the part of the next step that needs no mask runs meanwhile
(`jspec.runtime.split_step`).

Under speculation the masks of the draft nodes depend on the drafts, which only the device knows
when the step starts: such a step runs in parts (`jspec.speculative.grammar_nodes`). The host
reads the drafts after the first (only when a constrained row is in the batch) and, per constrained
row (`draft_inputs`): where the grammar forces a run of tokens and the target's forward is not
queued yet, verifies that run instead of the drafts (it is accepted whole); otherwise walks
the grammar along the draft tree, keeping the nodes whose path it allows, with each node's mask.
Output is exactly the non-speculative constrained output.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from jspec.errors import ConfigError, InvalidRequestError

GRAMMAR_KEYS = ("regex", "json_schema", "ebnf")  # SGLang's sampling_params keys
BACKENDS = ("llguidance",)
FORBIDDEN = 2  # `walk` of a draft the grammar forbids right below an allowed node (1: allowed, 0: unreachable)


def mask_words(vocab_size: int) -> int:
    """int32 words of one token bitmask."""
    return -(-vocab_size // 32)


def token_words(ids, vocab_size: int) -> np.ndarray:
    """The bitmask `[mask_words(V)]` int32 of a set of token ids (`sampler.seed_slot` reads it)."""
    ids = np.unique(np.asarray(ids, np.int64))
    words = np.zeros((mask_words(vocab_size),), np.uint32)
    np.bitwise_or.at(words, ids >> 5, np.uint32(1) << (ids & 31).astype(np.uint32))
    return words.view(np.int32)


class Grammar:
    """One request's grammar state (an llguidance matcher), advanced by accepted tokens only."""

    def __init__(self, matcher, spec: tuple[str, str], executor):
        self.matcher = matcher
        self.spec = spec  # (key, text): what the request asked for, for errors and copies
        self.executor = executor  # the backend's llguidance.LLExecutor: fills many rows' masks at once

    def copy(self) -> Grammar:
        """A fresh matcher in the same state (parallel samples each get one)."""
        return Grammar(self.matcher.deep_copy(), self.spec, self.executor)

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
        taken = 0
        for i, tok in enumerate(tokens):
            taken += self._advance(tok)
            self.fill(rows[i + 1])
        if taken:
            self.matcher.rollback(taken)

    def _advance(self, token: int) -> int:
        """Consume a token the grammar allows: how many tokens the matcher can roll back for it (an
        EOS after the grammar has ended is taken without a step)."""
        stopped = self.matcher.is_stopped()
        if not self.matcher.consume_token(token):
            raise AssertionError(f"grammar refused token {token} that its mask allows: {self.matcher.get_error()}")
        return 0 if stopped else 1

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
        try:
            self.tokenizer = llguidance.LLTokenizer(self.tokenizer_json, n_vocab=self.vocab_size,
                                                    eos_token=sorted(self.eos_token_ids) or None)
        except ValueError as e:  # e.g. a tokenizer of more tokens than the model's vocabulary
            raise ConfigError(f"grammar_backend: llguidance cannot use this tokenizer with a {self.vocab_size}-token "
                              f"vocabulary: {e}") from None
        self._checked: dict[tuple[str, str], str] = {}  # (key, text) -> llguidance grammar (valid ones)
        self.executor = llguidance.LLExecutor()  # its own threads (most of the CPUs), outside the GIL

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
        return Grammar(matcher, spec, self.executor)


def constrained(plan):
    """(row, grammar) of the rows that sample under a grammar this step (a request that finished
    while the step was planned in flight is left out: its grammar may have ended)."""
    return [(i, s.req.grammar) for i, s in enumerate(plan.reqs)
            if s.req.grammar is not None and s.sample and not s.req.finished]  # finished: its output is dropped


def step_inputs(plan, bucket) -> np.ndarray | None:
    """Masks `[B, 1, W]` of a step that samples one token per row (a prompt chunk, a plain decode
    step), or None when no row is constrained (the device keeps an all-allowed mask)."""
    rows = constrained(plan)
    if not rows:
        return None
    masks = np.full((bucket.batch_size, 1, bucket.mask_words), -1, np.int32)
    rows[0][1].executor.unsafe_compute_mask_ptr([(g.matcher, i) for i, g in rows], masks.ctypes.data,
                                                masks.shape[-1] * 4, masks.shape[0])
    return masks


def _allowed(row: np.ndarray, tok: int) -> bool:
    return bool((int(row[tok >> 5]) >> (tok & 31)) & 1)


def _walk_tree(g: Grammar, tokens, parents, masks: np.ndarray, walk: np.ndarray, max_depth: int) -> None:
    """Depth first over a row's draft tree (tokens `[N]`, node 0 the root, parents `[N]`, a chain's
    j - 1): every node whose path the grammar allows gets walk 1 and its mask; the matcher consumes
    each allowed token on the way down and rolls it back on the way up. A forbidden draft gets
    FORBIDDEN and is not descended: acceptance still tries it (the masked target gives it
    probability 0, so it is rejected exactly as speculative sampling rejects any draft, the
    drafter's q in the residual); a simulated acceptance stops before it."""
    children = [[] for _ in range(len(tokens))]
    for j in range(1, len(tokens)):
        children[int(parents[j])].append(j)

    def visit(node: int, depth: int) -> None:
        walk[node] = 1
        g.fill(masks[node])
        if depth == max_depth:
            return
        for child in children[node]:
            tok = int(tokens[child])
            if not _allowed(masks[node], tok):  # consuming it would break the matcher
                walk[child] = FORBIDDEN
                continue
            taken = g._advance(tok)
            visit(child, depth + 1)
            if taken:
                g.matcher.rollback(1)

    visit(0, 0)


def draft_inputs(plan, bucket, view: np.ndarray | None, *, replace: bool = True, at_once: bool = True) -> \
        tuple[np.ndarray, np.ndarray | None, bool]:
    """The grammar decisions of a split speculative step (`jspec.speculative.grammar_nodes`): the
    packed int32 `[bucket.grammar_size]` (replaced, tokens, walk), masks `[B, N, W]` (None when no
    row is constrained), and whether the grammar forces a run at any constrained row's root. view
    `[B, D + N]`: the drafts, then every node's parent. replace: a forced run replaces the row's
    drafts (False when the target's forward over the drafts is already queued). at_once: chains and
    forced runs of all rows in one llguidance call (`_walk_paths`); False walks each row token by
    token, the reference the tests and bench/grammar_walk.py compare it with."""
    b, n = bucket.batch_size, bucket.grammar_nodes
    d = n - 1
    replaced, tokens, walk = np.zeros((b,), np.int32), np.zeros((b, d), np.int32), np.ones((b, n), np.int32)
    rows = constrained(plan)
    masks, any_forced = None, False
    if rows:
        depth = min(bucket.grammar_depth, d)
        chains = (view[:, d + 1:] == np.arange(d)).all(axis=1)  # node j's parent is j - 1
        paths, runs, trees = [], [], []  # (row, grammar, tokens): filled at once; forced runs, trees: row by row
        for i, g in rows:
            walk[i] = 0
            forced = g.forced(depth)
            any_forced |= bool(forced)
            if forced and replace:
                replaced[i] = 1
                tokens[i, :len(forced)] = forced
                (paths if at_once else runs).append((i, g, forced))
            elif at_once and chains[i]:
                paths.append((i, g, view[i, :depth].tolist()))
            else:
                trees.append((i, g))
        # Every mask starts all-allowed, except those filled at once, which start at 0 (`_walk_paths`);
        # one write per row: the masks are megabytes at a large vocabulary.
        masks = np.empty((b, n, bucket.mask_words), np.int32)
        at = np.zeros((b,), bool)
        at[[i for i, _, _ in paths]] = True
        masks[~at], masks[at] = -1, 0
        for i, g, forced in runs:
            walk[i, :len(forced) + 1] = 1
            g.fill_path(masks[i], forced)
        for i, g in trees:
            _walk_tree(g, np.concatenate([[0], view[i, :d]]), view[i, d:], masks[i], walk[i], bucket.grammar_depth)
        _walk_paths(paths, masks, walk, replaced)
    return np.concatenate([replaced, tokens.reshape(-1), walk.reshape(-1)]), masks, any_forced


def _walk_paths(paths, masks: np.ndarray, walk: np.ndarray, replaced: np.ndarray) -> None:
    """`_walk_tree` and `Grammar.fill_path` for many rows at once: llguidance fills each path's
    masks (at the row's state, then after each token, for as long as its grammar takes them) on its
    own threads, and the walk is read from them, for all paths in a few array operations. Each
    path's masks start at 0 (`draft_inputs`), which a filled mask is not, except a stopped grammar's
    with no EOS token: a path whose walk reaches a mask its grammar did not fill (the grammar ended,
    or took a token its mask refuses) is walked again token by token, so the result is always
    theirs. A mask that allows the path's next token was filled; only the mask where the walk stops
    needs reading whole."""
    if not paths:
        return
    n = masks.shape[1]
    flat = masks.reshape(-1, masks.shape[-1])
    with_tokens = [(g.matcher, i * n, toks) for i, g, toks in paths if toks]
    without = [(g.matcher, i * n) for i, g, toks in paths if not toks]
    executor = paths[0][1].executor
    if with_tokens:
        executor.unsafe_compute_mask_ptr_with_draft_token(with_tokens, flat.ctypes.data, flat.shape[1] * 4, flat.shape[0])
    if without:
        executor.unsafe_compute_mask_ptr(without, flat.ctypes.data, flat.shape[1] * 4, flat.shape[0])
    row = np.array([i for i, _, _ in paths])
    size = np.array([len(toks) for _, _, toks in paths])  # [P]
    toks = np.zeros((len(paths), max(1, size.max())), np.int64)  # [P, L]
    for p, (_, _, t) in enumerate(paths):
        toks[p, :len(t)] = t
    j = np.arange(toks.shape[1])
    word = masks.view(np.uint32)[row[:, None], j[None, :], toks >> 5]  # [P, L]
    allowed = ((word >> (toks & 31).astype(np.uint32)) & 1).astype(bool) & (j[None, :] < size[:, None])
    taken = np.cumprod(allowed, axis=1).sum(axis=1)  # [P]: the leading run of tokens the masks allow
    forced = replaced[row].astype(bool)
    reach = np.where(forced, size, taken)  # the deepest node each walk reaches (a forced run: its end)
    again = ~masks[row, reach].any(axis=-1)  # the mask where the walk stops was not filled
    for p in np.flatnonzero(forced & ~again):  # a forced run's masks need not allow the run: read them all
        again[p] = not masks[row[p], :size[p] + 1].any(axis=-1).all()
    node, reach, size = np.arange(n)[None, :], reach[:, None], size[:, None]
    past, past_node = np.nonzero(node > reach)  # nodes past the walk: all allowed, never walked
    masks[row[past], past_node] = -1
    walk[row] = np.where(node <= reach, 1, np.where((node == reach + 1) & (reach < size), FORBIDDEN, 0))
    for p in np.flatnonzero(again):  # every mask and walk of these rows is written again
        i, g, t = paths[p]
        masks[i], walk[i] = -1, 0
        if replaced[i]:
            walk[i, :len(t) + 1] = 1
            g.fill_path(masks[i], t)
        else:
            _walk_tree(g, np.array([0] + t), np.arange(-1, len(t)), masks[i], walk[i], len(t))
