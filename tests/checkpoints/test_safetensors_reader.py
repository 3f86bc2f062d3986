"""SafetensorsCheckpoint against files written by the safetensors library (numpy and torch writers)."""

import json
import mmap
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

from checkpoints.errors import CheckpointError
from checkpoints.safetensors_reader import INDEX_FILE, SafetensorsCheckpoint

NUMPY_DTYPES = ["F16", "F32", "F64", "I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64", "BOOL"]
# numpy's safetensors writer cannot take ml_dtypes arrays; torch writes these.
TORCH_DTYPES = {
    "BF16": (torch.bfloat16, ml_dtypes.bfloat16),
    "F8_E4M3": (torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn),
    "F8_E5M2": (torch.float8_e5m2, ml_dtypes.float8_e5m2),
}
NP_OF = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
         "I32": np.int32, "I64": np.int64, "U8": np.uint8, "U16": np.uint16, "U32": np.uint32,
         "U64": np.uint64, "BOOL": np.bool_}


def bits(a: np.ndarray) -> np.ndarray:
    """The raw bytes of `a`, so NaNs and signed zeros compare exactly."""
    return np.ascontiguousarray(a).view(np.uint8)


def write_raw(path, header, data: bytes, header_len: int | None = None):
    """A safetensors file built by hand, for the malformed cases the library will not write."""
    text = json.dumps(header).encode()
    n = len(text) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + text + data)


