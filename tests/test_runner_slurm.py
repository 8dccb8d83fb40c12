"""The Slurm adapter on a real cluster: Debian's slurmctld, four slurmd and munged on localhost.

One cluster per module (conftest ``slurm_cluster``); each test leaves it as it found it
(jobs cancelled, nodes resumed, reservations gone). The actions are signed as diagnosis
signs them and go through ``ActionRunner.handle``, as they do off the bus.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import orjson
import pytest

from faultlens import schema
from faultlens.config import Config, RunnerConfig
from faultlens.datasets.slurm_local import LocalSlurm
from faultlens.diagnosis.nodehealth import NodeHealth
from faultlens.diagnosis.runner.adapter_slurm import SlurmAdapter, expand_nodes, parse_show
from faultlens.diagnosis.runner.runner import ActionRunner
from tests.runner_standins import keys_config, signed

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
LOOP = "while :; do sleep 1; done"
_ids = itertools.count(1)


@pytest.fixture
def cluster(slurm_cluster: LocalSlurm) -> Iterator[LocalSlurm]:
    """The module's cluster, put back after the test: jobs cancelled, reservations deleted, nodes resumed."""
    yield slurm_cluster
    c = slurm_cluster
    if not c.controller_answers():
        c.start_controller()
    c.run(["scancel", "-u", "root"], check=False)
    for res in parse_show(c.run(["scontrol", "show", "res", "-o"], check=False).stdout):
        c.run(["scontrol", "delete", f"ReservationName={res['ReservationName']}"], check=False)
    for node, state in c.node_states().items():
        if "drain" in state or "drng" in state:
            c.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], check=False)
    c.wait_nodes_idle(c.node_names, timeout_s=30)


def _action(type_: str, nodes: tuple[str, ...], job: str = "1", **kw) -> schema.Action:
    n = next(_ids)
    return schema.Action(id=f"act-{n}", incident_id=f"inc-{n}", job=job, ts=time.time(), type=type_, nodes=list(nodes),
                         confidence=0.97, dry_run=False, reason="Xid 79: GPU has fallen off the bus",
                         suspects=[{"node": x, "score": 0.97, "reason": "Xid 79"} for x in nodes], **kw)


def _value(action: schema.Action) -> bytes:
    return orjson.dumps(signed(schema.cloudevent(action)))


def _runner(tmp_path, cluster: LocalSlurm, *, health: NodeHealth | None = None, **kw) -> ActionRunner:
    cfg = Config(runner=RunnerConfig(adapter="slurm", execute=True, state_path=str(tmp_path / "ledger.jsonl"),
                                     command_timeout_s=30, **kw), keys=keys_config(tmp_path))
    return ActionRunner(cfg, adapter=SlurmAdapter(cfg.runner, node_health=health), env=cluster.env)


def _running(cluster: LocalSlurm, job: str, *, without: str = "", restarts: int = 0) -> dict[str, str]:
    return cluster.wait_job(job, lambda f: f.get("JobState") == "RUNNING" and int(f.get("Restarts", 0)) >= restarts
                            and without not in cluster_nodes(f.get("NodeList", "")), "running", timeout_s=40)


def cluster_nodes(expr: str) -> list[str]:
    return expand_nodes(expr)


def _node(cluster: LocalSlurm, node: str) -> dict[str, str]:
    return parse_show(cluster.run(["scontrol", "show", "node", "-o", node]).stdout)[0]


def test_the_cluster_starts_and_stops_leaving_nothing_running() -> None:
    with LocalSlurm(nodes=2) as c:
        assert c.node_states() == {"node1": "idle", "node2": "idle"}
        # srun steps on every node, each named as Slurm names it (what a per-node agent will use).
        names = c.run(["srun", "-N", "2", "--ntasks-per-node=1", "printenv", "SLURMD_NODENAME"]).stdout.split()
        assert sorted(names) == ["node1", "node2"]
        job = c.sbatch(["-N", "2", "--wrap", LOOP])
        c.wait_job(job, lambda f: f.get("JobState") == "RUNNING", "running")
        assert c.job_pids(), "the daemons and the job run with the cluster's SLURM_CONF"
    assert c.job_pids() == [] and not c.dir.exists()


