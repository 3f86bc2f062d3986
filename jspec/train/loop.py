"""The drafter training loop shared by EAGLE3, MTP and DFlash: the run's configuration, the
jitted train / eval steps, the loop with held-out evaluation, and `fit`, which wires them to a
token corpus.

A trainer supplies `loss_fn(params, frozen, window) -> (loss, metrics)`. params: the drafter's
trained parameters (float32 masters, what the optimizer updates); frozen: what the loss reads but
never trains, the target's parameters among them (`frozen_target`); window `[B, T+1]` token ids.
metrics holds `acc_i` (and `loss_i`) for i < `TrainConfig.ttt_steps`: per draft step (EAGLE3,
MTP) or per block position (DFlash), the rate at which the drafter's top-1 is the target's.

The learning rate comes from the host each step (`optim.lr_at`), so a time budget can fix the
schedule's length after timing the first steps without recompiling anything.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jspec.train import data, optim
from jspec.train.lm import resolve_compute_dtype


@dataclasses.dataclass
class TrainConfig:
    """Hyper-parameters of a drafter run (the `jspec train eagle3 | mtp | dflash` flags)."""

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
        return jnp.dtype(resolve_compute_dtype(self.compute_dtype))


def stderr_log(msg: str) -> None:
    """The trainers' default progress log: stderr, so stdout keeps only a command's result line."""
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- steps
def make_opt(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW after global-norm clipping, no decay on vectors; the learning rate is the step's."""
    return optim.adamw(weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip)


def make_steps(loss_fn: Callable, opt: optax.GradientTransformation, compiler_options: dict | None = None):
    """Jitted (train_step, eval_step) for `loss_fn(params, frozen, window) -> (loss, metrics)`.

    train_step(params, opt_state, frozen, window, lr) -> (params, opt_state, metrics) donates the
    parameters and optimizer state; the frozen target is an ordinary argument, read only, and the
    learning rate comes from the host (`optim.lr_at`). eval_step(params, frozen, window) ->
    metrics. compiler_options: XLA's, e.g. {"xla_backend_optimization_level": 0} to compile
    tests fast."""

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


# ----------------------------------------------------------------------------- evaluation
def evaluate(eval_step, params, frozen, windows: np.ndarray, batch_size: int) -> dict:
    """Metrics over fixed held-out windows `[W, T+1]`, averaged over batches of one shape (one
    compile; windows past the last whole batch are left out)."""
    batch_size = min(batch_size, windows.shape[0])
    sums, count = {}, 0
    for s in range(0, windows.shape[0] - batch_size + 1, batch_size):
        m = jax.device_get(eval_step(params, frozen, jnp.asarray(windows[s:s + batch_size])))
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + float(v)
        count += 1
    return {k: v / count for k, v in sums.items()}


def accept_estimate(accs: list[float]) -> float:
    """1 + a0 + a0 a1 + ...: the mean accepted length of a chain whose step i is accepted at the
    measured per-step rate given the earlier ones (a guide; the engine measures the real one)."""
    total, run = 1.0, 1.0
    for a in accs:
        run *= a
        total += run
    return total


def _fmt(m: dict, n_steps: int) -> str:
    accs = " ".join(f"{m[f'acc_{i}']:.3f}" for i in range(n_steps))
    return f"loss {m['loss']:.4f} acc [{accs}]"


# ----------------------------------------------------------------------------- the loop
def train_loop(train_step, eval_step, params, opt_state, frozen, batches: Iterator[np.ndarray], cfg: TrainConfig,
               *, heldout: np.ndarray | None = None, log=print) -> tuple[object, list[dict], dict]:
    """Run up to cfg.steps steps (fewer when a time budget, timed over the first steps after the
    compile, says so). Returns (params, history, timing). History rows: {"step", "split": "train"
    | "heldout", "loss", "loss_i", "acc_i", ...}; a train row averages the steps since the last.
    Metrics stay on the device between log lines, so the host runs ahead of the device."""
    history: list[dict] = []
    acc_keys = [f"acc_{i}" for i in range(cfg.ttt_steps)]
    total, probe = cfg.steps, 20  # probe: steps timed before a time budget fixes the schedule
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
    opt = make_opt(cfg)
    train_step, eval_step = make_steps(loss_fn, opt, compiler_options)
    batches = data.sample_batches(tokens, cfg.batch_size, cfg.seq_len, seed=cfg.seed)
    held = None if heldout is None else data.eval_windows(data.load_tokens(heldout), cfg.seq_len, cfg.eval_windows)
    return train_loop(train_step, eval_step, params, opt.init(params), frozen, batches, cfg, heldout=held, log=log)
