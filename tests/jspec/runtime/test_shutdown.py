"""`Engine.shutdown()` gives the device back: every buffer the engine owns is freed at once, not
when the Python object goes, so the next engine in the process sizes its pool from the whole
device; an engine used after shutdown raises a typed error. What start-up allocated is frozen out
of the garbage collector's reach while the engine serves, and handed back at shutdown."""

from __future__ import annotations

import gc

import jax
import pytest

from jspec import Engine
from jspec.errors import EngineShutdownError
from jspec.models.loader import load_model
from jspec.tiny import tiny_dir

# One decode batch size and no top-k / top-p step variants: those add executables, not buffers.
# The engines stay adaptive (the default), whose plain-step and shorter-chain variants they keep.
SETTINGS = dict(dtype="float32", cuda_graph_bs=[2], max_running_requests=2, chunked_prefill_size=32,
                context_length=96, show_progress=False, compilation_cache_dir="none", disable_top_k_top_p=True)
ENGINES = {
    "plain": dict(model_path=tiny_dir("qwen3")),
    "eagle3": dict(model_path=tiny_dir("qwen3"), speculative_algorithm="EAGLE3",
                   speculative_draft_model_path=tiny_dir("qwen3-eagle3"), speculative_num_steps=2,
                   speculative_eagle_topk=1, speculative_num_draft_tokens=3),
    "hybrid_nextn": dict(model_path=tiny_dir("qwen3-next"), speculative_algorithm="NEXTN", speculative_num_steps=2,
                         speculative_eagle_topk=1, speculative_num_draft_tokens=3),
}


def _live_ids() -> set[int]:
    return {id(a) for a in jax.live_arrays()}


@pytest.mark.parametrize("name", list(ENGINES))
def test_shutdown_frees_every_device_buffer(name):
    before = _live_ids()
    eng = Engine(**ENGINES[name], **SETTINGS)
    assert gc.get_freeze_count() > 0  # start-up's objects: no full collection scans them while serving
    out = eng.generate(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 6, "temperature": 0})
    assert len(out["output_ids"]) == 6
    assert len(_live_ids() - before) > 0
    eng.shutdown()
    assert gc.get_freeze_count() == 0  # the engine's own objects can be collected once it is dropped
    left = [a for a in jax.live_arrays() if id(a) not in before]
    assert not left, f"{name}: {len(left)} arrays ({sum(a.nbytes for a in left)} bytes) outlive shutdown: " \
                     f"{[(a.shape, a.dtype) for a in left[:8]]}"
    with pytest.raises(EngineShutdownError, match="shut down"):
        eng.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2})
    eng.shutdown()  # idempotent


def test_a_model_passed_in_stays_the_callers(monkeypatch):
    """Weights the caller loaded survive the engine's shutdown and serve the next engine (here
    with the start-up heap left collectable, JSPEC_GC_FREEZE=0)."""
    model = load_model(tiny_dir("qwen3"), dtype="float32")
    before = _live_ids()
    with Engine(model, **SETTINGS) as eng:
        first = eng.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert not [a for a in jax.live_arrays() if id(a) not in before]
    assert not any(x.is_deleted() for x in jax.tree.leaves(model.params))
    gc.unfreeze()
    monkeypatch.setenv("JSPEC_GC_FREEZE", "0")
    with Engine(model, **SETTINGS) as eng:
        assert gc.get_freeze_count() == 0
        again = eng.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert again["output_ids"] == first["output_ids"]