def test_evict_drains_with_the_incident_and_the_job_runs_again_without_the_node(tmp_path, cluster) -> None:
    job = cluster.sbatch(["--requeue", "-N", "3", "--wrap", LOOP])
    first = _running(cluster, job)
    victim = cluster_nodes(first["NodeList"])[1]
    action = _action("evict_nodes", (victim,), job=job)
    out = _runner(tmp_path, cluster).handle(_value(action))
    assert out.status is not None and out.status.status == "done", out.status
    node = _node(cluster, victim)
    assert "DRAIN" in node["State"] and node["Reason"].startswith(f"faultlens {action.incident_id}: Xid 79")
    again = _running(cluster, job, without=victim, restarts=1)
    assert len(cluster_nodes(again["NodeList"])) == 3 and victim not in again["NodeList"]
    # What Slurm said before and after each command is on the status.
    seen = out.status.observed
    assert {"when": "before", "node": victim} | {k: seen[1][k] for k in ("State", "Reason")} == seen[1]
    assert seen[1]["State"] in ("MIXED", "ALLOCATED") and seen[1]["Reason"] == ""
    assert seen[2]["when"] == "after drain" and "DRAIN" in seen[2]["State"]
    before_requeue = next(o for o in seen if o.get("when") == "before requeue")
    after_requeue = next(o for o in seen if o.get("when") == "after requeue")
    assert before_requeue["JobState"] == "RUNNING" and before_requeue["Requeue"] == "1"
    assert after_requeue["Restarts"] == "1" and after_requeue["JobState"] != "RUNNING"
    assert ["scontrol", "requeue", job] in out.status.commands
    # A restarted runner (the same ledger) does not carry the action out again.
    again_out = _runner(tmp_path, cluster).handle(_value(action))
    assert again_out.duplicate and cluster.job(job)["Restarts"] == "1"


def test_a_job_the_fault_already_ended_is_requeued_without_the_node_and_a_completed_one_is_not(tmp_path,
                                                                                                  cluster) -> None:
    # A lost GPU kills the ranks in about a second: the job is FAILED before the eviction comes.
    died = cluster.sbatch(["--requeue", "-N", "3", "--wrap", "sleep 1; exit 1"])
    done = cluster.sbatch(["--requeue", "-N", "1", "-w", "node4", "--wrap", "true"])
    ended = cluster.wait_job(died, lambda f: f.get("JobState") == "FAILED", "failed", timeout_s=40)
    cluster.wait_job(done, lambda f: f.get("JobState") == "COMPLETED", "completed", timeout_s=40)
    victim = cluster_nodes(ended["NodeList"])[0]
    out = _runner(tmp_path, cluster).handle(_value(_action("evict_nodes", (victim,), job=died)))
    assert out.status.status == "done" and ["scontrol", "requeue", died] in out.status.commands, out.status
    again = cluster.wait_job(died, lambda f: int(f.get("Restarts", 0)) == 1 and f.get("NodeList") not in ("", "(null)")
                             and f.get("JobState") in ("RUNNING", "FAILED", "COMPLETING"), "started again", timeout_s=40)
    assert victim not in cluster_nodes(again["NodeList"])
    out = _runner(tmp_path, cluster).handle(_value(_action("evict_nodes", ("node4",), job=done)))
    assert out.status.status == "done" and "not requeued again: it is COMPLETED" in out.status.detail
    assert cluster.job(done)["Restarts"] == "0"


def test_an_action_cut_short_by_a_runner_crash_resumes_without_draining_or_requeueing_twice(tmp_path, cluster) -> None:
    job = cluster.sbatch(["--requeue", "-N", "2", "-w", "node[3-4]", "--wrap", LOOP])
    _running(cluster, job)
    action = _action("evict_nodes", ("node3",), job=job)
    # What a runner killed right after its drain leaves: the drain done in Slurm and marked in the ledger.
    cluster.run(["scontrol", "update", "NodeName=node3", "State=DRAIN", f"Reason=faultlens {action.incident_id}: x"])
    (tmp_path / "ledger.jsonl").write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in (
        {"action_id": action.id, "status": "started", "ts": 1.0},
        {"action_id": action.id, "executing": True, "nodes": ["node3"], "ts": time.time()},
        {"action_id": action.id, "step": "drain:node3", "ts": 2.0})))
    out = _runner(tmp_path, cluster).handle(_value(action))
    assert out.status.status == "done", out.status
    assert not any(c[1] == "update" and c[2].startswith("NodeName=") for c in out.status.commands)
    assert ["scontrol", "requeuehold", job] in out.status.commands  # it asked for node3 by name (-w)
    assert _node(cluster, "node3")["Reason"].startswith(f"faultlens {action.incident_id}: x")
    assert _runner(tmp_path, cluster).handle(_value(action)).duplicate
    assert cluster.job(job)["Restarts"] == "1"


