import json,sys,numpy as np
for f in sys.argv[1:]:
    d=json.load(open(f))
    runs=[e for e in d if e[0]=='run']
    for i,r in enumerate(runs):
        st=[e for e in d if e[0]=='step' and r[1]<=e[1]<=r[2]]
        dur=np.array([e[2]-e[1] for e in st])*1e3
        starts=np.array([e[1] for e in st])
        gaps=np.diff(starts)*1e3
        big=gaps>20
        print(f.split('/')[-1],i,'run %.3f s'%(r[2]-r[1]),'steps',len(st),'sum step %.3f'%(dur.sum()/1e3),
              'gap>20ms: n=%d sum %.3f s'%(big.sum(),gaps[big].sum()/1e3),'gaps<=20 sum %.3f'%(gaps[~big].sum()/1e3),
              'first step at %.3f last end %.3f'%(st[0][1]-r[1], r[2]-st[-1][2]))
