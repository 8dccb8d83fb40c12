"""Red team: every attack of issue 24 against the real services, each counted.

Each attack is one function registered with ``@attack("name")``; it returns a dict of
counts whose keys name what went wrong (forged actions executed, injection effects,
forged log lines, crash loops, secrets in logs, evictions past a cap, ...). Every count
must be zero. Attacks run against real processes or the real classes on the embedded
broker (Tansu), never mocks.

    python benchmarks/redteam.py            # every attack
    python benchmarks/redteam.py --quick    # the same attacks, smaller volumes
    python benchmarks/redteam.py --smoke    # one small case per attack (seconds)
    python benchmarks/redteam.py --only forged_actions,injection

Last line: one JSON object, ``{"bench": "redteam", "<attack>.<count>": n, ..., "total": n}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


@dataclass(frozen=True)
class Scale:
    """How hard each attack pushes: ``smoke`` (seconds), ``quick``, full."""

    name: str
    factor: float  # 1.0 = full volumes

    def n(self, full: int, minimum: int = 1) -> int:
        return max(minimum, int(full * self.factor))


AttackFn = Callable[[Scale], dict[str, int]]
ATTACKS: dict[str, AttackFn] = {}


def attack(name: str) -> Callable[[AttackFn], AttackFn]:
    """Register an attack under ``name`` (its counts print as ``name.count``)."""

    def register(fn: AttackFn) -> AttackFn:
        ATTACKS[name] = fn
        return fn

    return register


# ---------------------------------------------------------------------------
# Signed actions, injection, forged log lines, secrets, the runner's ledger
# (issue 24 items 1, 2, 6, 7)
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# Caps that hold: per-job, fleet, breaker, runner's own limits (issue 24 item 3)
# ---------------------------------------------------------------------------

CAPS_T0 = 1_700_000_000.0
# The Xid 79 line of the recorded attack (the real-logs form tests/fleetgen.py uses).
CAPS_XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."
CAP_REASONS = ("confidence", "job_cap", "fleet_cap", "breaker", "storm", "guard_unavailable")


def _caps_job(name: str, nodes: int) -> tuple[Any, list[str]]:
    """A job of ``nodes`` 8-GPU machines: (its topology record, its node names)."""
    from faultlens.stream.schema import JobTopology
    from faultlens.stream.topology import Topology

    topo = Topology.packed(tp=8, pp=1, dp=nodes, gpus_per_node=8, job=name, node_fmt=f"{name}-n{{:02d}}")
    rec = JobTopology(ts=CAPS_T0 - 10, job=name, **{k: v for k, v in topo.to_job_dict().items() if k != "job"})
    return rec, topo.nodes


def _caps_xid(node: str, ts: float) -> Any:
    from faultlens.stream.schema import KernelEvent

    return KernelEvent(ts=ts, node=node, kind="xid", xid=79, gpu=3, raw=CAPS_XID79)


def _caps_engine(guard: Any, jobs: list[tuple[Any, list[str]]]) -> Any:
    from faultlens.config import Config
    from faultlens.diagnosis.engine import DiagnosisEngine

    engine = DiagnosisEngine(Config(guard=guard), batch=True)
    for rec, _ in jobs:
        engine.set_topology(rec)
    return engine


def _caps_run(engine: Any, records: list[Any]) -> tuple[list[Any], list[Any]]:
    """The real engine over time-ordered records, ended as batch diagnosis ends: (actions, incidents)."""
    from faultlens.diagnosis.engine import run_records
    from faultlens.stream.schema import Action

    out = run_records(engine, sorted(records, key=lambda r: r.ts))
    return [o for o in out if isinstance(o, Action)], engine.incidents()


def _past_cap(evictions: list[tuple[float, str]], cap: int) -> int:
    """The most distinct nodes evicted within any hour, beyond ``cap``."""
    worst = 0
    for start, _ in evictions:
        worst = max(worst, len({n for t, n in evictions if start <= t < start + 3600.0}))
    return max(0, worst - cap)


def _evictions(actions: list[Any], job: str | None = None) -> list[tuple[float, str]]:
    return [(a.ts, n) for a in actions if a.type == "evict_nodes" and (job is None or a.job == job) for n in a.nodes]


def _fleet_records(jobs: int = 30, xids: int = 80, minutes: float = 26.0) -> tuple[list[Any], list[Any]]:
    """The recorded fleet attack: ``xids`` Xid 79 on distinct machines of ``jobs`` 8-node jobs in ``minutes``."""
    fleet = [_caps_job(f"fleet{j:02d}", 8) for j in range(jobs)]
    nodes = [n for _, ns in fleet for n in ns]
    records = [_caps_xid(nodes[(k * 3) % len(nodes)], CAPS_T0 + k * minutes * 60.0 / xids) for k in range(xids)]
    return fleet, records


@attack("job_cap")
def attack_job_cap(scale: Scale) -> dict[str, int]:
    """Four Xid 79 one minute apart on each 4-node job: evictions past the job's cap (25% of 4 = 1 an hour)."""
    from faultlens.config import GuardConfig

    # the job cap alone: the fleet's cap and storm detector (which many jobs at once would trip) off
    guard = GuardConfig(max_evictions_fleet_per_hour=1_000_000, storm_nodes=1_000_000)
    jobs = [_caps_job(f"cap{j:03d}", 4) for j in range(scale.n(40))]
    engine = _caps_engine(guard, jobs)
    actions, _ = _caps_run(engine, [_caps_xid(n, CAPS_T0 + 60.0 * i + j) for j, (_, ns) in enumerate(jobs)
                                    for i, n in enumerate(ns)])
    allowed = min(guard.max_evictions_per_job_per_hour, max(1, int(guard.max_evicted_fraction * 4)))
    past = sum(_past_cap(_evictions(actions, rec.job), allowed) for rec, _ in jobs)
    return {"evictions_past_job_cap": past,
            "jobs_without_an_eviction": sum(1 for rec, _ in jobs if not _evictions(actions, rec.job))}