def test_a_job_that_says_no_requeue_is_not_requeued_and_restart_job_keeps_the_nodes(tmp_path, cluster) -> None:
    stay = cluster.sbatch(["--no-requeue", "-N", "1", "-w", "node4", "--wrap", LOOP])
    moved = cluster.sbatch(["--requeue", "-N", "2", "-w", "node[1-2]", "--wrap", LOOP])
    _running(cluster, stay)
    _running(cluster, moved)
    out = _runner(tmp_path, cluster).handle(_value(_action("evict_nodes", ("node4",), job=stay)))
    assert out.status.status == "done" and "Requeue=0" in out.status.detail
    assert cluster.job(stay)["JobState"] == "RUNNING" and cluster.job(stay)["Restarts"] == "0"
    out = _runner(tmp_path, cluster).handle(_value(_action("restart_job", (), job=moved)))
    assert out.status.status == "done", out.status
    again = _running(cluster, moved, restarts=1)
    assert again["NodeList"] == "node[1-2]"


def test_diagnostics_passed_resume_the_node_and_are_remembered(tmp_path, cluster) -> None:
    cluster.run(["scontrol", "update", "NodeName=node3", "State=DRAIN", "Reason=faultlens inc-0: Xid 79"])
    health = NodeHealth(":memory:")
    health.record_eviction("node3", incident_id="inc-0", job="1", kind="evict_nodes")
    out = _runner(tmp_path, cluster, health=health).handle(_value(_action("run_diagnostics", ("node3",))))
    assert out.status.status == "done", out.status
    assert "diagnostics passed" in out.status.detail and "disk:" in out.status.detail
    assert cluster.node_states()["node3"] == "idle"
    assert cluster.run(["scontrol", "show", "res", "-o"]).stdout.strip() in ("", "No reservations in the system")
    assert [e["event"] for e in health.history("node3")] == ["evicted", "diagnostics_passed"]
    assert health.quarantined() == {}
    whens = [o["when"] for o in out.status.observed if o.get("node") == "node3"]
    assert whens == ["before", "after resume under the reservation", "after passed diagnostics"]


def test_failed_diagnostics_keep_the_node_drained_and_repeats_make_it_an_rma_candidate(tmp_path, cluster) -> None:
    health = NodeHealth(":memory:", rma_after=2)
    runner = _runner(tmp_path, cluster, health=health,
                     diagnostics_command="sh -c 'echo uncorrectable ECC error on GPU 3; exit 3'")
    first = runner.handle(_value(_action("run_diagnostics", ("node2",))))
    assert first.status.status == "failed" and "uncorrectable ECC error on GPU 3" in first.status.detail
    node = _node(cluster, "node2")
    assert "DRAIN" in node["State"] and "diagnostics failed" in node["Reason"]
    assert "RMA" not in first.status.detail and health.rma_candidates() == []
    second = runner.handle(_value(_action("run_diagnostics", ("node2",))))
    assert second.status.status == "failed" and "an RMA candidate" in second.status.detail
    assert health.rma_candidates() == ["node2"] and "DRAIN" in _node(cluster, "node2")["State"]


def test_a_node_a_person_drained_is_never_resumed_and_counts_against_the_fleet_cap(tmp_path, cluster) -> None:
    cluster.run(["scontrol", "update", "NodeName=node4", "State=DRAIN", "Reason=bad fan, ticket 4411 (alice)"])
    out = _runner(tmp_path, cluster).handle(_value(_action("run_diagnostics", ("node4",))))
    assert out.status.status == "refused" and "drained by a person" in out.status.detail
    assert "DRAIN" in _node(cluster, "node4")["State"]
    out = _runner(tmp_path / "b", cluster).handle(_value(_action("evict_nodes", ("node4",), job="999")))
    assert out.status.status == "failed" and "already drained by a person" in out.status.detail
    assert _node(cluster, "node4")["Reason"].startswith("bad fan, ticket 4411 (alice)")
    capped = _runner(tmp_path / "c", cluster, max_nodes_evicted_per_hour=1).handle(
        _value(_action("evict_nodes", ("node1",))))
    assert capped.status.status == "refused" and "1 drained in the scheduler" in capped.status.detail
    assert "DRAIN" not in _node(cluster, "node1")["State"]


