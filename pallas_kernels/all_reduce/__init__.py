"""All-reduce over NVLink peer memory (Mosaic GPU): a probe beside XLA's NCCL all-reduce.

`one_shot_all_reduce` sums a buffer over a mesh axis by reading every peer's copy directly
(kernel.py). The models do not use it: XLA's `psum` is faster end to end on the machines measured,
for the reasons NOTES.md gives. `bench/allreduce.py --impl psum,oneshot` times both.
"""

from pallas_kernels.all_reduce.kernel import one_shot_all_reduce

__all__ = ["one_shot_all_reduce"]
