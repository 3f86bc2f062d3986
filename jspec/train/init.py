"""Initial parameters for training a `CausalLM` from scratch (float32 master copy)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jspec.config import ModelConfig
from jspec.models.causal_lm import CausalLM
from jspec.models.loader import abstract_model, fill_state, flat_names

# Projections that write into the residual stream: scaled down by sqrt(2 * layers) (GPT-2) so the
# stream's variance at init does not grow with depth.
_RESIDUAL_OUT = ("o_proj.weight", "down_proj.weight", "out_proj.weight", "experts.down_proj")


def init_value(config: ModelConfig, name: str, shape: tuple, key, std: float = 0.02) -> np.ndarray:
    """Initial float32 value of jspec parameter `name`."""
    if name.endswith(("norm.weight", "layernorm.weight")):
        # Zero-centred norms store w - 1; the GDN output norm is a plain RMSNorm in every family.
        zero = config.zero_centred_norm and not name.endswith("linear_attn.norm.weight")
        return np.zeros(shape, np.float32) if zero else np.ones(shape, np.float32)
    if name.endswith("A_log"):  # decay rates A ~ U(1, 16), as HF's Qwen3-Next init (which uses U(0, 16))
        return np.log(np.asarray(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)))
    if name.endswith("dt_bias"):
        return np.ones(shape, np.float32)
    if name.endswith("bias"):
        return np.zeros(shape, np.float32)
    if name.endswith("conv1d.weight"):  # PyTorch's Conv1d default: U(+-1/sqrt(fan_in)), fan_in = K
        bound = shape[-1] ** -0.5
        return np.asarray(jax.random.uniform(key, shape, jnp.float32, -bound, bound))
    scale = std / np.sqrt(2 * config.num_hidden_layers) if name.endswith(_RESIDUAL_OUT) else std
    return np.asarray(scale * jax.random.normal(key, shape, jnp.float32))


def init_params(config: ModelConfig, seed: int = 0, std: float = 0.02) -> tuple[nnx.GraphDef, nnx.State]:
    """(graph definition, float32 parameter state) of a freshly initialised target model."""
    graphdef, abstract = abstract_model(config, jnp.float32)
    key = jax.random.PRNGKey(seed)
    flat = {name: init_value(config, name, shape, jax.random.fold_in(key, i), std)
            for i, (name, shape) in enumerate(sorted(flat_names(abstract).items()))}
    return graphdef, fill_state(abstract, flat, jnp.float32)


def init_model(config: ModelConfig, seed: int = 0) -> CausalLM:
    return nnx.merge(*init_params(config, seed))


def num_parameters(state: nnx.State) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(state))
