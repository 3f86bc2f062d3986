"""SamplingParams: SGLang defaults, validation errors that name the field, greedy normalisation."""

from __future__ import annotations

import numpy as np
import pytest

from jspec.errors import InvalidRequestError
from jspec.runtime.sampling_params import MAX_LOGIT_BIAS, SamplingParams

VOCAB = 1000


def test_defaults_match_sglang():
    p = SamplingParams.from_dict(None, vocab_size=VOCAB)
    assert p == SamplingParams.from_dict({}, vocab_size=VOCAB) == SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 1.0, 1.0, -1, 0.0)
    assert p.stop is None and p.stop_token_ids is None and p.seed is None
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (1.0, 0.0, 0.0)
    assert not p.ignore_eos and p.skip_special_tokens and p.n == 1
    assert not p.is_greedy and p.normalized() is p


def test_valid_values_are_normalised():
    p = SamplingParams.from_dict(
        dict(temperature=1, top_p=0.5, top_k=40, min_p=1, stop="###", stop_token_ids=[0, VOCAB - 1],
             seed=2**31 - 1, max_new_tokens=0, frequency_penalty=-2, presence_penalty=2,
             repetition_penalty=0.1, ignore_eos=True, skip_special_tokens=False, n=1),
        vocab_size=VOCAB,
    )
    assert isinstance(p.temperature, float) and isinstance(p.min_p, float)
    assert p.stop == ("###",) and p.stop_token_ids == (0, VOCAB - 1) and p.seed == 2**31 - 1
    assert SamplingParams.from_dict(dict(stop=["a", "b"]), vocab_size=VOCAB).stop == ("a", "b")
    # numpy scalars are integers / numbers too (Python API callers pass them).
    q = SamplingParams.from_dict(dict(top_k=np.int64(5), temperature=np.float32(0.5)), vocab_size=VOCAB)
    assert q.top_k == 5 and type(q.top_k) is int and q.temperature == 0.5
    hash(p)  # frozen and tuple-valued: usable as a dict key


