"""Where the shipped tiny model family lives: `data/tiny` of the checkout.

The weights are data, not code, so they sit outside every importable package; `JSPEC_DATA_DIR`
points at another copy of the data folder (an installed jspec has no checkout beside it).
"""

from __future__ import annotations

import os

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def data_dir() -> str:
    """The data folder: $JSPEC_DATA_DIR, else `data/` of the checkout this package runs from."""
    return os.environ.get("JSPEC_DATA_DIR") or os.path.join(REPO_DIR, "data")


def tiny_dir(name: str | None = None) -> str:
    """The tiny family's folder, or one model in it (`tiny_dir("qwen3-eagle3")`)."""
    root = os.path.join(data_dir(), "tiny")
    return root if name is None else os.path.join(root, name)
