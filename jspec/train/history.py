"""A drafter run's record: `{name}_history.json` (the loop's rows plus what the run was) and a
plot of it, written beside the checkpoint so a shipped drafter carries its own training curve."""

from __future__ import annotations

import dataclasses
import json
import os

import jax

from jspec.train.loop import TrainConfig


def run_meta(kind: str, target_dir: str, corpus: str, heldout: str | None, cfg: TrainConfig, history: list[dict],
             timing: dict, **extra) -> dict:
    """What a run's history file records besides its rows: the inputs, the configuration, the
    device, `train_loop`'s timing, the trainer's `extra` and the last held-out row ("final"; the
    last train row when there was no held-out set)."""
    final = next((r for r in reversed(history) if r["split"] == "heldout"), history[-1] if history else {})
    return {"kind": kind, "target": os.path.abspath(target_dir), "corpus": corpus, "heldout": heldout,
            "config": dataclasses.asdict(cfg), "compute_dtype": cfg.dtype().name,
            "device": str(jax.devices()[0].device_kind), "jax_version": jax.__version__,
            **{k: (round(v, 2) if isinstance(v, float) else v) for k, v in timing.items()}, **extra, "final": final}


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
    try:  # matplotlib is optional (the test and bench extras); the JSON holds everything
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
