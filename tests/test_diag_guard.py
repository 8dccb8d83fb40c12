"""Caps that hold (issue 24 item 3), each finding first reproduced with its recorded input.

Findings: a 4-node job lost 4/4 machines to four Xid 79 one minute apart; 80 Xid 79 across 30 jobs
in 26 minutes gave 80 evictions; the breaker survived a restart but nothing could reset it; a
suppressed duplicate left no trace; an incident whose only action was refused was `mitigated`; an
unpinned hang emitted run_diagnostics with `nodes: []`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from faultlens.cli import main
from faultlens.config import Config, GuardConfig
from faultlens.diagnosis.decision import Decision
from faultlens.diagnosis.engine import DiagnosisEngine, run_records
from faultlens.diagnosis.guard import job_level
from faultlens.diagnosis.guardlog import GuardBook, LocalGuardLog, new_event
from faultlens.schema import Action, Incident, JobTopology, KernelEvent
from faultlens.stream.topology import Topology

T0 = 1_700_000_000.0
# The Xid 79 line of the recorded attack (real-logs form, as in tests/fleetgen.py).
XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."


@dataclass(frozen=True)
class _Job:
    record: JobTopology
    nodes: list[str]


def _job(name: str, nodes: int) -> _Job:
    topo = Topology.packed(tp=8, pp=1, dp=nodes, gpus_per_node=8, job=name, node_fmt=f"{name}-n{{:02d}}")
    return _Job(JobTopology(ts=T0 - 10, job=name, **{k: v for k, v in topo.to_job_dict().items() if k != "job"}),
                topo.nodes)


def _xid(node: str, ts: float) -> KernelEvent:
    return KernelEvent(ts=ts, node=node, kind="xid", xid=79, gpu=3, raw=XID79)


def _engine(guard: GuardConfig | None = None, jobs: tuple[_Job, ...] | list[_Job] = (), **kw) -> DiagnosisEngine:
    engine = DiagnosisEngine(Config(guard=guard or GuardConfig()), batch=True, **kw)
    for j in jobs:
        engine.set_topology(j.record)
    return engine


def _run(engine: DiagnosisEngine, records: list) -> tuple[list[Action], dict[str, Incident]]:
    out = run_records(engine, sorted(records, key=lambda r: r.ts))
    incidents = {i.id: i for i in engine.incidents()}
    return [o for o in out if isinstance(o, Action)], incidents


def test_job_cap_holds_across_decisions() -> None:
    """Recorded: four Xid 79 one minute apart on a 4-node job took 4/4 machines (25% held per decision only)."""
    job = _job("j4", 4)
    engine = _engine(jobs=[job])
    actions, incidents = _run(engine, [_xid(n, T0 + 60 * i) for i, n in enumerate(job.nodes)])
    evicted = [a for a in actions if a.type == "evict_nodes"]
    assert [a.nodes for a in evicted] == [[job.nodes[0]]]  # max(1, 25% of 4) = 1 per hour, counted across decisions
    refused = [i for i in incidents.values() if i.suppressed_counts]
    assert len(refused) == 3
    assert refused[0].suppressed_counts == {"job_cap": 1} or any(i.suppressed_counts == {"job_cap": 1} for i in refused)
    assert sum(i.suppressed_counts.get("breaker", 0) for i in refused) == 2  # the job's breaker stays open
    assert "j4" in engine.guard_log.book.job_breakers


def test_refused_incident_stays_open_with_its_reason() -> None:
    """Recorded: an incident whose only action was refused was marked `mitigated`."""
    job = _job("j4", 4)
    engine = _engine(jobs=[job])
    _, incidents = _run(engine, [_xid(n, T0 + 60 * i) for i, n in enumerate(job.nodes[:2])])
    engine.tick(T0 + 10_000, final=True)
    by_node = {i.suspects[0]["node"]: engine.book.incidents[i.id] for i in incidents.values()}
    assert by_node[job.nodes[0]].status == "mitigated"
    second = by_node[job.nodes[1]]
    assert second.status == "open"
    assert "refused by the guard" in second.summary and "job cap" in second.summary


def test_fleet_cap_counts_every_job() -> None:
    """Recorded: 80 Xid 79 across 30 jobs in 26 minutes gave 80 evictions (no fleet cap)."""
    jobs = [_job(f"f{j:02d}", 8) for j in range(30)]
    nodes = [n for j in jobs for n in j.nodes]
    xids = [_xid(nodes[(k * 3) % len(nodes)], T0 + k * 26 * 60 / 80) for k in range(80)]
    # storm detection off: the fleet cap alone must hold
    engine = _engine(GuardConfig(max_evictions_fleet_per_hour=16, storm_nodes=10_000), jobs)
    actions, incidents = _run(engine, xids)
    evicted = {n for a in actions if a.type == "evict_nodes" for n in a.nodes}
    assert len(evicted) == 16
    book = engine.guard_log.book
    assert book.fleet_breaker is not None and "fleet cap" in book.fleet_breaker["reason"]
    counts: dict[str, int] = {}
    for i in incidents.values():
        for r, n in i.suppressed_counts.items():
            counts[r] = counts.get(r, 0) + n
    # every refusal is on its incident: one trip of the fleet cap, job caps, and the open breakers after
    assert counts["fleet_cap"] == 1 and sum(counts.values()) == 80 - 16
    # with the storm detector on (default), the same input is one fabric-level storm long before the cap
    engine = _engine(None, jobs)
    actions, _ = _run(engine, xids)
    evicted = {n for a in actions if a.type == "evict_nodes" for n in a.nodes}
    assert len(evicted) < GuardConfig().storm_nodes
    assert "storm" in engine.guard_log.book.fleet_breaker["reason"]


def test_breaker_survives_a_restart_and_only_a_person_resets_it(tmp_path, capsys) -> None:
    """Recorded: the breaker survived a restart but nothing could reset it."""
    path = tmp_path / "guard.jsonl"
    guard = GuardConfig(max_evictions_fleet_per_hour=2, storm_nodes=10_000, state_path=str(path))
    jobs = [_job(f"b{j}", 8) for j in range(3)]
    first = _engine(guard, jobs)
    actions, _ = _run(first, [_xid(j.nodes[0], T0 + 60 * k) for k, j in enumerate(jobs)])
    assert sum(a.type == "evict_nodes" for a in actions) == 2
    # a restart: a new engine on the same file refuses, hours later (a breaker is not a window)
    second = _engine(guard, jobs)
    actions, incidents = _run(second, [_xid(jobs[0].nodes[5], T0 + 5 * 3600)])
    assert [a.type for a in actions] == ["notify"]
    assert next(iter(incidents.values())).suppressed_counts == {"breaker": 1}
    assert main(["guard", "status", "--json", "--state-path", str(path)]) == 0
    status = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "fleet cap" in status["fleet_breaker"]["reason"]
    # no reason, no reset
    assert main(["guard", "reset", "--fleet", "--state-path", str(path)]) == 1
    assert main(["guard", "reset", "--fleet", "--reason", "leaf switch replaced", "--by", "oncall",
                 "--state-path", str(path)]) == 0
    # the running engine reads the reset from the file before its next claim; the eviction the breaker
    # refused is claimed again too, its incident being still open (issue 37.6)
    actions, _ = _run(second, [_xid(jobs[1].nodes[5], T0 + 5 * 3600 + 600)])
    assert sorted(tuple(a.nodes) for a in actions if a.type == "evict_nodes") == [(jobs[0].nodes[5],),
                                                                                  (jobs[1].nodes[5],)]
    reset = second.guard_log.book.resets[-1]
    assert (reset["scope"], reset["by"], reset["reason"]) == ("fleet", "oncall", "leaf switch replaced")


def test_a_job_reset_reopens_that_job_only(tmp_path) -> None:
    path = tmp_path / "guard.jsonl"
    log = LocalGuardLog(GuardConfig(), path)
    assert log.claim("a1", job="j", nodes=["x1"], ts=T0, job_nodes=4).granted
    refused = log.claim("a2", job="j", nodes=["x2"], ts=T0 + 60, job_nodes=4)
    assert (refused.granted, refused.reason) == (False, "job_cap")
    assert log.claim("a3", job="k", nodes=["y1"], ts=T0 + 70, job_nodes=4).granted  # another job is untouched
    log.reset("job", job="j", by="me", reason="x1 replaced")
    assert log.claim("a4", job="j", nodes=["x2"], ts=T0 + 120, job_nodes=4).granted
    # a replayed claim gets its first verdict back, and a restart folds the same file to the same state
    assert log.claim("a2", job="j", nodes=["x2"], ts=T0 + 60, job_nodes=4).reason == "job_cap"
    again = LocalGuardLog(GuardConfig(), path)
    assert again.book.status() == log.book.status()


def test_the_guard_log_file_stays_bounded_and_folds_the_same(tmp_path, monkeypatch) -> None:
    """Issue 37.1: 10 simulated days of claims; the file keeps the caps' look-back, the open breakers
    and the last resets, and a restart (or `faultlens guard status`) folds it to the same state."""
    monkeypatch.setattr(LocalGuardLog, "COMPACT_SLACK", 100)
    path = tmp_path / "guard.jsonl"
    caps = GuardConfig(max_evictions_per_job_per_hour=100, max_evicted_fraction=1.0, storm_nodes=1000)
    log = LocalGuardLog(caps, path)
    sizes = []
    for i in range(10 * 48):  # a claim every 30 minutes of event time, 10 days
        log.claim(f"c{i}", job=f"j{i % 7}", nodes=[f"n{i % 50:03d}"], ts=T0 + 1800.0 * i, job_nodes=64)
        if i == 5:
            log.reset("job", job="j3", by="me", reason="checked")
        if i % 48 == 47:
            sizes.append(path.stat().st_size)
    log.claim("trip", job="j9", nodes=[f"x{k}" for k in range(20)], ts=T0 + 1800.0 * 480, job_nodes=64)
    assert log.book.fleet_breaker is not None  # 20 more nodes in an hour: past the fleet cap
    for i in range(150):  # refused from now on, the breaker held by the file
        log.claim(f"late{i}", job="j1", nodes=["n001"], ts=T0 + 1800.0 * (481 + i), job_nodes=64)
    assert log.compactions > 3 and max(sizes) < 40_000, sizes  # ~100 lines of ~300 bytes at most, any day
    assert sum(1 for _ in path.open()) < 2 * 20 + 100
    again = LocalGuardLog(caps, path)
    assert again.book.fleet_breaker is not None and again.book.status()["evicted_last_hour"] == \
        log.book.status()["evicted_last_hour"]
    assert [r["job"] for r in again.book.resets] == ["j3"]
    again.reset("fleet", by="me", reason="fabric fixed")
    log.refresh()  # the other holder reads the reset written after the rewrite
    assert log.book.fleet_breaker is None


def test_a_suppressed_duplicate_leaves_a_trace() -> None:
    """Recorded: a suppressed duplicate left no trace on its incident."""
    job = _job("d", 8)
    seen: list[str] = []
    engine = _engine(jobs=[job], on_suppressed=seen.append)
    node = job.nodes[2]
    # the same machine's Xid 79 again after its first incident closed: a second incident, the same eviction
    actions, incidents = _run(engine, [_xid(node, T0), _xid(node, T0 + 600)])
    assert [a.type for a in actions] == ["evict_nodes"]
    dup = [i for i in incidents.values() if i.suppressed_counts]
    assert len(dup) == 1 and dup[0].suppressed_counts == {"duplicate": 1}
    entry = dup[0].suppressed[0]
    assert entry["reason"] == "duplicate" and entry["type"] == "evict_nodes" and entry["nodes"] == [node]
    assert seen == ["duplicate"] and engine.counts["suppressed_duplicate"] == 1


def test_the_suppression_list_is_bounded_and_the_counts_are_not() -> None:
    from faultlens.diagnosis.incidents import OpenIncident

    inc = OpenIncident("i", "j", "gpu_lost", "n", T0, T0, "cause")
    for k in range(50):
        inc.record_suppression("breaker", f"#{k}", ts=T0 + k, type_="evict_nodes", nodes=("n",), keep=5)
    assert inc.suppressed_counts == {"breaker": 50}
    assert [s["text"] for s in inc.suppressed] == ["#45", "#46", "#47", "#48", "#49"]
    assert OpenIncident.from_dict(inc.to_dict()).suppressed_counts == {"breaker": 50}


def test_no_node_targeted_action_names_no_node() -> None:
    """Recorded: an unpinned hang emitted run_diagnostics with nodes: [] (the runner refuses it)."""
    diag = job_level(Decision("run_diagnostics", (), "hang (no stacks were collected)", 0.5))
    assert (diag.type, diag.nodes, diag.plan["diagnostics_requested"]) == ("restart_job", (), True)
    evict = job_level(Decision("evict_nodes", (), "outliers in no group", 0.9))
    assert (evict.type, evict.nodes) == ("notify", ())
    kept = Decision("run_diagnostics", ("n1",), "x", 0.5)
    assert job_level(kept) is kept


def test_every_holder_of_the_log_folds_the_same_verdicts() -> None:
    """Two instances reading one log agree on every claim, whoever wrote it."""
    cfg = GuardConfig(max_evictions_fleet_per_hour=3, storm_nodes=10_000)
    events = [new_event("claim", claim=f"c{k}", job=f"j{k % 4}", nodes=[f"n{k}"], ts=T0 + k, job_nodes=8)
              for k in range(8)]
    events.insert(5, new_event("reset", scope="fleet", job="", by="p", reason="r"))
    a, b = GuardBook(cfg), GuardBook(cfg)
    for e in events:
        a.apply(e)
    for e in events + events:  # a re-read (duplicates by event id) changes nothing
        b.apply(e)
    assert a.verdicts == b.verdicts
    assert [a.verdicts[f"c{k}"].granted for k in range(8)] == [True, True, True, False, False, True, True, True]


def test_an_action_the_runner_refused_keeps_its_incident_open() -> None:
    """The runner's `refused` on action-status (a bad node name, an unsupported type) is no mitigation."""
    from faultlens.schema import ActionStatus

    job = _job("r", 8)
    engine = _engine(jobs=[job])
    actions, _ = _run(engine, [_xid(job.nodes[1], T0)])
    (evict,) = actions
    engine.tick(T0 + 10_000, final=True)
    assert engine.book.incidents[evict.incident_id].status == "mitigated"
    # the runner's answer comes later, stamped with the runner's own clock (which must not move event time)
    now = engine.now
    engine.observe(ActionStatus(ts=T0 + 9e6, action_id=evict.id, job="r", adapter="slurm", status="refused",
                                detail="node name 'r-n02;' is not a valid host name"))
    engine.observe(ActionStatus(ts=T0 + 9e6, action_id=evict.id, job="r", adapter="slurm", status="refused",
                                detail="again"))  # re-delivered: counted once
    assert engine.now == now
    engine.tick(T0 + 20_000, final=True)
    inc = engine.book.incidents[evict.incident_id]
    assert inc.status == "open" and "refused by the runner" in inc.summary
    assert inc.suppressed_counts == {"runner_refused": 1}
    # a status that is not a refusal changes nothing
    other = _engine(jobs=[job])
    actions, _ = _run(other, [_xid(job.nodes[1], T0)])
    other.observe(ActionStatus(ts=T0, action_id=actions[0].id, job="r", adapter="slurm", status="done"))
    other.tick(T0 + 10_000, final=True)
    assert other.book.incidents[actions[0].incident_id].status == "mitigated"


