"""Throwaway: what the launcher thread does while it launches the uncaptured forward, and the GPU's gaps inside it."""
import sys, collections
sys.path.insert(0, '.')
from bench.decode_profile import trace_events
d = sys.argv[1]
_, ev, pid_name, gpus = trace_events(d)
tname = {(e['pid'], e['tid']): e.get('args', {}).get('name', '') for e in ev if e.get('ph') == 'M' and e.get('name') == 'thread_name'}
X = [e for e in ev if e.get('ph') == 'X' and 'dur' in e]
fw = sorted((e for e in X if e['name'] == 'PjitFunction(jit(forward))'), key=lambda e: e['ts'])
print(len(fw), "forward calls; threads:", sorted({tname.get((e['pid'], e['tid']), '?') for e in fw}))
fw = fw[len(fw) // 3: len(fw) // 3 + 10]
for f in fw[:3]:
    print("forward call", f['ts'], f['dur'], tname.get((f['pid'], f['tid'])))
def agg(sel, label):
    tot, cnt, self_ = collections.Counter(), collections.Counter(), collections.Counter()
    bythr = collections.defaultdict(list)
    for e in sel:
        bythr[(e['pid'], e['tid'])].append(e)
    for k, es in bythr.items():
        es.sort(key=lambda e: (e['ts'], -e['dur']))
        stack = []
        for e in es:
            while stack and stack[-1]['ts'] + stack[-1]['dur'] <= e['ts']:
                stack.pop()
            if stack:
                self_[(k, stack[-1]['name'])] -= e['dur']
            stack.append(e)
            n = (k, e['name']); tot[n] += e['dur']; cnt[n] += 1; self_[n] += e['dur']
    print(f"== {label}: per forward, by self time")
    for n, s in self_.most_common(40):
        print(f"  {s/len(fw):9.1f} self {tot[n]/len(fw):9.1f} tot x{cnt[n]/len(fw):6.1f}  {tname.get(n[0], n[0])[:24]:24s} {n[1][:90]}")
host = [e for e in X if e['pid'] not in gpus]
sel = [e for f in fw for e in host if f['ts'] <= e['ts'] <= f['ts'] + f['dur']]
agg([e for e in sel if (e['pid'], e['tid']) == (fw[0]['pid'], fw[0]['tid'])], "launcher thread")
agg([e for e in sel if (e['pid'], e['tid']) != (fw[0]['pid'], fw[0]['tid'])], "other host threads")
# GPU: kernels in each forward's window, gaps between consecutive ones
gaps, busy, n = [], 0, 0
gk = sorted((e for e in X if e['pid'] in gpus), key=lambda e: e['ts'])
for f in fw:
    ks = [e for e in gk if f['ts'] <= e['ts'] <= f['ts'] + f['dur'] + 3000]
    for a, b in zip(ks, ks[1:]):
        gaps.append(b['ts'] - (a['ts'] + a['dur']))
    busy += sum(k['dur'] for k in ks); n += len(ks)
gaps.sort()
print(f"GPU in forward windows: {n/len(fw):.0f} kernels, busy {busy/len(fw):.0f} us, gaps sum {sum(g for g in gaps if g > 0)/len(fw):.0f} us per forward;"
      f" gap quantiles {[round(gaps[int(q*(len(gaps)-1))],1) for q in (0.1,0.5,0.9,0.99)]}")
