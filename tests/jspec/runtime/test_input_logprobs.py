"""SGLang's input_token_logprobs (`logprob_start_len`) against transformers: a prompt fed over several
chunks reports log_softmax of the oracle's logits for every prompt token from the start position on
(None for the first token of all), with its top logprobs; a prompt whose prefix is cached computes
again what it needs; a request without them still reuses the cache."""

from __future__ import annotations

import numpy as np
import pytest

from jspec import Engine
from jspec.errors import InvalidRequestError
from tests.support import models as tm
from tests.support.engines import SMALL, check_no_leaks

TOP = 3


@pytest.fixture(scope="module")
def setup(tiny_checkpoint):
    d, hf = tiny_checkpoint("qwen3", 77), tiny_checkpoint.hf("qwen3", 77)
    eng = Engine(d, page_size=4, chunked_prefill_size=8, context_length=64, enable_input_logprobs=True,
                 transfer_guard="disallow", **SMALL)
    yield eng, hf
    eng.shutdown()


def _oracle(hf, ids):
    logits = tm.hf_logits(hf, ids).astype(np.float64)
    lsm = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
        logits.max(-1, keepdims=True)
    return [None] + [lsm[k - 1, ids[k]] for k in range(1, len(ids))], lsm


def test_input_logprobs_over_chunks_equal_transformers(setup):
    eng, hf = setup
    p = tm.random_ids(21, seed=5)  # three chunks of 8
    want, lsm = _oracle(hf, p)
    out = eng.generate(input_ids=p, sampling_params={"max_new_tokens": 2, "temperature": 0},
                       top_logprobs_num=TOP, logprob_start_len=0)
    got = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in got] == p and got[0][0] is None
    np.testing.assert_allclose([lp for lp, _, _ in got[1:]], want[1:], rtol=1e-4, atol=1e-4)
    top = out["meta_info"]["input_top_logprobs"]
    assert top[0] is None
    for k in range(1, len(p)):
        order = np.argsort(-lsm[k - 1], kind="stable")[:TOP]
        assert [t for _, t, _ in top[k]] == order.tolist()
        np.testing.assert_allclose([lp for lp, _, _ in top[k]], lsm[k - 1, order], rtol=1e-4, atol=1e-4)
    assert len(out["meta_info"]["output_token_logprobs"]) == 2  # output logprobs come with them


def test_a_stream_builds_its_input_logprobs_once(setup):
    """Every streamed chunk carries the prompt's rows (SGLang's cumulative meta_info); they are
    built at the first chunk and handed out again after, not rebuilt or copied per chunk (that cost
    the prompt's length times its top logprobs per chunk, and at concurrency 32 most of the
    throughput)."""
    eng, _ = setup
    p = tm.random_ids(15, seed=9)
    whole = eng.generate(input_ids=p, sampling_params={"max_new_tokens": 5, "temperature": 0},
                         top_logprobs_num=TOP, logprob_start_len=2)
    chunks = list(eng.generate(input_ids=p, sampling_params={"max_new_tokens": 5, "temperature": 0},
                               top_logprobs_num=TOP, logprob_start_len=2, stream=True))
    assert len(chunks) >= 2
    want = whole["meta_info"]
    for c in chunks:
        meta = c["meta_info"]
        assert meta["input_token_logprobs"] == want["input_token_logprobs"]
        assert meta["input_top_logprobs"] == want["input_top_logprobs"]
    first, last = chunks[0]["meta_info"], chunks[-1]["meta_info"]
    assert first["input_token_logprobs"] is last["input_token_logprobs"]
    assert first["input_top_logprobs"] is last["input_top_logprobs"]
    assert last["output_token_logprobs"] == want["output_token_logprobs"]


