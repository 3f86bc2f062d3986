"""`jspec bench step` refuses a batch x context grid whose KV pool cannot fit, before allocating."""

from __future__ import annotations

import jax
import pytest

from jspec.bench import step
from jspec.cache.memory import DeviceMemory
from jspec.config import parse_hf_config
from jspec.errors import ConfigError
from jspec.models.loader import random_model
from jspec.models.presets import preset_config


def test_grid_larger_than_the_device_is_refused(monkeypatch):
    model = random_model(parse_hf_config(preset_config("tiny-qwen3")), dtype="float32", seed=0)
    weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(model.params))
    monkeypatch.setattr(step, "device_memory", lambda: DeviceMemory(2 * weights, 0))
    step.check_fits(model, 16, [(1, 16)])  # a few KV tokens fit beside the weights
    with pytest.raises(ConfigError, match=r"batch x context up to 4 x 4096 .*--batch-sizes"):
        step.check_fits(model, 4 * 4096 * 64, [(1, 64), (4, 4096)])