def test_an_unknown_node_stays_pending_with_slurms_message(tmp_path, cluster) -> None:
    runner = _runner(tmp_path, cluster, pending_retry_s=0, pending_retries=3)
    action = _action("evict_nodes", ("node9",))
    out = runner.handle(_value(action))
    assert out.status.status == "pending" and "Node node9 not found" in out.status.detail
    assert "attempt 1 of 3" in out.status.detail
    assert not any(c[1] == "update" for c in out.status.commands)
    second = runner.retry_due()
    assert [o.status.status for o in second] == ["pending"] and "attempt 2 of 3" in second[0].status.detail
    last = runner.retry_due()
    assert last[0].status.status == "failed" and "gave up after 3 attempt(s)" in last[0].status.detail
    assert runner.retry_due() == []


def test_a_controller_that_is_down_leaves_the_action_pending_until_it_returns(tmp_path, cluster) -> None:
    cluster.stop_controller()
    action = _action("evict_nodes", ("node3",), job="4242")
    out = _runner(tmp_path, cluster, pending_retry_s=0).handle(_value(action))
    assert out.status.status == "pending"
    assert "Unable to contact slurm controller" in out.status.detail
    cluster.start_controller()
    # A new runner (the old one stopped) finds the pending action in its ledger and carries it out.
    runner = _runner(tmp_path, cluster, pending_retry_s=0)
    outcomes = runner.retry_due()
    assert len(outcomes) == 1 and outcomes[0].status is not None
    done = outcomes[0].status
    assert done.status == "failed" and "drained node3" in done.detail  # no job 4242 to requeue
    assert "Invalid job id specified" in done.detail
    assert "DRAIN" in _node(cluster, "node3")["State"]
    assert runner.handle(_value(action)).duplicate


@pytest.mark.broker
def test_off_the_bus_a_pending_action_is_retried_by_the_running_runner_until_slurm_takes_it(
        tmp_path, cluster, bus) -> None:
    from faultlens.stream.bus import Consumer, Producer, ensure_topics
    from tests.runner_standins import signing_keyring
    from tests.test_runner_broker import RunnerThread

    ensure_topics(bus, names=("actions", "action-status", "deadletter"))
    job = cluster.sbatch(["--requeue", "-N", "1", "-w", "node1", "--wrap", LOOP])
    _running(cluster, job)
    cfg = Config(bus=bus, runner=RunnerConfig(adapter="slurm", execute=True, state_path=str(tmp_path / "l.jsonl"),
                                              group_id=f"runner-{bus.topic_prefix}",
                                              pending_retry_s=0.5, pending_retries=50, command_timeout_s=30),
                 keys=keys_config(tmp_path))
    statuses = Consumer(bus, ["action-status"], group_id=None)
    seen: list[schema.ActionStatus] = []

    def wait_for(state: str) -> schema.ActionStatus:
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            seen.extend(schema.decode("action-status", m.value) for m in statuses.poll(200))
            if any(s.status == state for s in seen):
                return next(s for s in seen if s.status == state)
        raise AssertionError(f"no {state} status; got {[(s.status, s.detail[:80]) for s in seen]}")

    try:
        cluster.stop_controller()
        with RunnerThread(ActionRunner(cfg, env=cluster.env)), Producer(bus, keyring=signing_keyring()) as producer:
            producer.send(_action("evict_nodes", ("node1",), job=job))
            producer.flush()
            pending = wait_for("pending")
            assert "Unable to contact slurm controller" in pending.detail
            cluster.start_controller()
            done = wait_for("done")
        assert "drained node1" in done.detail and f"requeued {job}" in done.detail
        assert [s.status for s in seen if s.status not in ("pending",)] == ["done"]
    finally:
        statuses.close()
    assert cluster.job(job)["Restarts"] == "1" and "DRAIN" in _node(cluster, "node1")["State"]
