"""`startup_runs.warms_up`: which engines run each compiled step once at start-up. What the warm-up
does is tested on served engines: test_grammar.py (split parts), test_prefix_cache.py (a hybrid
target's cached pages and snapshots)."""

from __future__ import annotations

import pytest

from jspec.errors import ConfigError
from jspec.runtime.startup_runs import warms_up


def test_gpus_warm_up_by_default_and_the_variable_decides_elsewhere(monkeypatch):
    monkeypatch.delenv("JSPEC_WARM_UP", raising=False)
    assert warms_up("gpu") and not warms_up("cpu")
    monkeypatch.setenv("JSPEC_WARM_UP", "1")
    assert warms_up("cpu")
    monkeypatch.setenv("JSPEC_WARM_UP", "0")
    assert not warms_up("gpu")
    monkeypatch.setenv("JSPEC_WARM_UP", "yes")
    with pytest.raises(ConfigError, match="JSPEC_WARM_UP='yes'"):
        warms_up("gpu")
