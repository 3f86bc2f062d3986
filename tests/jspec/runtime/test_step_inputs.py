"""The packed step input (`jspec.runtime.step_inputs.pack`) read back field by field: the token after
each token that hidden-state drafters take (`next_ids`), known where the request's sequence holds
it and -1 where it is the newest token (sampled by the step itself) or the input only the device
has."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from jspec.models.batch import ForwardMode
from jspec.runtime.sampling_params import SamplingParams
from jspec.runtime.scheduler import ScheduledReq, StepPlan
from jspec.runtime.step_inputs import Bucket, pack


def _fields(bucket: Bucket, packed: np.ndarray) -> dict:
    out, off = {}, 0
    for name, shape in bucket.fields():
        n = int(np.prod(shape))
        out[name] = packed[off:off + n].reshape(shape)
        off += n
    return out


def _req(slot: int, input_ids: list[int], output_ids: list[int]):
    return SimpleNamespace(slot=slot, seed=slot, sampling=SamplingParams(temperature=0.0), top_logprobs_num=0,
                           held_stops=(), input_ids=input_ids, output_ids=output_ids,
                           all_ids=input_ids + output_ids)


def test_next_ids_hold_the_known_token_after_each_token():
    bucket = Bucket(ForwardMode.EXTEND, 16, 4, 4, next_ids=True)
    a = _req(1, list(range(100, 110)), [])  # a middle chunk: the token after its last one is known
    b = _req(2, list(range(200, 205)), [7, 8])  # refed after a retraction: the chunk reaches its newest token
    c = _req(3, list(range(300, 303)), [9])  # a decode row: its input only the device knows
    plan = StepPlan(ForwardMode.EXTEND, [
        ScheduledReq(a, 2, a.all_ids[2:6], False, False, 0),
        ScheduledReq(b, 3, b.all_ids[3:7], True, False, 2),
        ScheduledReq(c, 4, None, True, False, 1),
    ], [])
    got = _fields(bucket, pack(plan, bucket))
    assert got["input_ids"][:9].tolist() == [102, 103, 104, 105, 203, 204, 7, 8, -1]
    assert got["next_ids"].tolist() == [103, 104, 105, 106, 204, 7, 8, -1, -1] + [-1] * 7
