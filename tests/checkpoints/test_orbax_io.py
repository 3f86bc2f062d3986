"""save_params / load_params: a bitwise round trip of flat, dotted parameter dicts through orbax."""

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from checkpoints.errors import CheckpointError
from checkpoints.orbax_io import is_orbax_dir, load_params, save_params
from checkpoints.safetensors_reader import SafetensorsCheckpoint


def random_bits(rng, shape, dtype) -> np.ndarray:
    """Every bit pattern is fair game (NaN payloads, -0, subnormals): the round trip must keep bits."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    return rng.integers(0, 256, size=n, dtype=np.uint8).view(dtype).reshape(shape)


def assert_same_bits(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        w = np.asarray(w)
        g = got[name]
        assert isinstance(g, np.ndarray), (name, type(g))
        assert g.dtype == w.dtype and g.shape == w.shape, name
        np.testing.assert_array_equal(np.ascontiguousarray(g).view(np.uint8),
                                      np.ascontiguousarray(w).view(np.uint8), err_msg=name)


def test_round_trip_bitwise_dotted_names(tmp_path):
    rng = np.random.default_rng(0)
    params = {
        "model.embed_tokens.weight": random_bits(rng, (16, 8), np.float32),
        "model.layers.0.self_attn.q_proj.weight": random_bits(rng, (8, 8), ml_dtypes.bfloat16),
        "model.layers.10.mlp.experts.3.down_proj.weight": random_bits(rng, (4, 8), ml_dtypes.bfloat16),
        "model.layers.0.self_attn.positions": rng.integers(-2**31, 2**31 - 1, size=(5,), dtype=np.int32),
        "lm_head.weight": random_bits(rng, (16, 8), ml_dtypes.bfloat16),
        "scale": np.array(0.5, np.float32),  # 0-d stays 0-d
    }
    save_params(params, tmp_path, progress=False)
    assert is_orbax_dir(tmp_path)
    assert_same_bits(load_params(tmp_path), params)


def test_names_that_are_prefixes_of_each_other(tmp_path):
    # If orbax nested keys on dots, "model.embed" and "model.embed.weight" would collide.
    params = {
        "model.embed": np.arange(3, dtype=np.float32),
        "model.embed.weight": np.arange(4, dtype=np.int32),
        "model": np.ones(2, ml_dtypes.bfloat16),
        "d": np.zeros(1, np.float32),  # orbax's own data folder is called "d"
        "_METADATA": np.ones(1, np.float32),
    }
    save_params(params, tmp_path, progress=False)
    assert_same_bits(load_params(tmp_path), params)


def test_more_dtypes(tmp_path):
    rng = np.random.default_rng(1)
    params = {f"t.{np.dtype(d).name}": random_bits(rng, (3, 2), d)
              for d in (np.float16, np.float64, np.int8, np.int64, np.uint8, np.uint32,
                        ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)}
    params["t.bool"] = np.array([True, False, True])
    save_params(params, tmp_path, progress=False)
    assert_same_bits(load_params(tmp_path), params)


def test_jax_arrays_come_back_as_numpy(tmp_path):
    params = {"a.b": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3), "c.d": jnp.ones((2,), jnp.float32)}
    save_params(params, tmp_path, progress=False)
    assert_same_bits(load_params(tmp_path), {k: np.asarray(v) for k, v in params.items()})


def test_from_safetensors_views(tmp_path):
    # The conversion path: read-only mmap views go straight into save_params.
    src, dst = tmp_path / "hf", tmp_path / "out"
    src.mkdir()
    rng = np.random.default_rng(2)
    tensors = {"model.norm.weight": random_bits(rng, (8,), np.float32),
               "model.layers.0.mlp.up_proj.weight": random_bits(rng, (4, 8), np.float16)}
    safetensors.numpy.save_file(tensors, src / "model.safetensors")
    with SafetensorsCheckpoint(src) as ckpt:
        save_params({name: ckpt.get(name) for name in ckpt.names()}, dst, progress=False)
    assert_same_bits(load_params(dst), tensors)


def test_out_dir_may_hold_other_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "tokenizer.json").write_text("{}")
    save_params({"w": np.ones(2, np.float32)}, tmp_path, progress=False)
    assert (tmp_path / "params").is_dir()
    assert json.loads((tmp_path / "config.json").read_text()) == {"model_type": "llama"}
    # No leftovers from orbax's write-then-rename.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "params", "tokenizer.json"]


def test_out_dir_is_created(tmp_path):
    out = tmp_path / "a" / "b"
    save_params({"w": np.ones(2, np.float32)}, out, progress=False)
    assert is_orbax_dir(out)


def test_refuses_to_overwrite_params(tmp_path):
    save_params({"w": np.ones(2, np.float32)}, tmp_path, progress=False)
    with pytest.raises(CheckpointError, match="already exists") as e:
        save_params({"w": np.zeros(2, np.float32)}, tmp_path, progress=False)
    assert e.value.file == str(tmp_path.resolve() / "params")
    np.testing.assert_array_equal(load_params(tmp_path)["w"], np.ones(2, np.float32))


def test_zero_size_tensor_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="'model.empty'.*zero elements"):
        save_params({"w": np.ones(2, np.float32), "model.empty": np.zeros((0, 4), np.float32)},
                    tmp_path, progress=False)
    assert not is_orbax_dir(tmp_path)


def test_progress_bar(tmp_path, capsys):
    save_params({"w": np.ones(2, np.float32), "v": np.ones(3, np.float32)}, tmp_path, progress=True)
    assert "gathering params" in capsys.readouterr().err


def test_load_from_non_orbax_dir(tmp_path):
    assert not is_orbax_dir(tmp_path)
    with pytest.raises(CheckpointError, match="not an orbax params checkpoint") as e:
        load_params(tmp_path)
    assert e.value.file == str(tmp_path.resolve())

    # A safetensors directory is not one either.
    safetensors.numpy.save_file({"w": np.ones(2, np.float32)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="not an orbax params checkpoint"):
        load_params(tmp_path)
    with pytest.raises(CheckpointError):
        load_params(tmp_path / "missing")


def test_load_from_corrupt_orbax_dir(tmp_path):
    (tmp_path / "params").mkdir()
    (tmp_path / "params" / "_METADATA").write_text("not json")
    assert is_orbax_dir(tmp_path)  # looks like one from outside ...
    with pytest.raises(CheckpointError, match="cannot restore orbax params") as e:
        load_params(tmp_path)  # ... but reading it fails, and says which directory
    assert e.value.file == str(tmp_path.resolve())


def test_checkpoint_written_from_jax_arrays_loads_as_numpy(tmp_path):
    # Written by plain orbax from device arrays (metadata records jax.Array and a
    # sharding), not by save_params: load_params must still hand back host numpy.
    import orbax.checkpoint as ocp

    params = {"model.w": jnp.arange(4, dtype=jnp.bfloat16), "model.w.scale": jnp.ones((2, 2), jnp.float32)}
    checkpointer = ocp.PyTreeCheckpointer()
    checkpointer.save(tmp_path / "params", args=ocp.args.PyTreeSave(params))
    checkpointer.close()
    assert_same_bits(load_params(tmp_path), {k: np.asarray(v) for k, v in params.items()})
