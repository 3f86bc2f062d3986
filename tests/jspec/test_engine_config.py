"""EngineConfig: what follows from the settings before anything is loaded."""

from __future__ import annotations

from jspec import Engine
from jspec.engine_config import EngineConfig, draft_source
from jspec.tiny import tiny_dir

NEXT = tiny_dir("qwen3-next")
SMALL = dict(dtype="float32", cuda_graph_bs=[1], max_running_requests=1, chunked_prefill_size=32, context_length=96,
             show_progress=False, compilation_cache_dir="none", disable_top_k_top_p=True)  # greedy only


def test_naive_eagle_at_the_targets_own_directory_is_its_mtp_layer():
    """As for NEXTN: a hybrid target's directory named as the draft means its `mtp.*` layer."""
    for path in (None, NEXT, NEXT + "/"):
        cfg = EngineConfig.create(NEXT, speculative_algorithm="NAIVE_EAGLE", speculative_draft_model_path=path)
        assert draft_source(cfg.spec, NEXT) == ("NEXTN", path or NEXT)
        assert cfg.spec_extra > 0
    eagle3 = tiny_dir("qwen3-eagle3")
    cfg = EngineConfig.create(tiny_dir("qwen3"), speculative_algorithm="NAIVE_EAGLE",
                              speculative_draft_model_path=eagle3)
    assert draft_source(cfg.spec, tiny_dir("qwen3")) == (None, eagle3)  # the head's format, from its config.json


def test_naive_eagle_with_mtp_serves_the_targets_greedy_output():
    ids, sp = [3, 17, 29, 8, 41], {"max_new_tokens": 12, "temperature": 0}
    with Engine(NEXT, **SMALL) as eng:
        want = eng.generate(input_ids=ids, sampling_params=sp)["output_ids"]
    with Engine(NEXT, speculative_algorithm="NAIVE_EAGLE", speculative_draft_model_path=NEXT, **SMALL) as eng:
        got = eng.generate(input_ids=ids, sampling_params=sp)
    assert got["output_ids"] == want
    assert got["meta_info"]["spec_accept_length"] > 1.0  # the trained MTP layer does get accepted


def test_a_prompt_step_maps_a_full_cached_row_for_every_request_it_carries():
    """Cached tokens cost a prompt step no compute, so its page-update rows for cached prefixes, not
    its token budget, would decide how many requests of a shared-prefix group it admits: enough for
    every request it carries to map a whole page-table row, within MAX_PREFIX_PAGES_PER_STEP."""
    from jspec.engine_config import MAX_PREFIX_PAGES_PER_STEP

    qwen3 = tiny_dir("qwen3")
    cfg = EngineConfig.create(qwen3, max_running_requests=8, chunked_prefill_size=32, context_length=96, page_size=4)
    assert cfg.layout.pages_per_seq >= 24 and cfg.max_extend_requests == 8
    assert cfg.prefix_pages_per_step == 8 * cfg.layout.pages_per_seq
    big = EngineConfig.create(qwen3, max_running_requests=64, chunked_prefill_size=32, context_length=8192, page_size=4)
    assert big.prefix_pages_per_step == MAX_PREFIX_PAGES_PER_STEP > big.layout.pages_per_seq
    assert EngineConfig.create(qwen3, disable_radix_cache=True).prefix_pages_per_step == 0


def test_prompt_steps_without_top_k_top_p_compile_no_conditional():
    """A prompt step's sampler decides on the device whether any row needs the top-k / top-p sort
    (a conditional, whose predicate XLA on GPU copies to the host during the launch). An engine
    that refuses top-k / top-p needs no such choice: its prompt buckets sort never."""
    import dataclasses

    from jspec.models.batch import ForwardMode

    with Engine(tiny_dir("qwen3"), prefill_token_buckets=[32], **SMALL) as eng:
        (bucket,) = [b for b in eng.runner.buckets if b.mode is ForwardMode.EXTEND]
        assert bucket.sort is False
        lowered = {s: eng.runner._lower(dataclasses.replace(bucket, sort=s), eng.runner.state).as_text()
                   for s in (False, None)}
        assert lowered[False].count("stablehlo.case") == 0 and lowered[None].count("stablehlo.case") == 1
        out = eng.generate(input_ids=[3, 17, 29, 8], sampling_params={"max_new_tokens": 4, "temperature": 0.7})
        assert len(out["output_ids"]) == 4