def _online_fleet(jobs: int, xids: int, cap: int, instances: int) -> tuple[int, int]:
    """The fleet attack through ``instances`` real online diagnosis services on the embedded broker:
    (evictions past the fleet cap, evictions the instances decided)."""
    import dataclasses

    from faultlens.config import BusConfig, Config, DiagnosisConfig, GuardConfig
    from faultlens.diagnosis.online import DiagnosisService
    from faultlens.stream import schema
    from faultlens.stream.broker import EmbeddedBroker
    from faultlens.stream.bus import Consumer, Producer, ensure_topics

    fleet, records = _fleet_records(jobs, xids, minutes=26.0 * xids / 80)
    with EmbeddedBroker() as broker:
        bus = BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix="redteam", linger_ms=5)
        config = Config(bus=bus, diagnosis=DiagnosisConfig(group_id="redteam-diag"),
                        guard=GuardConfig(max_evictions_fleet_per_hour=cap, storm_nodes=10_000))
        ensure_topics(bus)
        with Producer(bus) as producer:
            for rec, _ in fleet:
                producer.send(rec)
            for r in records:
                producer.send(r)
            producer.flush(10)
        services = [DiagnosisService(dataclasses.replace(config), from_beginning=True, tick_interval_s=0.2).start()
                    for _ in range(instances)]
        actions: dict[str, Any] = {}
        try:
            with Consumer(bus, ["actions"], group_id=None) as c:
                deadline, quiet = time.monotonic() + 120.0, time.monotonic()
                # every Xid gets an action (an eviction or the notify that says why not); then 3 s of quiet
                while time.monotonic() < deadline and (len(actions) < xids or time.monotonic() - quiet < 3.0):
                    for m in c.poll(200):
                        a = schema.decode("actions", m.value)
                        if a.id not in actions:
                            actions[a.id] = a
                            quiet = time.monotonic()
        finally:
            for s in services:
                s.stop(timeout_s=20)
    evictions = _evictions(list(actions.values()))
    return _past_cap(evictions, cap), len(evictions)


@attack("fleet_cap")
def attack_fleet_cap(scale: Scale) -> dict[str, int]:
    """80 Xid 79 across 30 jobs in 26 simulated minutes: evictions past the fleet cap, with the storm
    detector on (default) and off (the cap alone), in one engine and across two online instances."""
    from faultlens.config import GuardConfig

    counts: dict[str, int] = {}
    fleet, records = _fleet_records()
    for label, guard in (("", GuardConfig()), ("_storm_off", GuardConfig(storm_nodes=10_000))):
        engine = _caps_engine(guard, fleet)
        actions, _ = _caps_run(engine, records)
        counts[f"evictions_past_fleet_cap{label}"] = _past_cap(_evictions(actions), guard.max_evictions_fleet_per_hour)
        counts[f"breaker_not_open{label}"] = int(engine.guard_log.book.fleet_breaker is None)
    jobs, xids, cap = (6, 16, 4) if scale.name == "smoke" else (30, 80, 16)
    past, decided = _online_fleet(jobs, xids, cap, instances=2)
    counts["evictions_past_fleet_cap_two_instances"] = past
    counts["two_instances_evicted_nothing"] = int(decided == 0)
    return counts