def test_a_cached_prefix_is_computed_again_when_its_logprobs_are_asked_for(setup):
    eng, hf = setup
    p = tm.random_ids(19, seed=6)
    want, _ = _oracle(hf, p)
    sp = {"max_new_tokens": 2, "temperature": 0}
    first = eng.generate(input_ids=p, sampling_params=sp)
    assert "input_token_logprobs" not in first["meta_info"]
    again = eng.generate(input_ids=p, sampling_params=sp)
    assert again["meta_info"]["cached_tokens"] >= 12  # a request without them reuses the cache
    late = eng.generate(input_ids=p, sampling_params=sp, logprob_start_len=9)
    assert late["meta_info"]["cached_tokens"] <= 8  # position 8 predicts token 9: computed again
    got = late["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in got] == p[9:]
    np.testing.assert_allclose([lp for lp, _, _ in got], want[9:], rtol=1e-4, atol=1e-4)
    assert late["output_ids"] == first["output_ids"]
    check_no_leaks(eng)


def test_logprob_start_len_is_checked(setup):
    eng, _ = setup
    p = tm.random_ids(6, seed=7)
    with pytest.raises(InvalidRequestError, match=r"logprob_start_len: must be an int in \[-1, 6\)"):
        eng.generate(input_ids=p, sampling_params={"max_new_tokens": 2}, logprob_start_len=6)
    from jspec.runtime.request import RequestLimits, make_request

    limits = RequestLimits(vocab_size=tm.VOCAB, context_length=64, pool_tokens=256, spec_extra=0, max_top_logprobs=0,
                           disable_top_k_top_p=False)
    with pytest.raises(InvalidRequestError, match="logprob_start_len: input token logprobs are off"):
        make_request(limits, None, prompt=None, input_ids=p, sampling_params={"max_new_tokens": 2},
                     return_logprob=True, top_logprobs_num=0, stream=False, rid=None, next_seed=lambda: 0,
                     logprob_start_len=0)


def test_a_speculative_engine_reports_the_same_input_logprobs(setup, tiny_checkpoint):
    """The prompt chunks of a speculative engine (NGRAM: no drafter weights to load) run the same
    step with the drafter's part added: the same input logprobs, beside speculated outputs; on a
    target split over 2 devices (each token's logprob read where its vocabulary slice lives)."""
    _, hf = setup
    p = tm.random_ids(17, seed=8)
    want, _ = _oracle(hf, p)
    with Engine(tiny_checkpoint("qwen3", 77), page_size=4, chunked_prefill_size=8, context_length=64,
                enable_input_logprobs=True, speculative_algorithm="NGRAM", speculative_num_steps=2,
                speculative_num_draft_tokens=3, tp_size=2, **SMALL) as eng:
        out = eng.generate(input_ids=p, sampling_params={"max_new_tokens": 4, "temperature": 0}, logprob_start_len=3)
        check_no_leaks(eng)
    got = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in got] == p[3:]
    np.testing.assert_allclose([lp for lp, _, _ in got], want[3:], rtol=1e-4, atol=1e-4)


def test_max_new_tokens_zero_scores_the_prompt(setup):
    """Scoring (OpenAI echo with max_tokens 0): the prompt runs for its logprobs, nothing is generated."""
    eng, hf = setup
    p = tm.random_ids(13, seed=8)
    want, _ = _oracle(hf, p)
    out = eng.generate(input_ids=p, sampling_params={"max_new_tokens": 0, "temperature": 0}, logprob_start_len=0)
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    got = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in got] == p and got[0][0] is None
    np.testing.assert_allclose([lp for lp, _, _ in got[1:]], want[1:], rtol=1e-4, atol=1e-4)
    plain = eng.generate(input_ids=p, sampling_params={"max_new_tokens": 0})  # without logprobs: no step at all
    assert plain["output_ids"] == [] and "input_token_logprobs" not in plain["meta_info"]
    check_no_leaks(eng)


