"""Lazy, zero-copy reading of Hugging Face safetensors checkpoints, without torch.

A safetensors file is: an 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`,
then the tensor bytes, with offsets relative to the end of the header.

We parse that header ourselves and hand out numpy views into a read-only mmap of
the file, so a 16 GB checkpoint costs no copy and no torch: bf16 and fp8 come from
ml_dtypes. Headers are read only when a shard is first needed, so opening a
checkpoint of many shards that has an index costs one small JSON read.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import ml_dtypes
import numpy as np

from checkpoints.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype names -> numpy dtypes. Others (F4, F6_*, F8_E8M0, C64, ...)
# are refused when the tensor is touched, so one exotic tensor does not make the
# rest of its file unreadable.
DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "U8": np.dtype(np.uint8),
    "U16": np.dtype(np.uint16),
    "U32": np.dtype(np.uint32),
    "U64": np.dtype(np.uint64),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}


@dataclass(frozen=True)
class _Entry:
    """One header entry, as written; checked against the file only when used."""

    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


class _Shard:
    """One safetensors file: its header (parsed on first use) and its mmap (mapped on first get)."""

    def __init__(self, path: Path):
        self.path = path
        self._entries: dict[str, _Entry] | None = None
        self._size = 0
        self._mmap: mmap.mmap | None = None

    def entries(self, tensor: str | None = None) -> dict[str, _Entry]:
        # `tensor` is only for the error message: the access that needed this file.
        if self._entries is None:
            self._entries, self._size = _read_header(self.path, tensor)
        return self._entries

    @property
    def size(self) -> int:
        return self._size

    def buffer(self, tensor: str) -> mmap.mmap:
        if self._mmap is None:
            try:
                with open(self.path, "rb") as f:
                    # mmap keeps its own handle on the file, so ours can close now.
                    self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:
                raise CheckpointError(f"cannot map file: {e}", tensor=tensor, file=str(self.path)) from e
        return self._mmap

    def close(self) -> None:
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                # Arrays handed out still view the mapping; they keep it alive and
                # it is unmapped when the last of them goes. Closing it under them
                # would turn their memory into a segfault.
                pass
            self._mmap = None


def _read_header(path: Path, tensor: str | None) -> tuple[dict[str, _Entry], int]:
    def fail(message: str, cause: Exception | None = None) -> NoReturn:
        raise CheckpointError(message, tensor=tensor, file=str(path)) from cause

    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                fail(f"file is {size} bytes, too short for the 8-byte header length")
            header_len = int.from_bytes(prefix, "little")
            if 8 + header_len > size:
                fail(f"header length {header_len} runs past the end of the file ({size} bytes)")
            raw = f.read(header_len)
    except FileNotFoundError as e:
        fail("file does not exist", e)
    except OSError as e:
        fail(f"cannot read file: {e}", e)

    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        fail(f"header is not valid JSON: {e}", e)
    if not isinstance(header, dict):
        fail(f"header is a JSON {type(header).__name__}, not an object")

    data_start = 8 + header_len
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entry = _parse_entry(info, data_start)
        if entry is None:
            fail(f"malformed header entry {name!r}: {json.dumps(info)[:200]}")
        entries[name] = entry
    return entries, size


def _parse_entry(info, data_start: int) -> _Entry | None:
    """The entry, or None if it is not shaped like a safetensors header entry."""

    def is_int(x):
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    if not isinstance(info, dict):
        return None
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        return None
    if not isinstance(shape, list) or not all(is_int(d) for d in shape):
        return None
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(is_int(o) for o in offsets):
        return None
    begin, end = offsets
    if end < begin:
        return None
    return _Entry(dtype, tuple(shape), data_start + begin, data_start + end)


class SafetensorsCheckpoint:
    """The tensors of a HF checkpoint directory (one file, or shards with an index)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._shards: dict[str, _Shard] = {}  # file name -> shard
        # tensor name -> file name. From the index when there is one; otherwise
        # built from every file's header the first time a name is needed.
        self._file_of: dict[str, str] | None = None

        index = self.directory / INDEX_FILE
        if index.is_file():
            self._file_of = _read_index(index)
            files = sorted(set(self._file_of.values()))
        else:
            files = sorted(p.name for p in self.directory.glob("*.safetensors") if p.is_file())
            if not files:
                raise CheckpointError(
                    f"no {INDEX_FILE} and no *.safetensors file in directory", file=str(self.directory)
                )
        for name in files:
            self._shards[name] = _Shard(self.directory / name)

    # ---- names ---------------------------------------------------------------

    def _names(self, tensor: str | None = None) -> dict[str, str]:
        # `tensor`, as in _Shard.entries, only names the access in error messages.
        if self._file_of is None:
            file_of: dict[str, str] = {}
            for file_name, shard in self._shards.items():
                for name in shard.entries(tensor):
                    if name in file_of:
                        raise CheckpointError(
                            f"appears in both {file_of[name]!r} and {file_name!r} (and there is no "
                            f"{INDEX_FILE} to say which one holds it)",
                            tensor=name,
                            file=str(self.directory / file_name),
                        )
                    file_of[name] = file_name
            self._file_of = file_of
        return self._file_of

    def names(self) -> list[str]:
        return sorted(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self):
        return iter(self.names())

    def file_of(self, name: str) -> str:
        """The name of the file (relative to the directory) that holds `name`."""
        file_of = self._names(name)
        if name not in file_of:
            raise CheckpointError(f"not found in checkpoint {self.directory}", tensor=name)
        return file_of[name]

    # ---- one tensor ----------------------------------------------------------

    def _entry(self, name: str) -> tuple[_Shard, _Entry, np.dtype]:
        """The tensor's shard, entry and dtype, after checking the bytes it claims are there."""
        shard = self._shards[self.file_of(name)]
        path = str(shard.path)
        entries = shard.entries(name)
        if name not in entries:
            raise CheckpointError(f"{INDEX_FILE} puts it in this file, but the file has no such tensor",
                                  tensor=name, file=path)
        entry = entries[name]
        dtype = DTYPES.get(entry.dtype)
        if dtype is None:
            raise CheckpointError(f"unsupported dtype {entry.dtype!r}", tensor=name, file=path)
        if entry.end > shard.size:
            raise CheckpointError(
                f"data ends at byte {entry.end} but the file has only {shard.size} bytes (truncated?)",
                tensor=name,
                file=path,
            )
        need = math.prod(entry.shape) * dtype.itemsize
        if entry.end - entry.begin != need:
            raise CheckpointError(
                f"data_offsets span {entry.end - entry.begin} bytes but shape {list(entry.shape)} "
                f"of {entry.dtype} needs {need}",
                tensor=name,
                file=path,
            )
        return shard, entry, dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1].shape

    def dtype(self, name: str) -> np.dtype:
        return self._entry(name)[2]

    def nbytes(self, name: str) -> int:
        _, entry, _ = self._entry(name)
        return entry.end - entry.begin

    def get(self, name: str) -> np.ndarray:
        """A read-only view of the tensor's bytes in the mapped file (no copy).

        The view keeps the mapping alive on its own, so it stays valid after close().
        Copy it (np.array) if you need a writable array.
        """
        shard, entry, dtype = self._entry(name)
        buf = shard.buffer(name)
        count = math.prod(entry.shape)
        return np.frombuffer(buf, dtype=dtype, count=count, offset=entry.begin).reshape(entry.shape)

    def validate(self) -> None:
        """Check every tensor (file present, header sound, dtype known, bytes all there).

        Raises CheckpointError on the first bad tensor; reads headers, not data.
        """
        for name in self.names():
            self._entry(name)

    # ---- lifetime ------------------------------------------------------------

    def close(self) -> None:
        """Drop the mappings; a later access maps the file again."""
        for shard in self._shards.values():
            shard.close()

    def __enter__(self) -> "SafetensorsCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsCheckpoint({str(self.directory)!r}, files={len(self._shards)})"


def _read_index(index: Path) -> dict[str, str]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read index: {e}", file=str(index)) from e
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError("index has no 'weight_map' object", file=str(index))
    for name, file_name in weight_map.items():
        if not isinstance(file_name, str):
            raise CheckpointError(f"index maps it to {file_name!r}, not a file name", tensor=name, file=str(index))
    return dict(weight_map)
