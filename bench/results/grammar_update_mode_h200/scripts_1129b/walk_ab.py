# Interleaved A/B of the grammar walk in one process: this checkout's jspec.runtime.grammar ("new") against another
# grammar.py ("old", e.g. `git show 536c06b:jspec/runtime/grammar.py > /tmp/grammar_old.py`), 32 rows, drafts of depth 3
# (30% with a refused draft), each grammar of bench/grammar_walk.py; median ms per walk.
#   PYTHONPATH=. python3 walk_ab.py THREADS REPS /tmp/grammar_old.py TOKENIZER_JSON
import sys, time, importlib.util, numpy as np, json
sys.path.insert(0, "."); sys.path.insert(0, "bench")
import grammar_walk as gw, llguidance
from jspec.runtime import grammar as new
spec = importlib.util.spec_from_file_location("oldg", sys.argv[3]); old = importlib.util.module_from_spec(spec); sys.modules["oldg"] = old; spec.loader.exec_module(old)
from types import SimpleNamespace
backend = new.GrammarBackend(open(sys.argv[4]).read(), 151936, [])
backend.executor = llguidance.LLExecutor(num_threads=int(sys.argv[1]))
rng = np.random.default_rng(0)
for key, text in gw.GRAMMARS:
    plan, view = gw.batch(backend, key, text, 32, 3, rng, 0.3)
    b = SimpleNamespace(batch_size=32, grammar_nodes=4, grammar_depth=3, mask_words=new.mask_words(151936))
    t = {"new": [], "old": []}
    for _ in range(3): new.draft_inputs(plan, b, view, replace=False); old.draft_inputs(plan, b, view, replace=False)
    for _ in range(int(sys.argv[2])):
        for name, m in (("new", new), ("old", old)):
            a = time.perf_counter(); m.draft_inputs(plan, b, view, replace=False); t[name].append(time.perf_counter() - a)
    print(json.dumps({"text": text[:20], "rows": 32, "threads": int(sys.argv[1]), **{k: round(1e3 * float(np.median(v)), 3) for k, v in t.items()}}))
