"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention) kernels in Pallas.

Same arguments and results as the oracles in `reference.py`, plus `interpret=True` to run the Pallas
kernels on the CPU. `gated_delta_rule_decode` is the recurrent kernel for one token per request
(T == B); `gated_delta_rule` is the chunked prefill for ragged batches.

| function                  | kernel file                         |
| ------------------------- | ----------------------------------- |
| causal_conv1d             | conv.py                             |
| causal_conv1d_verify      | conv_verify.py                      |
| gated_delta_rule          | chunk.py (chunk_prepare, chunk_state) |
| gated_delta_rule_decode   | recurrent.py                        |
| gated_delta_rule_verify   | verify.py                           |
| commit                    | commit.py                           |

The measurements behind the kernels' choices: NOTES.md.
"""

from pallas_kernels.gdn.chunk import gated_delta_rule
from pallas_kernels.gdn.commit import commit
from pallas_kernels.gdn.conv import causal_conv1d
from pallas_kernels.gdn.conv_verify import causal_conv1d_verify
from pallas_kernels.gdn.recurrent import gated_delta_rule_decode
from pallas_kernels.gdn.verify import gated_delta_rule_verify

__all__ = [
    "causal_conv1d",
    "causal_conv1d_verify",
    "gated_delta_rule",
    "gated_delta_rule_decode",
    "gated_delta_rule_verify",
    "commit",
]
