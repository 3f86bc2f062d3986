import json,sys,numpy as np
f=sys.argv[1]
d=json.load(open(f))
runs=sorted([e for e in d if e[0]=='run'],key=lambda e:e[1])
for i,r in enumerate(runs):
    ins=sorted([e for e in d if r[1]<=e[1]<r[2] and e[0]!='run'],key=lambda e:e[1])
    steps=[e for e in ins if e[0]=='step']
    out=[]
    for k,s in enumerate(steps[:60]):
        end=steps[k+1][1] if k+1<len(steps) else r[2]
        sp=[e for e in ins if s[1]<=e[1]<end and e[0] not in('step',)]
        kind='D' if any(e[0] in('first_call','fused_call') for e in sp) else 'x'
        big={}
        for e in sp:
            big[e[0]]=big.get(e[0],0)+(e[2]-e[1])*1e3
        out.append('%s%.1f'%(kind,(end-s[1])*1e3))
    print(i,' '.join(out))
    # spans named chunk totals within first 0.5 s
    ch=[e for e in ins if e[0]=='chunk']
    print('  chunk total s %.3f n %d'%(sum(e[2]-e[1] for e in ch),len(ch)))
    other={}
    for e in ins:
        if e[0] in ('step','chunk'): continue
        other[e[0]]=other.get(e[0],0)+(e[2]-e[1])
    print('  ',{k:round(v,3) for k,v in sorted(other.items())})
