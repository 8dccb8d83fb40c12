"""Runner adapters through ActionRunner.handle, with stand-in scontrol/kubectl on the commands' PATH."""

from __future__ import annotations

import dataclasses
import time

import orjson
import pytest

from faultlens import schema
from faultlens.config import Config, RunnerConfig
from faultlens.diagnosis.runner.adapter_slurm import (
    by_faultlens,
    expand_nodes,
    is_drained,
    is_isolated,
    parse_show,
    reason_text,
)
from faultlens.diagnosis.runner.adapters import make_adapter
from faultlens.diagnosis.runner.runner import ActionRunner
from faultlens.errors import ConfigError
from tests.runner_standins import env_with, keys_config, recorded, signed, write_standin


def _action(type_: str = "evict_nodes", *, nodes=("n001", "n002"), job: str = "12345", dry_run: bool = False,
            id_: str = "act-1", ts: float | None = None, **kw) -> schema.Action:
    return schema.Action(id=id_, incident_id="inc-7", job=job, ts=time.time() if ts is None else ts, type=type_,
                         nodes=list(nodes), confidence=0.97, dry_run=dry_run, reason="Xid 79: GPU fell off the bus",
                         suspects=[{"node": n, "score": 0.97, "reason": "Xid 79"} for n in nodes], **kw)


def _value(action: schema.Action) -> bytes:
    return orjson.dumps(signed(schema.cloudevent(action)))


def _runner(tmp_path, adapter: str, *, execute: bool = True, bindir=None, **runner_kw) -> ActionRunner:
    runner_kw.setdefault("state_path", str(tmp_path / "ledger.jsonl"))
    cfg = Config(runner=RunnerConfig(adapter=adapter, execute=execute, **runner_kw), keys=keys_config(tmp_path))
    return ActionRunner(cfg, env=env_with(bindir or tmp_path / "bin"))


@pytest.fixture
def record(tmp_path):
    rec = tmp_path / "calls.jsonl"
    for tool in ("scontrol", "kubectl", "diag-node"):
        write_standin(tmp_path / "bin", tool, rec)
    return rec


DRAIN = "Reason=faultlens inc-7: Xid 79: GPU fell off the bus"


def test_slurm_judges_a_command_by_what_slurm_reads_back_not_by_its_exit(tmp_path, record) -> None:
    """A stand-in scontrol exits 0 and says nothing: the drain is not confirmed, so the action failed.
    (The adapter against a real slurmctld: tests/test_runner_slurm.py.)"""
    out = _runner(tmp_path, "slurm").handle(_value(_action()))
    assert out.status.status == "failed" and "Slurm accepted it but the node reads" in out.status.detail
    assert recorded(record)[0] == ["scontrol", "show", "node", "-o"]  # the fleet cap reads Slurm's drained nodes
    assert ["scontrol", "update", "NodeName=n001", "State=DRAIN", DRAIN] in recorded(record)
    assert ["scontrol", "requeue", "12345"] not in recorded(record)


def test_slurm_output_is_read_as_slurm_writes_it() -> None:
    line = ("NodeName=node2 Arch=x86_64 CoresPerSocket=1 State=MIXED+DRAIN ThreadsPerCore=1 "
            "Reason=faultlens inc-7: Xid 79: GPU has fallen off the bus [root@2026-11-28T14:56:20] Comment=(null)")
    (fields,) = parse_show(line + "\n")
    assert fields["State"] == "MIXED+DRAIN" and is_drained(fields) and is_isolated(fields) and by_faultlens(fields)
    assert reason_text(fields) == "faultlens inc-7: Xid 79: GPU has fallen off the bus"
    person = parse_show("NodeName=n4 State=IDLE+DRAIN Reason=bad fan, ticket 4411 [alice@2026-11-28T15:00:00]")[0]
    assert is_drained(person) and not by_faultlens(person) and reason_text(person) == "bad fan, ticket 4411"
    assert not is_isolated({"State": "IDLE"}) and is_isolated({"State": "DOWN*"})
    assert expand_nodes("node[1,3-4],gpu07,rack[08-10]-ib") == ["node1", "node3", "node4", "gpu07", "rack08-ib",
                                                                   "rack09-ib", "rack10-ib"]
    assert expand_nodes("(null)") == [] and expand_nodes("") == []


def test_slurm_notify_runs_nothing_but_reports(tmp_path, record) -> None:
    out = _runner(tmp_path, "slurm").handle(_value(_action("notify", nodes=())))
    assert recorded(record) == [] and out.status.status == "done" and out.status.commands == []