@attack("breaker_reset")
def attack_breaker_reset(scale: Scale) -> dict[str, int]:
    """The breaker persists across a restart, holds for hours, and closes only by `faultlens guard reset`."""
    import contextlib
    import io
    import tempfile

    from faultlens.cli import main as faultlens
    from faultlens.config import GuardConfig

    counts = {"breaker_lost_on_restart": 0, "breaker_closed_without_a_person": 0, "reset_not_applied": 0,
              "reset_not_recorded": 0, "reset_without_reason_accepted": 0}
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/guard.jsonl"
        guard = GuardConfig(max_evictions_fleet_per_hour=2, storm_nodes=10_000, state_path=path)
        jobs = [_caps_job(f"brk{j}", 8) for j in range(4)]
        first = _caps_engine(guard, jobs)
        _caps_run(first, [_caps_xid(ns[0], CAPS_T0 + 60.0 * k) for k, (_, ns) in enumerate(jobs[:3])])
        restarted = _caps_engine(guard, jobs)
        if restarted.guard_log.book.fleet_breaker is None:
            counts["breaker_lost_on_restart"] = 1
        for hours in (2, 30):  # past the hour's window: the breaker is not a window
            actions, _ = _caps_run(restarted, [_caps_xid(jobs[3][1][hours % 8], CAPS_T0 + hours * 3600.0)])
            counts["breaker_closed_without_a_person"] += sum(a.type == "evict_nodes" for a in actions)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            if faultlens(["guard", "reset", "--fleet", "--state-path", path]) == 0:
                counts["reset_without_reason_accepted"] = 1
            faultlens(["guard", "reset", "--fleet", "--reason", "redteam: fabric checked", "--by", "redteam",
                       "--state-path", path])
        actions, _ = _caps_run(restarted, [_caps_xid(jobs[3][1][5], CAPS_T0 + 31 * 3600.0)])
        counts["reset_not_applied"] = int([a.type for a in actions] != ["evict_nodes"])
        resets = restarted.guard_log.book.resets
        counts["reset_not_recorded"] = int(not resets or resets[-1]["by"] != "redteam" or not resets[-1]["wall"])
    return counts


def _suppression_scenarios() -> list[tuple[Any, list[Any], list[Any]]]:
    """(engine, actions, incidents) of the job-cap, fleet and duplicate inputs."""
    from faultlens.config import GuardConfig

    out = []
    four = [_caps_job("sup4", 4)]
    engine = _caps_engine(GuardConfig(), four)
    out.append((engine, *_caps_run(engine, [_caps_xid(n, CAPS_T0 + 60.0 * i) for i, n in enumerate(four[0][1])])))
    fleet, records = _fleet_records()
    engine = _caps_engine(GuardConfig(storm_nodes=10_000), fleet)
    out.append((engine, *_caps_run(engine, records)))
    engine = _caps_engine(GuardConfig(), fleet)
    out.append((engine, *_caps_run(engine, records)))
    dup = [_caps_job("dup", 8)]
    node = dup[0][1][2]
    engine = _caps_engine(GuardConfig(), dup)  # the same machine again after its first incident closed
    out.append((engine, *_caps_run(engine, [_caps_xid(node, CAPS_T0), _caps_xid(node, CAPS_T0 + 600.0)])))
    return out


@attack("silent_suppressions")
def attack_silent_suppressions(scale: Scale) -> dict[str, int]:
    """Every refusal of the guard log and every duplicate must be on an incident (and counted)."""
    counts = {"refusals_without_trace": 0, "duplicates_without_trace": 0, "guarded_actions_without_trace": 0}
    for engine, actions, incidents in _suppression_scenarios():
        traced: dict[str, int] = {}
        for i in incidents:
            for reason, n in i.suppressed_counts.items():
                traced[reason] = traced.get(reason, 0) + n
        refused = engine.guard_log.book.counts["refused"]
        counts["refusals_without_trace"] += max(0, refused - sum(traced.get(r, 0) for r in CAP_REASONS))
        counts["duplicates_without_trace"] += max(0, engine.counts.get("suppressed_duplicate", 0)
                                                  - traced.get("duplicate", 0))
        by_id = {i.id: i for i in incidents}
        counts["guarded_actions_without_trace"] += sum(
            1 for a in actions if "[guard:" in a.reason and not by_id[a.incident_id].suppressed)
    return counts