def header_of(path) -> dict:
    """The JSON header of a safetensors file, read independently of the code under test."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n])


def numpy_tensors(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "model.embed_tokens.weight": rng.standard_normal((8, 4)).astype(np.float32),
        "model.layers.0.mlp.gate_proj.weight": rng.standard_normal((6, 4)).astype(np.float16),
        "model.layers.0.input_layernorm.weight": rng.standard_normal(4).astype(np.float32),
        "ids": rng.integers(-100, 100, size=(3, 5)).astype(np.int64),
    }


# ---- reading values --------------------------------------------------------------


def test_single_file_names_shapes_values(tmp_path):
    tensors = numpy_tensors()
    safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        assert ckpt.names() == sorted(tensors)
        assert len(ckpt) == len(tensors)
        assert "ids" in ckpt and "nope" not in ckpt
        assert list(ckpt) == sorted(tensors)
        for name, want in tensors.items():
            assert ckpt.shape(name) == want.shape
            assert ckpt.dtype(name) == want.dtype
            assert ckpt.nbytes(name) == want.nbytes
            assert ckpt.file_of(name) == "model.safetensors"
            np.testing.assert_array_equal(ckpt.get(name), want)
        ckpt.validate()


@pytest.mark.parametrize("code", NUMPY_DTYPES)
def test_numpy_dtypes_bitwise(tmp_path, code):
    rng = np.random.default_rng(1)
    dtype = np.dtype(NP_OF[code])
    # Random bytes reinterpreted, so every bit pattern (NaN payloads included) is exercised;
    # bool gets 0/1 only since other bytes are not valid bools.
    if code == "BOOL":
        want = rng.integers(0, 2, size=(3, 7)).astype(np.bool_)
    else:
        want = rng.integers(0, 256, size=3 * 7 * dtype.itemsize, dtype=np.uint8).view(dtype).reshape(3, 7)
    safetensors.numpy.save_file({"t": want}, tmp_path / "model.safetensors")
    ckpt = SafetensorsCheckpoint(tmp_path)
    got = ckpt.get("t")
    assert got.dtype == dtype and got.shape == (3, 7)
    np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("code", sorted(TORCH_DTYPES))
def test_torch_dtypes_bitwise(tmp_path, code):
    torch_dtype, np_dtype = TORCH_DTYPES[code]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    uint = {1: torch.uint8, 2: torch.int16}[itemsize]
    # Random bit patterns, written through torch so the file is exactly what HF checkpoints hold.
    raw = torch.randint(0, 256, (4 * 5 * itemsize,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    t = raw.view(torch_dtype).reshape(4, 5)
    safetensors.torch.save_file({"w": t, "scale": torch.ones(3, dtype=torch_dtype)}, tmp_path / "model.safetensors")
    ckpt = SafetensorsCheckpoint(tmp_path)
    got = ckpt.get("w")
    assert got.dtype == np.dtype(np_dtype) and got.shape == (4, 5)
    np.testing.assert_array_equal(bits(got), t.view(uint).numpy().view(np.uint8).reshape(4, -1))
    np.testing.assert_array_equal(ckpt.get("scale").astype(np.float32), np.ones(3, np.float32))


def test_bf16_values(tmp_path):
    t = torch.tensor([[1.0, -2.5, 3.140625], [0.0, -0.0, 65280.0]], dtype=torch.bfloat16)
    safetensors.torch.save_file({"w": t}, tmp_path / "model.safetensors")
    got = SafetensorsCheckpoint(tmp_path).get("w")
    np.testing.assert_array_equal(got.astype(np.float32), t.float().numpy())


def test_scalar_and_empty_tensors(tmp_path):
    tensors = {"s": np.array(2.5, np.float32), "empty": np.zeros((0, 4), np.float32)}
    safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors")
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert ckpt.get("s").shape == () and ckpt.get("s") == 2.5
    assert ckpt.get("empty").shape == (0, 4) and ckpt.nbytes("empty") == 0


def write_sharded(tmp_path):
    """Two shards plus an index, as transformers writes them."""
    a = {"model.embed_tokens.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
         "model.layers.0.q_proj.weight": np.full((2, 2), 7, np.int32)}
    b = {"model.layers.1.q_proj.weight": np.arange(4, dtype=np.float16), "lm_head.weight": np.eye(3)}
    safetensors.numpy.save_file(a, tmp_path / "model-00001-of-00002.safetensors")
    safetensors.numpy.save_file(b, tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {**{k: "model-00001-of-00002.safetensors" for k in a},
                  **{k: "model-00002-of-00002.safetensors" for k in b}}
    index = {"metadata": {"total_size": sum(v.nbytes for v in {**a, **b}.values())}, "weight_map": weight_map}
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    return {**a, **b}, weight_map


def test_sharded_with_index(tmp_path):
    tensors, weight_map = write_sharded(tmp_path)
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        assert ckpt.names() == sorted(tensors)
        for name, want in tensors.items():
            assert ckpt.file_of(name) == weight_map[name]
            assert ckpt.shape(name) == want.shape and ckpt.dtype(name) == want.dtype
            np.testing.assert_array_equal(ckpt.get(name), want)
        ckpt.validate()


def test_index_is_the_authority(tmp_path):
    # A stray tensor in a shard that the index does not list is not part of the checkpoint.
    safetensors.numpy.save_file({"a": np.ones(2, np.float32), "stray": np.ones(1, np.float32)},
                                tmp_path / "s1.safetensors")
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {"a": "s1.safetensors"}}))
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert ckpt.names() == ["a"] and "stray" not in ckpt


def test_several_files_without_index(tmp_path):
    safetensors.numpy.save_file({"a": np.ones(2, np.float32)}, tmp_path / "x.safetensors")
    safetensors.numpy.save_file({"b": np.zeros(3, np.int8)}, tmp_path / "y.safetensors")
    (tmp_path / "config.json").write_text("{}")
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert ckpt.names() == ["a", "b"]
    assert ckpt.file_of("b") == "y.safetensors"
    np.testing.assert_array_equal(ckpt.get("b"), np.zeros(3, np.int8))


# ---- zero copy and laziness ----------------------------------------------------------


def test_get_is_a_read_only_view_of_the_mapping(tmp_path):
    safetensors.numpy.save_file(numpy_tensors(), tmp_path / "model.safetensors")
    ckpt = SafetensorsCheckpoint(tmp_path)
    a = ckpt.get("model.embed_tokens.weight")
    assert not a.flags.owndata and not a.flags.writeable
    # Follow the chain of bases down to the buffer: it is the file's mmap, not a copy.
    base = a
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)
    # The same file is mapped once: two gets of the same tensor view the same bytes.
    assert np.shares_memory(a, ckpt.get("model.embed_tokens.weight"))
    with pytest.raises(ValueError):
        a[0, 0] = 1.0


def test_views_outlive_close(tmp_path):
    tensors = numpy_tensors()
    safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors")
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        a = ckpt.get("ids")
    # close() must not unmap memory that `a` still points into.
    np.testing.assert_array_equal(a, tensors["ids"])
    # And the checkpoint maps the file again if used after close().
    np.testing.assert_array_equal(ckpt.get("ids"), tensors["ids"])


def test_headers_are_read_lazily(tmp_path):
    # Shard 2 is garbage: names, membership, file_of and every tensor of shard 1 must
    # still work, because none of them needs shard 2's header.
    tensors, weight_map = write_sharded(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"\xff" * 64)
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert ckpt.names() == sorted(tensors)
    assert "lm_head.weight" in ckpt and len(ckpt) == len(tensors)
    assert ckpt.file_of("lm_head.weight") == "model-00002-of-00002.safetensors"
    np.testing.assert_array_equal(ckpt.get("model.embed_tokens.weight"), tensors["model.embed_tokens.weight"])
    with pytest.raises(CheckpointError, match="lm_head.weight.*model-00002-of-00002"):
        ckpt.shape("lm_head.weight")


# ---- errors --------------------------------------------------------------------------


def test_missing_tensor(tmp_path):
    safetensors.numpy.save_file(numpy_tensors(), tmp_path / "model.safetensors")
    ckpt = SafetensorsCheckpoint(tmp_path)
    for call in (ckpt.get, ckpt.shape, ckpt.dtype, ckpt.nbytes, ckpt.file_of):
        with pytest.raises(CheckpointError, match="'model.norm.weight'.*not found in checkpoint") as e:
            call("model.norm.weight")
        assert e.value.tensor == "model.norm.weight" and str(tmp_path) in str(e.value)


def test_no_safetensors_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no .*safetensors") as e:
        SafetensorsCheckpoint(tmp_path)
    assert e.value.file == str(tmp_path)
    with pytest.raises(CheckpointError):
        SafetensorsCheckpoint(tmp_path / "does-not-exist")


def test_missing_shard(tmp_path):
    tensors, _ = write_sharded(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    ckpt = SafetensorsCheckpoint(tmp_path)
    np.testing.assert_array_equal(ckpt.get("model.embed_tokens.weight"), tensors["model.embed_tokens.weight"])
    with pytest.raises(CheckpointError, match="does not exist") as e:
        ckpt.get("lm_head.weight")
    assert e.value.tensor == "lm_head.weight"
    assert e.value.file.endswith("model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="model-00002-of-00002"):
        ckpt.validate()


def test_index_names_tensor_the_shard_lacks(tmp_path):
    safetensors.numpy.save_file({"a": np.ones(2, np.float32)}, tmp_path / "s1.safetensors")
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}}))
    with pytest.raises(CheckpointError, match="'b'.*s1.safetensors.*no such tensor"):
        SafetensorsCheckpoint(tmp_path).get("b")


def test_bad_index(tmp_path):
    (tmp_path / INDEX_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match=INDEX_FILE):
        SafetensorsCheckpoint(tmp_path)
    (tmp_path / INDEX_FILE).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="weight_map"):
        SafetensorsCheckpoint(tmp_path)


def test_garbage_header(tmp_path):
    path = tmp_path / "model.safetensors"
    body = b"this is not json at all!"
    path.write_bytes(struct.pack("<Q", len(body)) + body + b"\0" * 16)
    ckpt = SafetensorsCheckpoint(tmp_path)  # lazy: nothing read yet
    with pytest.raises(CheckpointError, match="not valid JSON") as e:
        ckpt.names()
    assert e.value.file == str(path)
    # An access for a tensor names that tensor too.
    with pytest.raises(CheckpointError, match="'w'.*model.safetensors.*not valid JSON"):
        ckpt.get("w")


def test_header_length_past_end_of_file(tmp_path):
    header = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    write_raw(tmp_path / "model.safetensors", header, b"\0" * 8, header_len=10**6)
    with pytest.raises(CheckpointError, match="header length 1000000 runs past the end") as e:
        SafetensorsCheckpoint(tmp_path).get("w")
    assert e.value.tensor == "w" and e.value.file.endswith("model.safetensors")


def test_file_too_short_for_header_length(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="too short"):
        SafetensorsCheckpoint(tmp_path).names()


@pytest.mark.parametrize("entry", [
    {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]},
    {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]},
    {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]},
    {"dtype": 5, "shape": [2], "data_offsets": [0, 8]},
    {"shape": [2], "data_offsets": [0, 8]},
    [1, 2, 3],
])
def test_malformed_header_entry(tmp_path, entry):
    write_raw(tmp_path / "model.safetensors", {"bad": entry, "ok": {"dtype": "U8", "shape": [1],
                                                                    "data_offsets": [8, 9]}}, b"\0" * 9)
    with pytest.raises(CheckpointError, match="malformed header entry 'bad'") as e:
        SafetensorsCheckpoint(tmp_path).names()
    assert e.value.file.endswith("model.safetensors")


def test_header_not_an_object(tmp_path):
    write_raw(tmp_path / "model.safetensors", [1, 2], b"")
    with pytest.raises(CheckpointError, match="not an object"):
        SafetensorsCheckpoint(tmp_path).names()


def test_unknown_dtype_only_fails_that_tensor(tmp_path):
    header = {"__metadata__": {"format": "pt"},
              "odd": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]},
              "fine": {"dtype": "I16", "shape": [2], "data_offsets": [1, 5]}}
    write_raw(tmp_path / "model.safetensors", header, b"\0\x01\0\x02\0")
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert ckpt.names() == ["fine", "odd"]  # __metadata__ is not a tensor
    # Little-endian int16 at an unaligned offset (1): numpy reads it without a copy.
    np.testing.assert_array_equal(ckpt.get("fine"), np.array([1, 2], np.int16))
    with pytest.raises(CheckpointError, match="'odd'.*unsupported dtype 'F4'"):
        ckpt.get("odd")
    with pytest.raises(CheckpointError, match="'odd'"):
        ckpt.validate()


def test_truncated_file(tmp_path):
    tensors = {"a": np.arange(4, dtype=np.float32), "z": np.arange(64, dtype=np.float32)}
    path = tmp_path / "model.safetensors"
    safetensors.numpy.save_file(tensors, path)
    path.write_bytes(path.read_bytes()[:-10])  # cut into the last tensor's bytes
    ckpt = SafetensorsCheckpoint(tmp_path)
    header = header_of(path)
    last = max(tensors, key=lambda n: header[n]["data_offsets"][1])
    other = next(n for n in tensors if n != last)
    np.testing.assert_array_equal(ckpt.get(other), tensors[other])
    for call in (ckpt.get, ckpt.shape):
        with pytest.raises(CheckpointError, match="truncated") as e:
            call(last)
        assert e.value.tensor == last and e.value.file == str(path)
    with pytest.raises(CheckpointError, match=f"'{last}'"):
        ckpt.validate()


def test_offsets_disagree_with_shape(tmp_path):
    header = {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}}
    write_raw(tmp_path / "model.safetensors", header, b"\0" * 24)
    with pytest.raises(CheckpointError, match="span 20 bytes.*needs 24") as e:
        SafetensorsCheckpoint(tmp_path).get("w")
    assert e.value.tensor == "w" and e.value.file.endswith("model.safetensors")


def test_duplicate_name_across_files(tmp_path):
    safetensors.numpy.save_file({"w": np.ones(2, np.float32)}, tmp_path / "a.safetensors")
    safetensors.numpy.save_file({"w": np.zeros(2, np.float32), "v": np.ones(1)}, tmp_path / "b.safetensors")
    ckpt = SafetensorsCheckpoint(tmp_path)
    with pytest.raises(CheckpointError, match="'w'.*both 'a.safetensors' and 'b.safetensors'") as e:
        ckpt.names()
    assert e.value.tensor == "w"
