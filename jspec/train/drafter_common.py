"""What EAGLE3 and MTP training share: the unrolled ("training-time test") attention, the loss
against the frozen target, the optimizer, the jitted loop, history files and checkpoint writing.

Unrolling. At inference a hidden-state drafter first catches up over verified tokens (one causal
extend: at KV index p it reads the token at p + 1 and the target's hidden at p), then drafts:
draft step i >= 1 is a decode at KV index o + i that reads the token at o + i + 1 and its own
previous output, where o is the last caught-up index (`spec/eagle_step.py`). It sees the catch-up
entries 0 .. o and the entries of draft steps 1 .. i at o + 1 .. o + i, nothing else.

Training runs every origin o of a window at once: unroll step 0 is the catch-up over the whole
window, step i >= 1 holds at row o what draft step i computes for a chain started at o. Indexed by
origin, the feedback is row to row (step i reads step i - 1's output at the same row), the input
tokens move left by i, the RoPE positions right by i, and the attention of step i at row o is
step 0's keys at rows <= o (causal) plus steps 1 .. i's keys at row o only (a diagonal each).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jspec.models.attention import Attention
from jspec.models.rope import rope_cos_sin
from jspec.train import optim
from jspec.train.dense import dense_forward


# ----------------------------------------------------------------------------- configuration
@dataclasses.dataclass
class TrainConfig:
    """Hyper-parameters of a drafter run (the CLI's flags)."""

    steps: int = 2000  # the most steps; a time budget may end the schedule earlier
    batch_size: int = 64
    seq_len: int = 512
    ttt_steps: int = 3  # unrolled draft steps (the engine's num_steps to aim at)
    step_weight: float = 0.8  # loss weight of unroll step i: step_weight ** i
    lr: float = 3e-3
    min_lr_ratio: float = 0.05  # cosine decay ends at lr * this
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    compute_dtype: str = "auto"  # "auto": bfloat16 on GPU (target and drafter matmuls; f32 masters)
    attention_impl: str = "auto"  # the target's dense attention (`dense.ATTENTION_IMPLS`)
    seed: int = 0
    log_every: int = 50
    eval_every: int = 500
    eval_windows: int = 64  # held-out windows per evaluation (the same ones every time)
    eval_batch_size: int = 16
    time_budget_s: float | None = None  # fit the schedule into this much training time

    def dtype(self):
        from jspec.train.lm import resolve_compute_dtype

        return jnp.dtype(resolve_compute_dtype(self.compute_dtype))


def cast_floating(tree, dtype):
    """Every floating leaf of a pytree in `dtype` (integer tables such as d2t stay)."""
    dtype = jnp.dtype(dtype)

    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype else x

    return jax.tree_util.tree_map(cast, tree)


# ----------------------------------------------------------------------------- unrolled inputs
def shifted(x, i: int, fill=0):
    """x `[B, T, ...]` moved left by i rows along axis 1, the last i rows filled (rows o + i -> o)."""
    if i == 0:
        return x
    pad = jnp.full((x.shape[0], i) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([x[:, i:], pad], axis=1)


def step_tokens(window, i: int):
    """Input tokens of unroll step i `[B, T]` from a window `[B, T+1]`: row o reads the token at
    o + i + 1 (0 past the window; such rows are never scored)."""
    return shifted(window[:, 1:], i)


def step_positions(seq_len: int, i: int):
    """RoPE positions of unroll step i: row o sits at KV index o + i."""
    return jnp.arange(seq_len, dtype=jnp.int32) + i


def valid_rows(seq_len: int, i: int):
    """`[T]` rows of unroll step i whose prediction (the token at o + i + 2) the window holds, with
    the target's distribution for it (the target runs over the first T tokens)."""
    return jnp.arange(seq_len) <= seq_len - 2 - i


# ----------------------------------------------------------------------------- attention
def ttt_attention(q, ks, vs, *, scale: float):
    """Attention of unroll step i = len(ks) - 1 (see the module docstring), in float32 as the
    engine's kernels. q `[B, T, H, D]`; ks, vs: steps 0 .. i, each `[B, T, G, D]`."""
    b, t, h, d = q.shape
    g = ks[0].shape[2]
    qf = q.astype(jnp.float32).reshape(b, t, g, h // g, d)
    causal = jnp.tril(jnp.ones((t, t), bool))
    s0 = jnp.einsum("btgqd,bsgd->bgqts", qf, ks[0].astype(jnp.float32)) * scale
    s0 = jnp.where(causal, s0, -jnp.inf)
    diag = [jnp.einsum("btgqd,btgd->bgqt", qf, k.astype(jnp.float32))[..., None] * scale for k in ks[1:]]
    p = jax.nn.softmax(jnp.concatenate([s0, *diag], axis=-1), axis=-1)  # [B, G, q, T, T + i]
    out = jnp.einsum("bgqts,bsgd->btgqd", p[..., :t], vs[0].astype(jnp.float32))
    for j, v in enumerate(vs[1:]):
        out = out + jnp.einsum("bgqt,btgd->btgqd", p[..., t + j], v.astype(jnp.float32))
    return out.reshape(b, t, h, d).astype(q.dtype)


def ttt_self_attention(attn: Attention, x, positions, rope, kv: list):
    """One unroll step of a drafter's attention over x `[B, T, Ein]` at RoPE positions `[T]`:
    appends this step's (k, v) to `kv` (the steps so far) and returns the output `[B, T, E]`.
    Projections and output are the module's own (`Attention.project` / `output`)."""
    q, k, v, gate = attn.project(x, rope_cos_sin(rope, positions))
    kv.append((k, v))
    o = ttt_attention(q, [a for a, _ in kv], [c for _, c in kv], scale=attn.head_dim ** -0.5)
    return attn.output(o, gate)


# ----------------------------------------------------------------------------- objective
def ttt_objective(draft_logits: list, target_logits, *, hot_ids=None, step_weight: float = 0.8):
    """Loss and metrics of the unrolled drafter against the frozen target.

    draft_logits[i] `[B, T, Vd]` float32: unroll step i. target_logits `[B, T, V]`: the target
    over the window's first T tokens (row p predicts the token at p + 1), so step i at row o is
    scored against target row o + i + 1. hot_ids `[Vd]`: the target ids of the draft vocabulary
    (None: Vd == V, the identity).

    Per step: forward KL from the target's distribution, renormalised over the draft vocabulary,
    to the drafter's (the cross-entropy less the target's entropy: the same gradient, and 0 at a
    perfect match), on the rows whose target argmax the draft vocabulary holds (others can never be
    accepted), weighted step_weight ** i. Accuracy: the drafter's top-1 (as a target id) equals
    the target's argmax, over every scored row: the rate at which a greedy draft is accepted."""
    t = target_logits.shape[1]
    loss = jnp.zeros((), jnp.float32)
    metrics = {}
    for i, dl in enumerate(draft_logits):
        tl = shifted(target_logits, i + 1).astype(jnp.float32)
        valid = jnp.broadcast_to(valid_rows(t, i), tl.shape[:2])
        top = jnp.argmax(tl, axis=-1)
        if hot_ids is None:
            sub, coverable = tl, valid
            guess = jnp.argmax(dl, axis=-1)
        else:
            in_vocab = jnp.zeros((tl.shape[-1],), bool).at[hot_ids].set(True)
            sub = jnp.take(tl, hot_ids, axis=-1)
            coverable = valid & in_vocab[top]
            guess = hot_ids[jnp.argmax(dl, axis=-1)]
        logp = jax.nn.log_softmax(sub, axis=-1)
        kl = jnp.sum(jnp.exp(logp) * (logp - jax.nn.log_softmax(dl.astype(jnp.float32), axis=-1)), axis=-1)
        step_loss = jnp.sum(jnp.where(coverable, kl, 0.0)) / jnp.maximum(jnp.sum(coverable), 1)  # [B, T] -> ()
        acc = jnp.sum(valid & (guess == top)) / jnp.maximum(jnp.sum(valid), 1)
        loss = loss + step_weight ** i * step_loss
        metrics[f"loss_{i}"] = step_loss
        metrics[f"acc_{i}"] = acc
    return loss, metrics


def accept_estimate(accs: list[float]) -> float:
    """1 + a0 + a0 a1 + ...: the mean accepted length of a chain whose step i is accepted at the
    measured per-step rate given the earlier ones (a guide; the engine measures the real one)."""
    total, run = 1.0, 1.0
    for a in accs:
        run *= a
        total += run
    return total


# ----------------------------------------------------------------------------- target
def target_fn_for(cfg: TrainConfig):
    """The frozen target's forward for training: ids `[B, T]` -> (logits `[B, T, V]`, final
    normed hidden `[B, T, E]`, captured streams `[B, T, n, E]` or None), dense."""
    def target_fn(target, ids, capture_layers):
        return dense_forward(target, ids, capture_layers=tuple(capture_layers), attention_impl=cfg.attention_impl)

    return target_fn


def merged(target_graphdef, drafter_graphdef, params, frozen, compute_dtype):
    """(target, drafter) modules inside a loss: the frozen target, and the drafter from its trained
    parameters cast to the compute dtype plus its non-trained state (`frozen["rest"]`)."""
    return (nnx.merge(target_graphdef, frozen["target"]),
            nnx.merge(drafter_graphdef, cast_floating(params, compute_dtype), frozen["rest"]))


def captured_features(target_fn, target, window, capture_layers):
    """The frozen target over the window's first T tokens: (logits `[B, T, V]`, captured streams
    folded to `[B, T, n*E]`), both outside the gradient."""
    logits, _, aux = target_fn(target, window[:, :-1], tuple(capture_layers))
    b, t, n, e = aux.shape
    return jax.lax.stop_gradient(logits), jax.lax.stop_gradient(aux.reshape(b, t, n * e))


# ----------------------------------------------------------------------------- optimisation
def make_steps(loss_fn: Callable, opt, compiler_options: dict | None = None):
    """Jitted (train_step, eval_step) for `loss_fn(params, frozen, window) -> (loss, metrics)`.

    train_step(params, opt_state, frozen, window, lr) -> (params, opt_state, metrics) donates the
    parameters and optimizer state; the frozen target is an ordinary argument, read only, and the
    learning rate comes from the host (`optim.lr_at`). opt: `optim.adamw(...)`.
    compiler_options: XLA's, e.g. {"xla_backend_optimization_level": 0} to compile tests fast."""
    import optax

    def train_step(params, opt_state, frozen, window, lr):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, frozen, window)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optim.apply_lr(params, updates, lr), opt_state,
                {**metrics, "loss": loss, "grad_norm": optax.global_norm(grads)})

    def eval_step(params, frozen, window):
        loss, metrics = loss_fn(params, frozen, window)
        return {**metrics, "loss": loss}

    return (jax.jit(train_step, donate_argnums=(0, 1), compiler_options=compiler_options),
            jax.jit(eval_step, compiler_options=compiler_options))


def make_opt(cfg: TrainConfig):
    """AdamW after global-norm clipping, no decay on vectors; the learning rate is the step's."""
    return optim.adamw(weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip)


def evaluate(eval_step, params, frozen, windows: np.ndarray, batch_size: int) -> dict:
    """Metrics over fixed held-out windows, averaged over batches of one shape (windows past the
    last whole batch are left out)."""
    batch_size = min(batch_size, windows.shape[0])
    sums, count = {}, 0
    for s in range(0, windows.shape[0] - batch_size + 1, batch_size):
        m = jax.device_get(eval_step(params, frozen, jnp.asarray(windows[s:s + batch_size])))
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + float(v)
        count += 1
    return {k: v / count for k, v in sums.items()}


def _fmt(m: dict, n_steps: int) -> str:
    accs = " ".join(f"{m[f'acc_{i}']:.3f}" for i in range(n_steps))
    return f"loss {m['loss']:.4f} acc [{accs}]"


def train_loop(train_step, eval_step, params, opt_state, frozen, batches: Iterator[np.ndarray], cfg: TrainConfig,
               *, heldout: np.ndarray | None = None, log=print) -> tuple[object, list[dict], dict]:
    """Run up to cfg.steps steps (fewer when a time budget, timed over the first steps after the
    compile, says so). Returns (params, history, timing). History rows: {"step", "split": "train"
    | "heldout", "loss", "loss_i", "acc_i", ...}; a train row averages the steps since the last."""
    history: list[dict] = []
    acc_keys = [f"acc_{i}" for i in range(cfg.ttt_steps)]
    total, probe = cfg.steps, 20
    warmup = min(cfg.warmup_steps, max(total // 10, 1))
    timing = {"compile_s": None, "eval_s": 0.0}
    pending, t_start, t_warm, t_log = [], time.perf_counter(), None, None

    def run_eval(step):
        t0 = time.perf_counter()
        m = evaluate(eval_step, params, frozen, heldout, cfg.eval_batch_size)
        m["accept_estimate"] = accept_estimate([m[k] for k in acc_keys])
        history.append({"step": step, "split": "heldout", **m})
        log(f"step {step:6d} heldout {_fmt(m, cfg.ttt_steps)} accept~{m['accept_estimate']:.2f}")
        timing["eval_s"] += time.perf_counter() - t0

    step = 0
    while step < total:
        lr = optim.lr_at(step, peak=cfg.lr, warmup=warmup, total=total, min_ratio=cfg.min_lr_ratio)
        params, opt_state, metrics = train_step(params, opt_state, frozen, jnp.asarray(next(batches)),
                                                jnp.asarray(lr, jnp.float32))
        pending.append(metrics)
        step += 1
        if t_warm is None:
            jax.block_until_ready(metrics["loss"])
            t_warm = t_log = time.perf_counter()
            timing["compile_s"] = t_warm - t_start
            log(f"first step (compile) {timing['compile_s']:.1f} s")
        if cfg.time_budget_s and step == 1 + probe and total > step:
            jax.block_until_ready(metrics["loss"])
            per_step = (time.perf_counter() - t_warm) / probe
            left = cfg.time_budget_s - (time.perf_counter() - t_start)
            total = optim.fitted_steps(step, cfg.steps, per_step_s=per_step, left_s=left, margin=0.05)
            warmup = min(warmup, max(total // 10, 1))
            log(f"{per_step * 1e3:.1f} ms/step: schedule fixed at {total} steps for a {cfg.time_budget_s:.0f} s "
                "budget")
        if step % cfg.log_every == 0 or step == total:
            rows = jax.device_get(pending)
            m = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
            now = time.perf_counter()
            m.update(lr=lr, steps_per_s=len(rows) / max(now - t_log, 1e-9), elapsed_s=now - t_start)
            history.append({"step": step, "split": "train", **m})
            log(f"step {step:6d} train   {_fmt(m, cfg.ttt_steps)} gnorm {m['grad_norm']:.2f} lr {lr:.2e} "
                f"{m['steps_per_s']:.1f} it/s")
            pending, t_log = [], now
        if heldout is not None and (step % cfg.eval_every == 0 or step == total):
            run_eval(step)
    jax.block_until_ready(params)
    timing.update(steps=step, wall_s=time.perf_counter() - t_start,
                  train_s=time.perf_counter() - (t_warm or t_start) - timing["eval_s"])
    return params, history, timing


def fit(loss_fn, params, frozen, tokens: np.ndarray, heldout: str | None, cfg: TrainConfig, *,
        compiler_options=None, log=print):
    """Train `params` on windows sampled from `tokens`, evaluating on the first windows of the
    `heldout` token file: `train_loop`'s (params, history, timing)."""
    from jspec.train import data

    opt = make_opt(cfg)
    train_step, eval_step = make_steps(loss_fn, opt, compiler_options)
    batches = data.sample_batches(tokens, cfg.batch_size, cfg.seq_len, seed=cfg.seed)
    held = None if heldout is None else data.eval_windows(data.load_tokens(heldout), cfg.seq_len, cfg.eval_windows)
    return train_loop(train_step, eval_step, params, opt.init(params), frozen, batches, cfg, heldout=held, log=log)


def run_meta(kind: str, target_dir: str, corpus: str, heldout: str | None, cfg: TrainConfig, history: list[dict],
             timing: dict, **extra) -> dict:
    """What a run's history file records besides its rows."""
    final = next((r for r in reversed(history) if r["split"] == "heldout"), history[-1] if history else {})
    return {"kind": kind, "target": os.path.abspath(target_dir), "corpus": corpus, "heldout": heldout,
            "config": dataclasses.asdict(cfg), "compute_dtype": cfg.dtype().name,
            "device": str(jax.devices()[0].device_kind), "jax_version": jax.__version__,
            **{k: (round(v, 2) if isinstance(v, float) else v) for k, v in timing.items()}, **extra, "final": final}


# ----------------------------------------------------------------------------- command line
def add_drafter_parsers(tsub) -> None:
    """`jspec train distill | eagle3 | mtp | dflash` under the `jspec train` sub-parsers."""
    from jspec.train import dflash, distill, eagle3, mtp

    distill.add_parser(tsub)
    eagle3.add_parser(tsub)
    mtp.add_parser(tsub)
    dflash.add_parser(tsub)


def add_train_flags(p) -> None:
    """Flags every drafter run takes: the target, the token files and `TrainConfig`."""
    d = TrainConfig()
    p.add_argument("--target", required=True, help="target HF checkpoint directory (frozen)")
    p.add_argument("--corpus", required=True, nargs="+",
                   help="train tokens (.npy / .npz from `jspec train corpus` or `jspec train distill`; several are joined)")
    p.add_argument("--heldout", help="held-out tokens: per-step draft accuracy logged on them")
    p.add_argument("--steps", type=int, default=d.steps, help="steps (the most, with --time-budget)")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--ttt-steps", type=int, default=d.ttt_steps, help="draft steps unrolled in training")
    p.add_argument("--step-weight", type=float, default=d.step_weight, help="loss weight of draft step i: w ** i")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip)
    p.add_argument("--compute-dtype", default=d.compute_dtype, choices=["auto", "float32", "bfloat16"])
    p.add_argument("--attention", default=d.attention_impl, choices=["auto", "xla", "cudnn"],
                   help="the target's dense attention (auto: cuDNN on GPU in bf16)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--eval-windows", type=int, default=d.eval_windows, help="held-out windows per evaluation")
    p.add_argument("--eval-batch-size", type=int, default=d.eval_batch_size)
    p.add_argument("--time-budget", type=float, help="seconds: shorten the schedule to end within them")


def config_from_args(args) -> TrainConfig:
    return TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, ttt_steps=args.ttt_steps,
                       step_weight=args.step_weight, lr=args.lr, min_lr_ratio=args.min_lr_ratio,
                       warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
                       compute_dtype=args.compute_dtype, attention_impl=args.attention, seed=args.seed,
                       log_every=args.log_every, eval_every=args.eval_every, eval_windows=args.eval_windows,
                       eval_batch_size=args.eval_batch_size, time_budget_s=args.time_budget)


def summary_line(s: dict) -> str:
    f = s.get("final") or {}
    accs = " ".join(f"{f[k]:.3f}" for k in sorted(f) if k.startswith("acc_"))
    what = "held-out" if f.get("split") == "heldout" else "train"
    return (f"{s.get('steps')} steps in {s.get('train_s', 0):.0f} s (compile {s.get('compile_s') or 0:.0f} s); "
            f"{what} loss {f.get('loss', float('nan')):.4f}, draft top-1 = target [{accs}], "
            f"accept length ~{f.get('accept_estimate', float('nan')):.2f}")


def stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- history files
def save_history(history: list[dict], out_dir: str, name: str, *, meta: dict | None = None,
                 plot: bool = True) -> dict:
    """`{name}_history.json` (rows and run metadata) and, with matplotlib, `{name}_history.png`
    (train and held-out loss; held-out accuracy per unroll step). Returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, f"{name}_history.json")}
    with open(paths["json"], "w") as f:
        json.dump({"meta": meta or {}, "history": history}, f, indent=1)
    if not plot:
        return paths
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    train = [r for r in history if r["split"] == "train"]
    held = [r for r in history if r["split"] == "heldout"]
    fig, (ax_l, ax_a) = plt.subplots(1, 2, figsize=(11, 4))
    ax_l.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if held:
        ax_l.plot([r["step"] for r in held], [r["loss"] for r in held], "o-", label="held-out")
    ax_l.set_xlabel("step"), ax_l.set_ylabel("weighted unrolled loss"), ax_l.legend()
    src = held or train
    i = 0
    while src and f"acc_{i}" in src[0]:
        ax_a.plot([r["step"] for r in src], [r[f"acc_{i}"] for r in src], "o-" if held else "-",
                  label=f"draft step {i + 1}")
        i += 1
    ax_a.set_xlabel("step"), ax_a.set_ylabel(("held-out" if held else "train") + " top-1 = target argmax")
    ax_a.set_ylim(0, 1), ax_a.legend()
    fig.suptitle(name)
    fig.tight_layout()
    paths["png"] = os.path.join(out_dir, f"{name}_history.png")
    fig.savefig(paths["png"], dpi=100)
    plt.close(fig)
    return paths


# ----------------------------------------------------------------------------- checkpoints
def hf_tensors(module_params: nnx.State, config, dtype) -> dict[str, np.ndarray]:
    """A drafter's parameters under Hugging Face names and layouts (q/k/v and gate/up split,
    experts per expert as the published MTP layers store them), float tensors in `dtype`."""
    from checkpoints.hf_mapping import to_hf_tensors
    from jspec.models.loader import state_to_flat
    from jspec.models.presets import fused_split_sizes

    out = {}
    for name, arr in state_to_flat(module_params).items():
        arr = np.asarray(jax.device_get(arr))
        if np.issubdtype(arr.dtype, np.floating):
            arr = arr.astype(dtype)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out.update(_per_expert(name, arr))
        else:
            out.update(to_hf_tensors(name, arr, fused_split_sizes(config, name)))
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _per_expert(name: str, arr: np.ndarray) -> dict[str, np.ndarray]:
    """Stacked jspec experts `[X, in, out]` -> `experts.{j}.{gate,up,down}_proj.weight` `[out, in]`."""
    layer = name.rsplit(".", 1)[0]
    out = {}
    for j in range(arr.shape[0]):
        w = arr[j].T  # [out, in]
        if name.endswith("gate_up_proj"):
            gate, up = np.split(w, 2, axis=0)
            out[f"{layer}.{j}.gate_proj.weight"], out[f"{layer}.{j}.up_proj.weight"] = gate, up
        else:
            out[f"{layer}.{j}.down_proj.weight"] = w
    return out


def write_drafter(out_dir: str, tensors: dict[str, np.ndarray], config: dict) -> None:
    """A drafter checkpoint as the engine and SGLang read it: model.safetensors + config.json."""
    from safetensors.numpy import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def np_dtype(name: str):
    import ml_dtypes

    return {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32),
            "float16": np.dtype(np.float16)}[name]


def file_mib(path: str) -> float:
    return os.path.getsize(path) / 2 ** 20


def param_count(tree) -> int:
    return int(sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))
