import json,sys,numpy as np
f=sys.argv[1]
d=json.load(open(f))
runs=[e for e in d if e[0]=='run']
for i,r in enumerate(runs):
    st=[e for e in d if e[0]=='step' and r[1]<=e[1]<=r[2]]
    out=[]
    for j,e in enumerate(st):
        nxt = st[j+1][1] if j+1<len(st) else r[2]
        g=(nxt-e[1])*1e3
        if g>12:
            inside={}
            for x in d:
                if x[0] not in ('step','run') and e[1]<=x[1]<nxt:
                    inside[x[0]]=inside.get(x[0],0)+(x[2]-x[1])*1e3
            out.append((j,round(g,1),{k:round(v,1) for k,v in inside.items() if v>1}))
    print('run',i)
    for o in out: print(' ',o)
