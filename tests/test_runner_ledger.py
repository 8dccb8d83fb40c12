"""The runner's ledger across a crash: an action killed mid-plan resumes at the step in flight,
a finished one never runs again, and a torn last line (kill -9 mid-write) is not fatal."""

from __future__ import annotations

import time

import orjson
import pytest

from faultlens import schema
from faultlens.config import Config, RunnerConfig
from faultlens.diagnosis.runner.runner import ActionRunner, Execution, Ledger
from faultlens.errors import LakeError
from tests.runner_standins import env_with, keys_config, recorded, signed, write_standin

TAINT = "faultlens.io/faulty=true:NoSchedule"


def _value(id_: str = "act-9") -> bytes:
    a = schema.Action(id=id_, incident_id="inc-7", job="12345", ts=time.time(), type="evict_nodes",
                      nodes=["n001", "n002"], confidence=0.97, dry_run=False, reason="Xid 79",
                      suspects=[{"node": "n001", "score": 0.97, "reason": "Xid 79"}])
    return orjson.dumps(signed(schema.cloudevent(a)))


def _runner(tmp_path) -> ActionRunner:
    cfg = Config(runner=RunnerConfig(adapter="kubernetes", execute=True, state_path=str(tmp_path / "ledger.jsonl")),
                 keys=keys_config(tmp_path))
    return ActionRunner(cfg, env=env_with(tmp_path / "bin"))


def test_an_action_killed_mid_plan_resumes_at_the_step_in_flight(tmp_path) -> None:
    rec = tmp_path / "calls.jsonl"
    write_standin(tmp_path / "bin", "kubectl", rec)
    ledger = tmp_path / "ledger.jsonl"
    # What a runner killed while cordoning n002 leaves: started, steps 0-1 (cordon + taint n001) finished.
    ledger.write_bytes(orjson.dumps({"action_id": "act-9", "status": "started", "ts": 1.0}) + b"\n"
                       + orjson.dumps({"action_id": "act-9", "step": 0, "ts": 2.0}) + b"\n"
                       + orjson.dumps({"action_id": "act-9", "step": 1, "ts": 2.0}) + b"\n")
    out = _runner(tmp_path).handle(_value())
    assert recorded(rec) == [["kubectl", "cordon", "--", "n002"],
                             ["kubectl", "taint", "nodes", "--overwrite", "--", "n002", TAINT]]
    assert out.status is not None and out.status.status == "done" and "2 finished before a restart" in out.status.detail
    # Done now: delivered again (a commit lost to the kill), it is not run a third time.
    again = _runner(tmp_path).handle(_value())
    assert again.duplicate and len(recorded(rec)) == 2
    assert Ledger(str(ledger)).status("act-9") == "done"


def test_a_torn_last_ledger_line_is_ignored_but_a_torn_middle_is_an_error(tmp_path) -> None:
    path = tmp_path / "ledger.jsonl"
    path.write_bytes(orjson.dumps({"action_id": "a", "status": "done"}) + b"\n{\"action_id\": \"b\", \"sta")
    assert Ledger(str(path)).status("a") == "done" and Ledger(str(path)).status("b") is None
    path.write_bytes(b"{\"action_id\": \"b\", \"sta\n" + orjson.dumps({"action_id": "a", "status": "done"}) + b"\n")
    with pytest.raises(LakeError, match="line 1"):
        Ledger(str(path))


def test_the_ledger_forgets_what_no_redelivery_can_need_and_stays_bounded(tmp_path) -> None:
    """Issue 37.1: 10 simulated days of one action every 10 minutes; the file stays near an hour's entries,
    what is in flight or pending is never forgotten, and a reopened ledger reads the same."""
    now = [1_800_000_000.0]
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(str(path), keep_s=3600.0 + 120.0, clock=lambda: now[0])
    ledger.record("act-stuck", "started")  # in flight when the runner stopped: kept until it ends
    ledger.record_pending("act-wait", b'{"id": "act-wait"}', "slurmctld down")
    sizes = []
    for i in range(1440):
        now[0] += 600.0
        ledger.record_execution(Execution(now[0], f"act-{i}", ("n001",)))
        ledger.record(f"act-{i}", "done")
        if i % 144 == 143:
            sizes.append(path.stat().st_size)
    assert ledger.compactions > 0
    assert max(sizes) < 100_000, sizes  # an hour's entries plus Ledger.COMPACT_SLACK lines at most, whatever the days
    assert ledger._compacted_lines < 40  # what a compaction keeps: the last hour's ~7 actions and the two held
    assert "act-1439" in ledger and "act-1435" in ledger and "act-10" not in ledger
    assert ledger.in_doubt("act-stuck") and ledger.attempts("act-wait") == 1 and "act-wait" in ledger.retries
    ledger.compact()
    assert all(now[0] - e.ts <= 3600.0 for e in ledger.executions) and len(ledger.executions) >= 6
    again = Ledger(str(path), keep_s=3600.0 + 120.0, clock=lambda: now[0])
    assert again.status("act-1439") == "done" and again.status("act-1438") == "done"
    assert again.in_doubt("act-stuck") and again.attempts("act-wait") == 1
    assert len(again.executions) == len(ledger.executions)
