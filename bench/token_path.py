"""Which source files a token passes through, from `Engine.generate` to the kernels and back: the
architecture measure of a plain decode token (and of a speculative step with `--algorithm`).

Host side: every jspec / pallas_kernels file whose functions run while a warm engine serves one
request (`sys.setprofile`). Device side: every such file whose functions run while the engine's
first decode bucket is traced and lowered again (the step's Python code runs only then; the
kernels in interpret mode take the same Python path as on a GPU). The union is the count; both
parts are listed. Runs on CPU in seconds with the shipped tiny models.

    JSPEC_KERNELS=interpret PYTHONPATH=. python3 bench/token_path.py [--algorithm EAGLE3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = tuple(os.path.join(ROOT, p) + os.sep for p in ("jspec", "pallas_kernels"))


class Recorder:
    """A profile hook on every thread (the engine serves from threads of its own, started after
    `install`): while `record(fn)` runs fn, the repository files of every Python function called
    on any thread (or, with `this_thread`, on the caller's only) are collected."""

    def __init__(self):
        self.seen: set[str] | None = None
        self.thread: int | None = None

    def hook(self, frame, event, arg):
        if event == "call" and self.seen is not None:
            if self.thread is not None and threading.get_ident() != self.thread:
                return
            path = frame.f_code.co_filename
            if path.startswith(PACKAGES):
                self.seen.add(os.path.relpath(path, ROOT))

    def install(self):
        threading.setprofile(self.hook)
        sys.setprofile(self.hook)

    def record(self, fn, *, this_thread: bool = False) -> set[str]:
        self.seen, self.thread = set(), threading.get_ident() if this_thread else None
        try:
            fn()
        finally:
            seen, self.seen, self.thread = self.seen, None, None
        return seen


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--algorithm", default=None, help="a speculative algorithm (EAGLE3, NEXTN, ...): its step")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import jax

    from jspec import Engine
    from jspec.models.batch import ForwardMode
    from jspec.tiny import tiny_dir

    spec = {}
    if args.algorithm:
        drafter = {"EAGLE3": "qwen3-eagle3", "EAGLE": "qwen3-eagle", "DFLASH": "qwen3-dflash",
                   "STANDALONE": "qwen3-draft"}.get(args.algorithm)
        spec = dict(speculative_algorithm=args.algorithm, speculative_num_steps=3, speculative_eagle_topk=1,
                    speculative_num_draft_tokens=4, speculative_adaptive=False)
        if drafter:
            spec["speculative_draft_model_path"] = tiny_dir(drafter)
    target = tiny_dir("qwen3-next" if args.algorithm == "NEXTN" else "qwen3")
    recorder = Recorder()
    recorder.install()
    eng = Engine(target, dtype="float32", cuda_graph_bs=[1], max_running_requests=1, chunked_prefill_size=16,
                 prefill_token_buckets=[16], context_length=64, show_progress=False, compilation_cache_dir="none",
                 disable_top_k_top_p=True, **spec)
    try:
        request = dict(input_ids=[3, 17, 29, 8], sampling_params={"max_new_tokens": 8, "temperature": 0})
        eng.generate(**request)  # warm: the first call starts threads and fills caches
        host = recorder.record(lambda: eng.generate(**request))
        runner = eng.runner
        bucket = next(b for b in runner.buckets if b.mode is ForwardMode.DECODE and b.speculate and not b.draft_steps)
        jax.clear_caches()  # or the kernels' traces come from JAX's caches without running their code
        # this thread only: the engine's own threads keep polling meanwhile
        device = recorder.record(lambda: runner._lower(bucket, runner.state), this_thread=True)
    finally:
        eng.shutdown()
    both = sorted(host | device)
    report = {"algorithm": args.algorithm or "plain", "kernels": os.environ.get("JSPEC_KERNELS", "default"),
              "files": len(both), "host": sorted(host), "device": sorted(device)}
    print(f"{report['algorithm']}: {len(both)} files ({len(host)} on the host, {len(device)} traced for the "
          f"decode bucket, kernels {report['kernels']})")
    for f in both:
        print(f"  {'H' if f in host else ' '}{'D' if f in device else ' '} {f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