@pytest.mark.parametrize(
    "params, field",
    [
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(max_new_tokens=1.0), "max_new_tokens"),
        (dict(max_new_tokens=True), "max_new_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature="1"), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=True), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_p=-0.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=5.0), "top_k"),
        (dict(top_k=True), "top_k"),
        (dict(min_p=-0.01), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(stop=5), "stop"),
        (dict(stop=["a", 3]), "stop"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=5), "stop_token_ids"),
        (dict(stop_token_ids=[1, "2"]), "stop_token_ids"),
        (dict(stop_token_ids=[1, True]), "stop_token_ids"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(stop_token_ids=[VOCAB]), "stop_token_ids"),
        (dict(ignore_eos=1), "ignore_eos"),
        (dict(skip_special_tokens="yes"), "skip_special_tokens"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(frequency_penalty=2.5), "frequency_penalty"),
        (dict(frequency_penalty=-2.01), "frequency_penalty"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(presence_penalty=None), "presence_penalty"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**31), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(seed="7"), "seed"),
        (dict(n=1.5), "n"),
        (dict(n=0), "n"),
        (dict(min_new_tokens=-1), "min_new_tokens"),
        (dict(min_new_tokens=2.0), "min_new_tokens"),
        (dict(regex=""), "regex"),
        (dict(json_schema=["a"]), "json_schema"),
        (dict(regex="a", ebnf="root ::= \"a\""), "ebnf"),
        (dict(no_stop_trim=1), "no_stop_trim"),
        (dict(stop_regex=5), "stop_regex"),
        (dict(stop_regex=["a", 3]), "stop_regex"),
        (dict(stop_regex="(unclosed"), "stop_regex"),
        (dict(stop_regex="x*"), "stop_regex"),  # matches the empty string: every request would end at once
        (dict(logit_bias=[5]), "logit_bias"),
        (dict(logit_bias={"a": 1.0}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={str(VOCAB): 1.0}), "logit_bias"),
        (dict(logit_bias={"5": 1.0, 5: 2.0}), "logit_bias"),
        (dict(logit_bias={5: 100.5}), "logit_bias"),
        (dict(logit_bias={5: float("nan")}), "logit_bias"),
        (dict(logit_bias={5: "1"}), "logit_bias"),
        (dict(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}), "logit_bias"),
        (dict(best_of=2), "best_of"),
        (dict(temprature=0.5), "temprature"),
    ],
)
def test_invalid_values_name_the_field(params, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_dict(params, vocab_size=VOCAB)
    assert str(info.value).startswith(f"sampling_params.{field}: "), str(info.value)
    assert isinstance(info.value, ValueError)


def test_logit_bias_is_normalised():
    """OpenAI's string ids and Python's int ids alike become (id, bias) pairs sorted by id; an empty
    map is no bias; the normalised form (as `normalized` hands it back) is accepted again."""
    p = SamplingParams.from_dict(dict(logit_bias={"17": -100, 3: 2.5, " 9": 0}, temperature=0), vocab_size=VOCAB)
    assert p.logit_bias == ((3, 2.5), (9, 0.0), (17, -100.0)) and p.normalized().logit_bias == p.logit_bias
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(logit_bias={i: 1 for i in range(MAX_LOGIT_BIAS)}).logit_bias[-1] == (MAX_LOGIT_BIAS - 1, 1.0)
    hash(p)


def test_messages_are_specific():
    def message(**params):
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams.from_dict(params, vocab_size=VOCAB)
        return str(info.value)

    assert message(top_p=0) == "sampling_params.top_p: must be in (0, 1], got 0"
    assert "unknown key" in message(best_of=2)
    assert "[0, 1000)" in message(stop_token_ids=[1000])
    assert message(n=0) == "sampling_params.n: must be >= 1, got 0"


def test_not_a_dict():
    with pytest.raises(InvalidRequestError, match="^sampling_params: must be a dict"):
        SamplingParams.from_dict([("top_p", 0.5)], vocab_size=VOCAB)


def test_direct_construction_validates_too():
    with pytest.raises(InvalidRequestError, match="^sampling_params.top_k: "):
        SamplingParams(top_k=0)
    with pytest.raises(InvalidRequestError, match="^sampling_params.stop_token_ids: "):
        SamplingParams(stop_token_ids=[7]).check_vocab(5)


@pytest.mark.parametrize(
    "params, greedy",
    [
        (dict(temperature=0.0), True),
        (dict(temperature=1e-6), True),
        (dict(temperature=1e-5), False),
        (dict(top_k=1, temperature=0.7), True),
        (dict(top_k=2, temperature=0.7), False),
    ],
)
def test_greedy_normalisation(params, greedy):
    p = SamplingParams(**params)
    assert p.is_greedy == greedy
    n = p.normalized()
    if greedy:
        assert (n.temperature, n.top_k) == (0.0, 1) and n.is_greedy
    else:
        assert n == p


def test_min_new_tokens_holds_back_a_bounded_number_of_stop_tokens():
    from jspec.runtime.request import RequestLimits, make_request
    from jspec.runtime.step_inputs import MAX_HELD_STOPS

    limits = RequestLimits(vocab_size=VOCAB, context_length=512, pool_tokens=1024, spec_extra=0, max_top_logprobs=0,
                           disable_top_k_top_p=False, eos_token_ids=(2, 7))
    make = lambda sp: make_request(limits, None, prompt=None, input_ids=[1], sampling_params=sp,  # noqa: E731
                                   return_logprob=False, top_logprobs_num=0, stream=False, rid=None,
                                   next_seed=lambda: 0)
    assert make({"min_new_tokens": 3, "stop_token_ids": [9, 2]}).held_stops == (2, 7, 9)
    assert make({"stop_token_ids": [9]}).held_stops == ()  # nothing held without min_new_tokens
    with pytest.raises(InvalidRequestError, match="sampling_params.min_new_tokens: holds back at most"):
        make({"min_new_tokens": 3, "stop_token_ids": list(range(10, 10 + MAX_HELD_STOPS))})