def test_kubernetes_evict_cordons_and_taints(tmp_path, record) -> None:
    out = _runner(tmp_path, "kubernetes").handle(_value(_action()))
    taint = RunnerConfig().k8s_taint
    expected = [
        ["kubectl", "cordon", "--", "n001"],
        ["kubectl", "taint", "nodes", "--overwrite", "--", "n001", taint],
        ["kubectl", "cordon", "--", "n002"],
        ["kubectl", "taint", "nodes", "--overwrite", "--", "n002", taint],
    ]
    assert recorded(record) == expected and out.status.commands == expected and out.status.status == "done"


def test_kubernetes_run_diagnostics_uses_the_configured_taint(tmp_path, record) -> None:
    runner = _runner(tmp_path, "kubernetes", k8s_taint="example.com/gpu-check=pending:NoExecute")
    runner.handle(_value(_action("run_diagnostics", nodes=("gpu-node-7.cluster.local",))))
    assert recorded(record) == [
        ["kubectl", "cordon", "--", "gpu-node-7.cluster.local"],
        ["kubectl", "taint", "nodes", "--overwrite", "--", "gpu-node-7.cluster.local",
         "example.com/gpu-check=pending:NoExecute"],
    ]


@pytest.mark.parametrize("adapter", ["slurm", "kubernetes", "command", "dry-run"])
@pytest.mark.parametrize("bad", ["n1; rm -rf /", "$(reboot)", "-x", "n1 n2", "`id`", "n1\nn2", "../etc/passwd", "n1|cat"])
def test_node_names_that_are_not_host_names_are_refused(tmp_path, record, adapter, bad) -> None:
    runner = _runner(tmp_path, adapter, hook_command="diag-node {action}")
    out = runner.handle(_value(_action(nodes=("n001", bad))))
    assert out.status.status == "refused" and "not a valid host name" in out.status.detail
    assert recorded(record) == [] and out.status.commands == []


@pytest.mark.parametrize("adapter, type_", [("slurm", "rollback_code"), ("slurm", "adapt_parallelism"),
                                           ("kubernetes", "restart_job"), ("kubernetes", "rollback_code")])
def test_actions_an_adapter_cannot_do_are_refused(tmp_path, record, adapter, type_) -> None:
    plan = {"layers_per_stage": [8, 8], "microbatches_per_replica": [4, 4], "tp_changes": [], "options": [], "why": "x"}
    out = _runner(tmp_path, adapter).handle(_value(_action(type_, plan=plan if type_ == "adapt_parallelism" else None)))
    assert out.status.status == "refused" and "command adapter" in out.status.detail
    assert recorded(record) == []


def test_slurm_refuses_a_job_id_that_is_not_a_slurm_job(tmp_path, record) -> None:
    out = _runner(tmp_path, "slurm").handle(_value(_action(job="12345; scancel -u root")))
    assert out.status.status == "refused" and recorded(record) == []


def test_a_failing_command_stops_the_plan_and_reports_stderr(tmp_path) -> None:
    rec = tmp_path / "calls.jsonl"
    write_standin(tmp_path / "bin", "kubectl", rec, exit_code=1,
                  stderr='Error from server (NotFound): nodes "n001" not found\n')
    out = _runner(tmp_path, "kubernetes").handle(_value(_action()))
    assert out.status.status == "failed"
    assert "exited 1" in out.status.detail and 'nodes "n001" not found' in out.status.detail
    assert len(recorded(rec)) == 1 and out.status.commands == [recorded(rec)[0]]