def test_after_a_reset_the_refused_eviction_is_retried_once_while_its_incident_is_open(tmp_path) -> None:
    """Issue 37.6: after `faultlens guard reset` the eviction the job cap refused was never retried."""
    path = tmp_path / "guard.jsonl"
    job = _job("r4", 4)
    engine = _engine(GuardConfig(state_path=str(path)), [job])
    actions, incidents = _run(engine, [_xid(job.nodes[0], T0), _xid(job.nodes[1], T0 + 60)])
    assert [a.type for a in actions] == ["evict_nodes", "notify"]  # the second: the job cap (1 an hour)
    refused = next(i for i in incidents.values() if i.suppressed_counts)
    assert not [o for o in engine.tick(T0 + 120) if isinstance(o, Action)]  # no reset: nothing retried
    # a person resets the job's breaker (another process: the file); the next tick claims again
    assert main(["guard", "reset", "--job", "r4", "--reason", "r4-n00 replaced", "--state-path", str(path)]) == 0
    out = [o for o in engine.tick(T0 + 180) if isinstance(o, Action)]
    assert [(a.type, a.nodes, a.incident_id) for a in out] == [("evict_nodes", [job.nodes[1]], refused.id)]
    assert "retried after a guard reset" in out[0].reason
    inc = engine.book.incidents[refused.id]
    assert inc.suppressed[-1]["retried"] is True and inc.state.refused is None
    assert not [o for o in engine.tick(T0 + 240) if isinstance(o, Action)]  # once
    # a refusal of the retry (the job cap again, as the reset forgot only the earlier grants) is not
    # retried before the next reset
    _run(engine, [_xid(job.nodes[2], T0 + 300)])
    third = next(i for i in engine.book.incidents.values() if i.suppressed_counts and i.id != refused.id)
    assert third.suppressed_counts == {"job_cap": 1}
    assert not [o for o in engine.tick(T0 + 400) if isinstance(o, Action)]


