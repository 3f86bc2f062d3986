# Summarise a tprobe dump: per decode step, each phase's duration and start offset (median over the steady middle).
import json, sys, statistics as st
import numpy as np
ev = json.load(open(sys.argv[1]))
steps = sorted([e for e in ev if e[0] == "step"], key=lambda e: e[1])
others = sorted([e for e in ev if e[0] != "step"], key=lambda e: e[1])
rows = []
for i, s in enumerate(steps):
    inside = [e for e in others if s[1] <= e[1] < s[2] or (e[0] == "fwd_launch" and s[1] <= e[1] < s[2] + 0.05 and False)]
    names = [e[0] for e in inside]
    if "draft_call" not in names and "fused_call" not in names:
        continue
    r = {"wall": (steps[i + 1][1] - s[1]) if i + 1 < len(steps) else None, "step": s[2] - s[1]}
    for e in inside:
        r.setdefault(e[0] + ".dur", 0.0)
        r[e[0] + ".dur"] += e[2] - e[1]
        r.setdefault(e[0] + ".at", e[1] - s[1])
        r.setdefault(e[0] + ".end", e[2] - s[1])
    rows.append(r)
n = len(rows)
mid = rows[n // 4: 3 * n // 4]
print(f"{n} steps with a decode launch; summarising {len(mid)}")
keys = sorted({k for r in mid for k in r}, key=lambda k: st.median([r[k] for r in mid if r.get(k) is not None] or [0]) if k.endswith(".at") else 1e9)
for k in ["wall", "step"] + sorted([k for k in keys if k.endswith(".at")], key=lambda k: st.median([r[k] for r in mid if k in r])):
    base = k[:-3] if k.endswith(".at") else k
    vals = lambda kk: [r[kk] for r in mid if r.get(kk) is not None]
    if k.endswith(".at"):
        print(f"{base:12s} at {st.median(vals(k))*1e3:7.3f} ms  dur {st.median(vals(base+'.dur'))*1e3:7.3f}  end {st.median(vals(base+'.end'))*1e3:7.3f}  (in {len(vals(k))} steps)")
    else:
        print(f"{k:12s} {st.median(vals(k))*1e3:7.3f} ms")
starts = np.array([s[1] for s in steps])
walls = np.diff(starts)[n // 4: 3 * n // 4] * 1e3
fetch = np.array([(e[2] - e[1]) * 1e3 for e in others if e[0] == "fetch"])[n // 4: 3 * n // 4]
print(f"wall per step: mean {walls.mean():.3f} p10 {np.percentile(walls, 10):.3f} p90 {np.percentile(walls, 90):.3f} ms; "
      f"fetch (the loop's wait for the last step) mean {fetch.mean():.3f} ms")
