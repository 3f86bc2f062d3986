import jax,jax.numpy as jnp,time
P=[jnp.zeros((64,),jnp.bfloat16)+i for i in range(300)]
def mk():return [jnp.zeros((1024,),jnp.float32)+i for i in range(82)]
f=jax.jit(lambda p,s,x:(s,x+p[0][0]),donate_argnums=(1,))
g=jax.jit(lambda p,x:x+p[0][0])
x=jnp.zeros(4)
def t(name,fn):
  for _ in range(50):fn()
  jax.block_until_ready(fn());a=time.perf_counter()
  for _ in range(500):r=fn()
  jax.block_until_ready(r);print(name,round((time.perf_counter()-a)/500*1e6,1),"us",flush=True)
S=[mk()]
def fa():S[0],y=f(P,S[0],x);return y
def fb():S[0],y=f(P[:12],S[0],x);return y
t("300p+82s",fa);t("12p+82s",fb);t("300p",lambda:g(P,x));t("12p",lambda:g(P[:12],x))