def test_online_an_eviction_on_stale_evidence_becomes_a_notify() -> None:
    """Issue 37.3: a pipeline minutes behind must not evict on what it saw then ([diagnosis] max_evidence_age_s)."""
    import time

    import msgspec

    from faultlens.config import DiagnosisConfig

    job = _job("s4", 8)
    assert DiagnosisConfig().max_evidence_age_s == 60.0
    cases = ((120.0, 60.0, True, "notify"), (2.0, 60.0, True, "evict_nodes"), (120.0, 0.0, True, "evict_nodes"),
             (120.0, 60.0, False, "evict_nodes"))  # not the live service's engine: replayed input is never stale
    for age_s, limit, live, expect in cases:
        engine = DiagnosisEngine(Config(diagnosis=DiagnosisConfig(max_evidence_age_s=limit)), wall_clock_dwell=live)
        engine.set_topology(msgspec.structs.replace(job.record, ts=time.time() - 600))
        now = time.time()
        out = [o for o in run_records(engine, [_xid(job.nodes[0], now - age_s)]) + engine.tick(now)
               if isinstance(o, Action)]
        assert [a.type for a in out] == [expect], (age_s, limit, out)
        inc = next(iter(engine.book.incidents.values()))
        assert (inc.suppressed_counts == {"stale": 1}) == (expect == "notify")
        # the live service's decisions carry their evidence's age, the engine's lag and the window judged by
        if live:
            assert out[0].evidence_age_s is not None and age_s - 1 < out[0].evidence_age_s < age_s + 30
            assert out[0].consumer_lag_s is not None and out[0].consumer_lag_s <= out[0].evidence_age_s + 1
            assert out[0].evidence_window_s == limit
        else:  # replayed input: nothing wall-clock dependent in the action
            assert (out[0].evidence_age_s, out[0].consumer_lag_s, out[0].evidence_window_s) == (None, None, 0.0)
        if expect == "notify":
            assert "stale: the newest evidence is 1" in out[0].reason
