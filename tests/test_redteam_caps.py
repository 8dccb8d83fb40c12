"""benchmarks/redteam.py, section "Caps that hold", at smoke scale: every count is zero.

The attacks run the real engine (and, for the fleet cap across instances, two online diagnosis
services on an embedded broker of their own) on the recorded inputs of issue 24."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REDTEAM = Path(__file__).resolve().parent.parent / "benchmarks" / "redteam.py"
CAPS = ("job_cap", "fleet_cap", "breaker_reset", "silent_suppressions", "refused_marked_mitigated",
        "empty_node_actions")


def _redteam():  # noqa: ANN202 - the benchmark module
    spec = importlib.util.spec_from_file_location("redteam_caps", REDTEAM)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("redteam_caps", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.broker
@pytest.mark.parametrize("name", CAPS)
def test_caps_attack_counts_zero(name: str) -> None:
    redteam = _redteam()
    counts = redteam.ATTACKS[name](redteam.Scale("smoke", 0.01))
    assert counts and all(v == 0 for v in counts.values()), counts