def test_input_logprobs_in_blocks_equal_one_log_softmax():
    """The blocked loop against one log_softmax over every row: the rows with a next token equal it
    whatever the block (blocks of 4 over 11 rows: one padded; 16: one block); top logprobs only
    where asked (zeros elsewhere)."""
    import jax
    import jax.numpy as jnp

    from jspec.runtime.step import input_logprob_block, input_logprobs

    class Head:
        tp_size = 1
        w = jax.random.normal(jax.random.PRNGKey(0), (8, 40), jnp.float32)

        def compute_logits(self, h):
            return h @ self.w

    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.standard_normal((11, 8)), jnp.float32)
    nxt = jnp.asarray([3, 7, -1, 1, 0, 39, 5, 2, -1, 6, -1], jnp.int32)
    temp = jnp.asarray([0.0] * 5 + [0.7] * 6, jnp.float32)
    lsm = np.asarray(jax.nn.log_softmax(hidden @ Head.w / jnp.where(temp < 1e-5, 1.0, temp)[:, None], axis=-1))
    want_top = np.argsort(-lsm, axis=-1, kind="stable")[:, :TOP]
    has = np.asarray(nxt) >= 0
    for block in (4, 16):
        lp, top_ids, top_lp = map(np.asarray, jax.jit(lambda h, n, t, b=block: input_logprobs(
            Head(), h, n, t, TOP, block=b))(hidden, nxt, temp))
        np.testing.assert_allclose(lp[has], lsm[has, np.asarray(nxt)[has]], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(top_ids, want_top)  # every row's, asked for all
        np.testing.assert_allclose(top_lp, np.take_along_axis(lsm, want_top, -1), rtol=1e-5, atol=1e-5)
    asked = jnp.asarray([True, False] * 5 + [True])
    lp, top_ids, top_lp = map(np.asarray, input_logprobs(Head(), hidden, nxt, temp, TOP, block=4, top_wanted=asked))
    keep = np.asarray(asked) & has
    np.testing.assert_array_equal(top_ids[keep], want_top[keep])
    assert not top_ids[~keep].any() and not top_lp[~keep].any()
    np.testing.assert_allclose(lp[has], lsm[has, np.asarray(nxt)[has]], rtol=1e-5, atol=1e-5)
    assert input_logprob_block(151_936) == 512 and input_logprob_block(512) == 1024
    assert input_logprob_block(10_000_000) == 16


def test_the_loop_leaves_a_chunks_top_rows_to_the_reader():
    """A prompt step's input top logprobs reach the request as arrays (`input_top_pending`), and the
    reader builds their rows (`input_top_rows`), in order and once: the loop spends nothing on
    thousands of tuples between one step's results and the next launch."""
    from types import SimpleNamespace

    from jspec.runtime.engine_core import EngineCore
    from jspec.runtime.request import Request
    from jspec.runtime.sampling_params import SamplingParams

    num_top, ids = 4, list(range(10, 22))  # a 12-token prompt, its logprobs from position 0
    req = Request(rid="r", input_ids=ids, sampling=SamplingParams(max_new_tokens=1), seed=0, return_logprob=True,
                  top_logprobs_num=2, logprob_start_len=0)
    req.input_logprobs.append(None)
    req.input_top_logprobs.append(None)
    core = EngineCore.__new__(EngineCore)
    core.runner = SimpleNamespace(num_top=num_top)
    for start in (0, 8):  # two chunks: 8 tokens, then 4
        n = min(8, len(ids) - start)
        rows = np.zeros((n, 2 + 2 * num_top), np.int32)
        rows[:, 1] = np.arange(start, start + n, dtype=np.float32).view(np.int32)  # logprob = position
        rows[:, 2:2 + num_top] = np.arange(start, start + n)[:, None] * 10 + np.arange(num_top)  # ids
        rows[:, 2 + num_top:] = (-np.arange(start, start + n, dtype=np.float32)[:, None]
                                 - np.arange(num_top, dtype=np.float32)).view(np.int32)
        step = SimpleNamespace(req=req, token_ids=ids[start:start + n], start=start, num_tokens=n)
        core._input_logprobs(SimpleNamespace(plan=SimpleNamespace(reqs=[step])), rows)
    assert req.input_top_logprobs == [None] and len(req.input_top_pending) == 2  # nothing built by the loop
    assert req.input_logprobs == [None] + [float(p) for p in range(11)]  # position p predicts token p + 1
    top = req.input_top_rows()
    assert top[1:] == [[(-float(p), p * 10, None), (-float(p) - 1, p * 10 + 1, None)] for p in range(11)]
    assert not req.input_top_pending and req.input_top_rows() is top
