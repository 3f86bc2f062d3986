"""Hidden-state drafters: EAGLE (v1 / v2), EAGLE3 and MTP (NEXTN), in their published formats.

Each is a `Drafter` (one decoder layer with its own paged KV cache) called with the step's
`ForwardBatch`, its caches, a hidden state and the merged target module, returning a
`DraftOutput`. `load_drafter` reads a checkpoint; `random_drafter` makes one for benchmarks.
"""

from jspec.models.drafters.base import DraftOutput, Drafter
from jspec.models.drafters.eagle import EagleDrafter
from jspec.models.drafters.eagle3 import Eagle3Drafter
from jspec.models.drafters.loader import DraftModel, load_drafter, random_drafter
from jspec.models.drafters.mtp import MTPDrafter

__all__ = ["DraftOutput", "Drafter", "EagleDrafter", "Eagle3Drafter", "MTPDrafter", "DraftModel", "load_drafter",
           "random_drafter"]
