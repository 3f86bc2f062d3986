import json, sys, numpy as np
for f in sys.argv[1:]:
    d = json.load(open(f))
    for i, r in enumerate(sorted([e for e in d if e[0] == 'run'], key=lambda e: e[1])):
        ins = sorted([e for e in d if r[1] <= e[1] < r[2] and e[0] != 'run'], key=lambda e: e[1])
        steps = [e for e in ins if e[0] == 'step']
        xs = {"schedule": [], "pack": []}; ramp = []
        for k, s in enumerate(steps[:-1]):
            end = steps[k + 1][1]
            sp = [e for e in ins if s[1] <= e[1] < end]
            dec = any(e[0] in ('first_call', 'fused_call') for e in sp)
            if not dec:
                for e in sp:
                    if e[0] in xs: xs[e[0]].append((e[2] - e[1]) * 1e3)
            elif (end - s[1]) > 0.03:
                ramp.append((end - s[1]) * 1e3)
        print(f, "run", i, "prompt steps: schedule median %.3f ms, pack median %.3f ms (n %d);" % (np.median(xs["schedule"]), np.median(xs["pack"]), len(xs["pack"])),
              "ramp decode steps over 30 ms: n %d mean %.1f ms" % (len(ramp), np.mean(ramp)))
