"""benchmarks/redteam.py's poison and checkpoint attacks (issue 24 items 4, 5) at smoke scale: every count 0.

Each attack starts its own embedded broker and runs the real commands as processes
(`faultlens diagnose`, `stream`, `runner`, `report`), so this is a slow test (~1 min).
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.broker, pytest.mark.slow]
POISON_ATTACKS = ("poison_changelog", "forged_changelog_marker", "poison_timestamps", "poison_tombstones", "pickle_checkpoint", "quoted_lake_path")


def _redteam():
    spec = importlib.util.spec_from_file_location("redteam", REPO / "benchmarks" / "redteam.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("redteam", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", POISON_ATTACKS)
def test_poison_attack_counts_nothing(name: str) -> None:
    redteam = _redteam()
    counts = redteam.ATTACKS[name](redteam.Scale("smoke", 0.01))
    assert counts and all(v == 0 for v in counts.values()), counts
