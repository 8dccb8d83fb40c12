"""benchmarks/redteam.py's attacks on signed actions, injection and the runner's own caps, at smoke
scale against a real `faultlens runner` on the embedded broker: every count is zero."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_forged_actions_agent_key_forgery_injection_and_the_runner_storm_count_zero() -> None:
    # agent_key_forges_action: whoever holds an agent's key file (the Ed25519 public half) cannot
    # get an evict_nodes executed by a real `faultlens runner --execute`, while diagnosis' one runs.
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "redteam.py"), "--smoke", "--only",
         "forged_actions,agent_key_forges_action,injection,runner_storm"],
        capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    counts = {k: v for k, v in figures.items() if "." in k}
    assert set(counts) >= {"forged_actions.forged_executed", "forged_actions.legit_not_executed",
                           "agent_key_forges_action.forged_executed", "agent_key_forges_action.public_key_signed",
                           "agent_key_forges_action.legit_not_executed",
                           "injection.files_touched", "runner_storm.executed_beyond_rate_cap",
                           "runner_storm.evicted_beyond_fleet_cap"}
    assert figures["total"] == 0, counts
