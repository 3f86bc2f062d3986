"""Drafters: EAGLE (v1 / v2), EAGLE3, MTP (NEXTN) and DFlash, in their published formats.

Each is a `Drafter` (decoder layers with their own paged KV cache) called with the step's
`ForwardBatch`, its caches, a hidden state and the merged target module, returning a
`DraftOutput`. `load_drafter` reads a checkpoint and `random_drafter` makes one for benchmarks,
both as a `DraftModel`; `drafter_config` and `dflash_block_size` read what the engine must know
before loading (the drafter's KV shape, DFlash's block size) from config.json alone.

Modules: base (the interface), eagle / eagle3 / mtp / dflash (the modules), reader (the shared
checkpoint reading), eagle_load / mtp_load / dflash_load (one per format), loader (the dispatch).
"""

from jspec.models.drafters.base import DraftOutput, Drafter
from jspec.models.drafters.dflash import DFlashDrafter
from jspec.models.drafters.dflash_load import dflash_block_size, default_target_layer_ids
from jspec.models.drafters.eagle import EagleDrafter
from jspec.models.drafters.eagle3 import Eagle3Drafter
from jspec.models.drafters.eagle_load import EAGLE3_ARCHITECTURES, eagle3_capture_layers
from jspec.models.drafters.loader import checkpoint_format, drafter_config, load_drafter, random_drafter
from jspec.models.drafters.mtp import MTPDrafter
from jspec.models.drafters.reader import DraftModel

__all__ = ["DraftOutput", "Drafter", "EagleDrafter", "Eagle3Drafter", "MTPDrafter", "DFlashDrafter", "DraftModel",
           "load_drafter", "random_drafter", "checkpoint_format", "drafter_config", "dflash_block_size",
           "eagle3_capture_layers", "EAGLE3_ARCHITECTURES", "default_target_layer_ids"]
