import json,sys,numpy as np
for f in sys.argv[1:]:
    d=json.load(open(f))
    runs=sorted([e for e in d if e[0]=='run'],key=lambda e:e[1])
    for i,r in enumerate(runs):
        ins=sorted([e for e in d if r[1]<=e[1]<r[2] and e[0]!='run'],key=lambda e:e[1])
        steps=[e for e in ins if e[0]=='step']
        st=np.array([e[1] for e in steps])
        # classify steps: decode (has first_call/fused_call) or other
        kinds=[]
        j=0
        names=[e for e in ins if e[0] in('first_call','fused_call')]
        nm=np.array([e[1] for e in names])
        dec=[]
        for k,s in enumerate(steps):
            end=steps[k+1][1] if k+1<len(steps) else r[2]
            dec.append(bool(((nm>=s[1])&(nm<end)).any()))
        dec=np.array(dec)
        wall=np.diff(np.append(st,r[2]))
        fd=np.argmax(dec); ld=len(dec)-1-np.argmax(dec[::-1])
        n=dec.sum()
        didx=np.flatnonzero(dec)
        q=np.array_split(didx,4)
        print(f.split('/')[-3:-1],i,'run %.3f'%(r[2]-r[1]),'to first decode %.3f'%(steps[fd][1]-r[1]),
              'nondecode steps %d %.3f s'%((~dec).sum(),wall[~dec].sum()),
              'decode quarters', ' '.join('%.3f'%wall[x].sum() for x in q), 'after last decode %.3f'%(r[2]-steps[ld][1]-wall[ld]))
