"""Causal-LM pre-training of a jspec `CausalLM` on a flat token corpus.

Precision: the optimizer keeps float32 master parameters (and float32 Adam moments); each step
casts them to the compute dtype (bfloat16 on GPU) for the forward and backward, and the cast's
gradient lands back in float32. At 10M parameters the float32 copy costs nothing, while bf16 Adam
updates of lr * 1e-3-sized steps would round to zero on weights of magnitude ~0.02 and stall
training. Norms, softmax, router, GDN gates and state run in float32 inside the modules anyway.

The step is one jitted function with the parameters and optimizer state donated (updated in
place); the learning rate comes in as an argument (see `optim`). Losses are fetched from the
device only every `log_every` steps, so the host runs ahead of the device in between.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jspec.config import ModelConfig
from jspec.errors import ConfigError
from jspec.train import optim
from jspec.train.data import eval_windows, sample_batches
from jspec.train.dense import dense_forward
from jspec.train.init import init_params, num_parameters


@dataclasses.dataclass
class TrainConfig:
    steps: int = 2000  # the most steps; a time budget may stop the schedule earlier
    batch_size: int = 64
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    compute_dtype: str = "auto"  # "auto": bfloat16 on GPU, float32 elsewhere
    attention_impl: str = "auto"  # see dense.ATTENTION_IMPLS
    eval_every: int = 250
    eval_windows: int = 128  # held-out windows of seq_len tokens per evaluation
    log_every: int = 25
    seed: int = 0
    # Fit the schedule into this much wall time (compile included): after timing its first steps the
    # run fixes its length. Rerunning with --steps set to that length gives the same schedule as long
    # as the warmup stays under a tenth of it.
    time_budget_s: float | None = None


@dataclasses.dataclass
class TrainResult:
    graphdef: nnx.GraphDef
    params: nnx.State  # float32
    history: dict


def resolve_compute_dtype(name: str):
    if name == "auto":
        return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    if name not in ("float32", "bfloat16"):
        raise ConfigError(f"compute dtype must be auto, float32 or bfloat16, got {name!r}")
    return jnp.dtype(name)


def lm_loss(graphdef, params, batch, *, compute_dtype=jnp.float32, attention_impl=None):
    """Mean next-token cross entropy over batch `[B, T+1]` (inputs `[:, :-1]`, targets `[:, 1:]`)."""
    nll = _token_nll(graphdef, params, batch, compute_dtype, attention_impl)
    return jnp.mean(nll)


def _token_nll(graphdef, params, batch, compute_dtype, attention_impl):
    cast = jax.tree_util.tree_map(lambda p: p.astype(compute_dtype), params)
    module = nnx.merge(graphdef, cast)
    logits, _, _ = dense_forward(module, batch[:, :-1], attention_impl=attention_impl)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:])  # [B, T] float32


def make_steps(graphdef, opt: optax.GradientTransformation, *, compute_dtype, attention_impl):
    """(train_step(params, opt_state, batch, lr) -> (params, opt_state, metrics),
    eval_step(params, batch) -> summed nll), both jitted."""
    loss = functools.partial(lm_loss, graphdef, compute_dtype=compute_dtype, attention_impl=attention_impl)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, batch, lr):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optim.apply_lr(params, updates, lr)
        return params, opt_state, {"loss": value, "grad_norm": optax.global_norm(grads)}

    @jax.jit
    def eval_step(params, batch):
        return jnp.sum(_token_nll(graphdef, params, batch, compute_dtype, attention_impl))

    return train_step, eval_step


def evaluate(eval_step, params, windows: np.ndarray, batch_size: int) -> float:
    """Mean held-out nll over `windows` `[W, T+1]` (W a multiple of the eval batch)."""
    total = 0.0
    for i in range(0, windows.shape[0], batch_size):
        total += float(eval_step(params, jnp.asarray(windows[i:i + batch_size])))
    return total / (windows.shape[0] * (windows.shape[1] - 1))


def train_lm(config: ModelConfig, train_tokens: np.ndarray, heldout_tokens: np.ndarray, tc: TrainConfig, *,
             log: Callable[[str], None] = print, history_path: str | None = None) -> TrainResult:
    """Pre-train a freshly initialised model; evaluates held-out loss every `eval_every` steps and
    at the end. history_path: rewritten at every evaluation (a cut-off run keeps its curve)."""
    compute_dtype = resolve_compute_dtype(tc.compute_dtype)
    graphdef, params = init_params(config, seed=tc.seed)
    opt = optim.adamw(b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay, grad_clip=tc.grad_clip)
    opt_state = opt.init(params)
    train_step, eval_step = make_steps(graphdef, opt, compute_dtype=compute_dtype,
                                       attention_impl=tc.attention_impl)

    eval_bs = min(tc.batch_size, tc.eval_windows)
    windows = eval_windows(heldout_tokens, tc.seq_len, tc.eval_windows)
    windows = windows[: max(eval_bs, windows.shape[0] // eval_bs * eval_bs)]
    eval_bs = min(eval_bs, windows.shape[0])
    batches = sample_batches(train_tokens, tc.batch_size, tc.seq_len, seed=tc.seed)
    tokens_per_step = tc.batch_size * tc.seq_len
    n_params = num_parameters(params)
    history = {
        "model": {"architecture": config.architecture, "parameters": n_params, "layers": config.layer_pattern()},
        "train_config": dataclasses.asdict(tc),
        "compute_dtype": jnp.dtype(compute_dtype).name,
        "device": str(jax.devices()[0].device_kind),
        "jax_version": jax.__version__,
        "train_tokens_available": int(train_tokens.shape[0]),
        "heldout_tokens_evaluated": int(windows.shape[0] * tc.seq_len),
        "train": [],
        "eval": [],
    }
    log(f"{config.architecture} {config.layer_pattern()}: {n_params / 1e6:.2f}M parameters, "
        f"compute {history['compute_dtype']} on {history['device']}; {train_tokens.shape[0] / 1e6:.1f}M train tokens, "
        f"{tokens_per_step} tokens/step")

    total = tc.steps
    warmup = min(tc.warmup_steps, max(total // 10, 1))
    probe = 20  # steps timed (after the compile) before a time budget fixes the schedule's length
    pending = []  # per-step device metrics not fetched yet
    t_start = time.perf_counter()
    t_warm = None  # time after the first (compiling) step
    eval_seconds = 0.0
    step = 0

    def run_eval(step):
        t0 = time.perf_counter()
        loss = evaluate(eval_step, params, windows, eval_bs)
        row = {"step": step, "tokens": step * tokens_per_step, "loss": loss, "ppl": math.exp(min(loss, 50.0)),
               "elapsed_s": round(time.perf_counter() - t_start, 2)}
        history["eval"].append(row)
        log(f"  eval step {step}: held-out loss {loss:.4f}, perplexity {row['ppl']:.2f}")
        if history_path:
            _write_json(history_path, history)
        return time.perf_counter() - t0

    while step < total:
        lr = optim.lr_at(step, peak=tc.lr, warmup=warmup, total=total, min_ratio=tc.min_lr_ratio)
        params, opt_state, metrics = train_step(params, opt_state, jnp.asarray(next(batches)),
                                                jnp.asarray(lr, jnp.float32))
        pending.append((step, lr, metrics))
        step += 1
        if t_warm is None:
            jax.block_until_ready(metrics["loss"])
            t_warm = time.perf_counter()
            history["compile_s"] = round(t_warm - t_start, 2)
            log(f"  first step (compile) {history['compile_s']:.1f} s")
        if tc.time_budget_s and step == 1 + probe and total > step:
            jax.block_until_ready(metrics["loss"])
            per_step = (time.perf_counter() - t_warm) / probe
            left = tc.time_budget_s - (time.perf_counter() - t_start)
            total = optim.fitted_steps(step, tc.steps, per_step_s=per_step, left_s=left, margin=0.03)
            warmup = min(warmup, max(total // 10, 1))
            history["schedule_steps"] = total
            log(f"  {per_step * 1e3:.1f} ms/step: schedule fixed at {total} steps for a "
                f"{tc.time_budget_s:.0f} s budget")
        if step % tc.log_every == 0 or step == total:
            fetched = jax.device_get([m for _, _, m in pending])
            now = time.perf_counter()
            for (s, lr_s, _), m in zip(pending, fetched):
                history["train"].append({"step": s + 1, "tokens": (s + 1) * tokens_per_step, "lr": lr_s,
                                         "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"])})
            pending = []
            train_time = now - t_warm - eval_seconds
            rate = (step - 1) * tokens_per_step / train_time if train_time > 0 and step > 1 else float("nan")
            last = history["train"][-1]
            log(f"step {step}/{total} loss {last['loss']:.4f} lr {lr:.2e} grad-norm {last['grad_norm']:.3f} "
                f"{rate / 1e3:.0f}k tok/s")
        if step % tc.eval_every == 0 and step < total:
            eval_seconds += run_eval(step)
    jax.block_until_ready(params)
    train_time = time.perf_counter() - t_warm - eval_seconds
    history["steps"] = step
    history["warmup_steps"] = warmup
    history["tokens_seen"] = step * tokens_per_step
    history["train_seconds"] = round(train_time, 2)
    history["tokens_per_second"] = round((step - 1) * tokens_per_step / train_time, 1) if step > 1 else None
    run_eval(step)
    history["final_heldout_loss"] = history["eval"][-1]["loss"]
    history["final_heldout_ppl"] = history["eval"][-1]["ppl"]
    history["wall_seconds"] = round(time.perf_counter() - t_start, 2)
    if history_path:
        _write_json(history_path, history)
    return TrainResult(graphdef=graphdef, params=params, history=history)


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def plot_history(history: dict, path: str, title: str | None = None) -> None:
    """Loss curve PNG: training loss (and a smoothed line) and held-out loss against tokens seen."""
    import matplotlib  # optional (the test and bench extras): `jspec train plot` makes the PNG later

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    tr = history["train"]
    if tr:
        x = np.array([r["tokens"] for r in tr]) / 1e6
        y = np.array([r["loss"] for r in tr])
        ax.plot(x, y, color="tab:blue", alpha=0.3, lw=0.8)
        k = max(1, len(y) // 50)
        if k > 1:
            smooth = np.convolve(y, np.ones(k) / k, mode="valid")
            ax.plot(x[k - 1:], smooth, color="tab:blue", lw=1.5, label="train")
        else:
            ax.lines[-1].set_label("train")
    ev = history["eval"]
    if ev:
        ax.plot([r["tokens"] / 1e6 for r in ev], [r["loss"] for r in ev], "o-", color="tab:orange", ms=3,
                label=f"held-out (final ppl {ev[-1]['ppl']:.1f})")
    ax.set_xlabel("tokens seen (M)")
    ax.set_ylabel("cross entropy (nats / token)")
    ax.set_title(title or history.get("model", {}).get("architecture", ""))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