def test_a_missing_executable_is_a_failure_not_a_crash(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    cfg = Config(runner=RunnerConfig(adapter="kubernetes", execute=True, state_path=str(tmp_path / "ledger.jsonl")),
                 keys=keys_config(tmp_path))
    out = ActionRunner(cfg, env={"PATH": str(tmp_path / "empty")}).handle(_value(_action()))
    assert out.status.status == "failed" and "executable not found: kubectl" in out.status.detail
    assert out.status.commands == [["kubectl", "cordon", "--", "n001"]]


def test_dry_run_actions_never_execute_even_with_execute(tmp_path, record) -> None:
    out = _runner(tmp_path, "slurm", execute=True).handle(_value(_action(dry_run=True)))
    assert out.status.status == "dry_run" and "action is dry_run" in out.status.detail
    assert recorded(record) == [] and out.status.commands == []


def test_without_execute_the_runner_only_says_what_it_would_run(tmp_path, record) -> None:
    out = _runner(tmp_path, "slurm", execute=False).handle(_value(_action(dry_run=False)))
    assert out.status.status == "dry_run" and "not started with --execute" in out.status.detail
    assert 'would run: scontrol update NodeName=n001 State=DRAIN "Reason=faultlens inc-7' in out.status.detail
    assert recorded(record) == []


def test_the_dry_run_adapter_executes_nothing(tmp_path, record) -> None:
    out = _runner(tmp_path, "dry-run", execute=True).handle(_value(_action()))
    assert out.status.status == "dry_run" and out.status.adapter == "dry-run"
    assert "would evict_nodes on n001, n002" in out.status.detail and recorded(record) == []


def test_the_same_action_id_runs_once(tmp_path, record) -> None:
    runner = _runner(tmp_path, "kubernetes")
    first = runner.handle(_value(_action()))
    again = runner.handle(_value(_action()))
    assert first.status.status == "done" and again.duplicate and again.status is None
    assert len(recorded(record)) == 4


def test_the_ledger_outlives_the_runner(tmp_path, record) -> None:
    ledger = tmp_path / "state" / "ledger.jsonl"
    _runner(tmp_path, "kubernetes", state_path=str(ledger)).handle(_value(_action()))
    out = _runner(tmp_path, "kubernetes", state_path=str(ledger)).handle(_value(_action()))
    assert out.duplicate and len(recorded(record)) == 4


def test_stale_actions_are_refused(tmp_path, record) -> None:
    out = _runner(tmp_path, "slurm", max_action_age_s=600).handle(_value(_action(ts=time.time() - 3600)))
    assert out.status.status == "refused" and "stale" in out.status.detail and recorded(record) == []


def test_the_command_hook_gets_the_action_json_on_stdin(tmp_path) -> None:
    rec, stdin = tmp_path / "calls.jsonl", tmp_path / "stdin.json"
    write_standin(tmp_path / "bin", "apply-plan", rec, stdin_to=stdin)
    plan = {"layers_per_stage": [10, 6, 8, 8], "microbatches_per_replica": [8, 8], "tp_changes": [],
            "options": [{"name": "shift-layers", "predicted_tokens_per_s": 41000.0}], "why": "stage 1 is 40% slower"}
    action = _action("adapt_parallelism", nodes=("n004",), plan=plan)
    out = _runner(tmp_path, "command", hook_command="apply-plan --job {job} --type {type} --id {action}").handle(
        _value(action))
    assert recorded(rec) == [["apply-plan", "--job", "12345", "--type", "adapt_parallelism", "--id", "act-1"]]
    got = orjson.loads(stdin.read_bytes())
    assert {k: v for k, v in got.items() if not k.startswith("faultlens")} == schema.cloudevent(action)
    assert got["faultlenskeyid"] == "test-key" and got["data"]["plan"]["layers_per_stage"] == [10, 6, 8, 8]
    assert out.status.status == "done"


def test_bad_messages_are_dead_lettered_and_invalid_actions_refused(tmp_path, record) -> None:
    runner = _runner(tmp_path, "slurm")
    out = runner.handle(b"{not json", offset=17)
    assert out.status is None and out.dead_letter.reason == "malformed_json" and out.dead_letter.offset == 17
    event = schema.cloudevent(_action(id_="act-bad"))
    event["data"]["type"] = "reboot_everything"
    out = runner.handle(orjson.dumps(signed(event)))  # signed: only diagnosis' own bad actions are reported
    assert out.dead_letter.reason == "schema_invalid" and "reboot_everything" in out.dead_letter.detail
    assert out.status.status == "refused" and out.status.action_id == "act-bad"
    assert recorded(record) == []


def test_bad_adapter_settings_fail_at_start() -> None:
    with pytest.raises(ConfigError, match="runner.adapter"):
        make_adapter(RunnerConfig(adapter="ansible"))
    with pytest.raises(ConfigError, match="runner.k8s_taint"):
        make_adapter(RunnerConfig(adapter="kubernetes", k8s_taint="faulty; kubectl delete nodes --all"))
    with pytest.raises(ConfigError, match="runner.hook_command"):
        make_adapter(RunnerConfig(adapter="command"))
    with pytest.raises(ConfigError, match="runner.diagnostics_command"):
        make_adapter(dataclasses.replace(RunnerConfig(adapter="slurm"), diagnostics_command="dcgmi 'unclosed"))