@attack("refused_marked_mitigated")
def attack_refused_marked_mitigated(scale: Scale) -> dict[str, int]:
    """An incident whose remedy the guard refused (and that got no other remedy) must not read `mitigated`."""
    remedies = {"evict_nodes", "restart_job", "rollback_code", "run_diagnostics"}
    n = 0
    for engine, actions, _ in _suppression_scenarios():
        engine.tick(engine.now + 1e6, final=True)
        taken: dict[str, set[str]] = {}
        for a in actions:
            taken.setdefault(a.incident_id, set()).add(a.type)
        for i in engine.incidents():
            refused = any(r in CAP_REASONS for r in i.suppressed_counts)
            if refused and not (taken.get(i.id, set()) & remedies) and i.status == "mitigated":
                n += 1
    return {"refused_incidents_marked_mitigated": n}


def _hang_records(nodes: list[str], job: str) -> list[Any]:
    """A job whose steps stop at 300 s while its GPUs stay busy: a hang, and no stacks to pin it."""
    from faultlens.stream.schema import GpuSample, GpuState, StepTiming

    ranks = [(r, nodes[r // 8]) for r in range(8 * len(nodes))]
    recs: list[Any] = [StepTiming(ts=CAPS_T0 + s, job=job, rank=r, node=n, step=s, duration_s=1.0, loss=2.0)
                       for s in range(300) for r, n in ranks]
    recs += [GpuSample(ts=CAPS_T0 + t, node=n, gpus=[GpuState(index=i, sm_clock_mhz=1980) for i in range(8)])
             for t in range(0, 1500, 10) for n in nodes]
    return recs


@attack("empty_node_actions")
def attack_empty_node_actions(scale: Scale) -> dict[str, int]:
    """No evict_nodes or run_diagnostics may name no node: an unpinned hang (no stacks), and every
    action of the other cap attacks."""
    from faultlens.config import GuardConfig

    rec, nodes = _caps_job("hang", 4)
    engine = _caps_engine(GuardConfig(), [(rec, nodes)])
    actions, _ = _caps_run(engine, _hang_records(nodes, "hang"))
    for _, more, _ in _suppression_scenarios():
        actions += more
    empty = [a for a in actions if a.type in ("evict_nodes", "run_diagnostics") and not a.nodes]
    return {"node_targeted_actions_with_no_node": len(empty),
            "hang_without_action": int(not any(a.job == "hang" for a in actions))}


# ---------------------------------------------------------------------------
# Poison messages and checkpoints without pickle (issue 24 items 4, 5)
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# Safe text: reports and explorer (issue 24 item 8)
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller volumes")
    ap.add_argument("--smoke", action="store_true", help="one small case per attack (seconds)")
    ap.add_argument("--only", default="", help="comma-separated attack names")
    args = ap.parse_args(argv)
    scale = Scale("smoke", 0.01) if args.smoke else Scale("quick", 0.1) if args.quick else Scale("full", 1.0)
    names = [n for n in args.only.split(",") if n] or list(ATTACKS)
    unknown = [n for n in names if n not in ATTACKS]
    if unknown:
        ap.error(f"unknown attack(s): {', '.join(unknown)}; known: {', '.join(ATTACKS)}")
    figures: dict[str, Any] = {"bench": "redteam", "scale": scale.name}
    total = 0
    print(f"{'attack':<28} {'count':<40} {'value':>8}")
    for name in names:
        started = time.monotonic()
        try:
            counts = ATTACKS[name](scale)
        except Exception:  # an attack that breaks is itself a finding: count it, go on
            traceback.print_exc()
            counts = {"attack_failed": 1}
        for key, value in counts.items():
            print(f"{name:<28} {key:<40} {value:>8}")
            figures[f"{name}.{key}"] = value
            total += int(value)
        print(f"{name:<28} {'(seconds)':<40} {time.monotonic() - started:>8.1f}")
    figures["total"] = total
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
