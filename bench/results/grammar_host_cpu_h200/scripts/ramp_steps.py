import json,sys,numpy as np
f=sys.argv[1]
d=json.load(open(f))
runs=sorted([e for e in d if e[0]=='run'],key=lambda e:e[1])
for i,r in enumerate(runs):
    ins=sorted([e for e in d if r[1]<=e[1]<r[2] and e[0]!='run'],key=lambda e:e[1])
    steps=[e for e in ins if e[0]=='step']
    for k in range(24,29):
        s=steps[k]; end=steps[k+1][1]
        sp=[e for e in ins if s[1]<=e[1]<end and e[0]!='step']
        print(i,k,'wall %.1f'%((end-s[1])*1e3), ' '.join('%s@%.1f+%.1f'%(e[0],(e[1]-s[1])*1e3,(e[2]-e[1])*1e3) for e in sp if e[0]!='chunk' and (e[2]-e[1])>0.0003))
