"""Host time of a constrained speculative step's grammar walk (`jspec.runtime.grammar.draft_inputs`).

Between the two parts of a constrained speculative step the host walks every constrained row's
grammar along its drafts and fills a token mask per node. This times that walk for a batch of rows
under one grammar, with drafts that continue a valid output (some with a draft the grammar refuses),
two ways in the same process:

- at once: `draft_inputs` as the engine calls it (chains and forced runs of all rows filled by one
  llguidance call on its own threads);
- row by row: each row walked token by token (`draft_inputs(at_once=False)`), the walk the
  engine did before.

    PYTHONPATH=. python3 bench/grammar_walk.py --tokenizer data/tiny/qwen3/tokenizer.json --rows 1,8,32 [--threads N]

Figures and their history: bench/README.md ("Structured output").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jspec.bench.record import environment  # noqa: E402
from jspec.runtime.grammar import GrammarBackend, draft_inputs, mask_words  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 4}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


# A regex whose masks are dear to fill (a 151,936-token vocabulary: about 6 times a JSON mask's
# cost), the allow-all regex of bench/grammar_cost.sh (cheap masks: the walk's own array work
# shows), and a JSON schema.
GRAMMARS = (("regex", r"[a-z ]{0,80}\."), ("regex", r"[\s\S]*"), ("json_schema", json.dumps(SCHEMA)))


def allowed_ids(row: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def valid_output(backend, key: str, text: str, length: int, rng) -> list[int]:
    """A token sequence the grammar allows, each token drawn uniformly from its mask (EOS last if
    the grammar ends first)."""
    g = backend.compile(key, text)
    out, row = [], np.zeros(mask_words(backend.vocab_size), np.int32)
    while len(out) < length and not g.finished:
        g.fill(row)
        ids = allowed_ids(row, backend.vocab_size)
        tok = int(rng.choice(ids))
        assert g.accept(tok)
        out.append(tok)
    return out


def batch(backend, key, text, rows: int, depth: int, rng, refuse: float):
    """A plan of `rows` constrained rows part way through valid outputs, and the view of their
    chains of `depth` drafts (the output's next tokens; with probability `refuse` one is random)."""
    reqs, view = [], []
    for _ in range(rows):
        out = valid_output(backend, key, text, 64, rng)
        k = int(rng.integers(0, max(1, len(out) - depth)))
        g = backend.compile(key, text)
        for tok in out[:k]:
            g.accept(tok)
        drafts = (out[k:k + depth] + [0] * depth)[:depth]
        if rng.random() < refuse:
            drafts[int(rng.integers(0, depth))] = int(rng.integers(0, backend.vocab_size))
        reqs.append(SimpleNamespace(req=SimpleNamespace(grammar=g, finished=False), sample=True))
        view.append(drafts + [-1] + list(range(depth)))
    return SimpleNamespace(reqs=reqs), np.array(view, np.int32)


def timed(fn, reps: int) -> float:
    fn()
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return float(np.median(samples))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default="data/tiny/qwen3/tokenizer.json")
    ap.add_argument("--vocab-size", type=int, help="the model's vocabulary (default: the tokenizer's)")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--depth", type=int, default=3, help="drafts per chain (EAGLE 3/1/4: 3)")
    ap.add_argument("--refuse", type=float, default=0.3, help="share of rows with a draft the grammar refuses")
    ap.add_argument("--threads", type=int, help="llguidance's threads (default: its own choice, most of the CPUs)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    with open(args.tokenizer) as f:
        tok_json = f.read()
    vocab = args.vocab_size or len(json.loads(tok_json)["model"]["vocab"])
    backend = GrammarBackend(tok_json, vocab, [])
    if args.threads:
        import llguidance

        backend.executor = llguidance.LLExecutor(num_threads=args.threads)
    rng = np.random.default_rng(0)
    records = []
    for key, text in GRAMMARS:
        for rows in [int(r) for r in args.rows.split(",")]:
            plan, view = batch(backend, key, text, rows, args.depth, rng, args.refuse)
            bucket = SimpleNamespace(batch_size=rows, grammar_nodes=args.depth + 1, grammar_depth=args.depth,
                                     mask_words=mask_words(vocab))
            # replace=False: as a pipelined step, every row walks its drafts (no forced run replaces them)
            at_once = timed(lambda: draft_inputs(plan, bucket, view, replace=False), args.reps)
            one_by_one = timed(lambda: draft_inputs(plan, bucket, view, replace=False, at_once=False), args.reps)
            rec = {"grammar": key, "text": text if key == "regex" else "SCHEMA", "rows": rows, "depth": args.depth,
                   "vocab": vocab, "at_once_ms": 1e3 * at_once, "row_by_row_ms": 1e3 * one_by_one,
                   "cpus": os.cpu_count(), "threads": args.threads,
                   "command": " ".join(["bench/grammar_walk.py", *(argv or sys.argv[1:])])}
            print(json.dumps(rec))
            records.append(rec)
    if args.out:
        import llguidance

        env = {**environment(), "cpu": platform.processor() or platform.machine(), "llguidance": llguidance.__version__}
        with open(args.out, "a") as f:
            for r in records:
                f.write(json.dumps({**r, "env": env}) + "\n")


if __name__ == "__main__":
    main()
