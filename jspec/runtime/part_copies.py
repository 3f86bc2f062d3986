"""Two loaded copies of one compiled part, launched in turn, so that each copy's captured graph
keeps its buffer addresses.

XLA records a compiled step's kernels into a CUDA graph per loaded executable and re-records it
before a launch whenever a buffer it uses sits at a new address. A pipelined constrained step's
target forward (`split_step.py`) is launched while the host walks the grammar, and its scratch
buffer lands at one of two addresses, alternating from one step to the next (with overlap two
steps' buffers are live at a time; the loop waiting for each of its launches, so that a step's
allocations come in one fixed order, changed nothing). One copy then re-records its whole
graph before nearly every launch (host time on the path to the device); two copies taken in turn
each see one of the two addresses and keep their graphs (bench/README.md, "Structured output").

The second copy is the part serialized and loaded again (`load_copy`): the same program, no
compile, its own graphs, as jspec's executable cache loads steps on a warm start.
"""

from __future__ import annotations

from jax.experimental import serialize_executable

from jspec.runtime import compile_options
from jspec.runtime.slim_part import SlimPart

ATTRIBUTES = {"draft": "first", "forward": "forward", "verify": "second"}  # SplitExecutable's names


def load_copy(part: SlimPart, devices) -> SlimPart:
    """A second loaded copy of a compiled slim part on devices (the part's own devices, in order).
    Not of a CPU executable that XLA's persistent cache served, which does not load again
    (`jspec.runtime.executable_cache.stores_served`)."""
    exe = serialize_executable.deserialize_and_load(*serialize_executable.serialize(part.compiled),
                                                    execution_devices=list(devices))
    return SlimPart(exe, part.plan)


def for_split(parts: list, bucket, devices) -> dict[str, SlimPart]:
    """The second copies a split step's compiled parts (`split_step.lower`'s order, the fused twin
    last) get on devices: {SplitExecutable attribute: copy} for the parts
    `compile_options.copied_parts` names."""
    names = compile_options.split_parts(bucket)
    chosen = compile_options.copied_parts(devices[0].platform, bucket)
    return {ATTRIBUTES[n]: load_copy(parts[i], devices) for i, n in enumerate(names) if n in chosen}


class Alternating:
    """Calls the copies of a part in turn, from the first; otherwise it reads as the first copy
    (`plan`, `args_info`). Called from one thread at a time (the launcher thread, or the loop
    before serving)."""

    def __init__(self, *copies: SlimPart):
        self.copies = copies
        self._next = 0

    def __call__(self, *args):
        part = self.copies[self._next]
        self._next = (self._next + 1) % len(self.copies)
        return part(*args)

    def __getattr__(self, name):
        return getattr(self.copies[0], name)
