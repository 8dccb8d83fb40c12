"""Symptoms that arrive a timeout later (issue 36, item 4): a watchdog line naming ``Timeout(ms)`` says
its collective had been stuck that long, so it is muted by the fault present when the stall began,
not only by one present when the line was printed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from faultlens.collectors.kernel import KernelParser
from faultlens.collectors.nccl import NcclParser
from faultlens.config import Config
from faultlens.diagnosis.engine import DiagnosisEngine
from faultlens.diagnosis.modes import BATCH
from faultlens.diagnosis.replay import run_records
from faultlens.schema import GpuSample, GpuState, StepTiming
from faultlens.stream.topology import Topology
from tests.fleetgen import topology_record

HERE = Path(__file__).parent / "fixtures" / "late_symptoms" / "xid94_default_timeout"
TOPO = Topology.packed(tp=8, pp=1, dp=4, gpus_per_node=8, job="jobA", node_fmt="n{:02d}")


def _job(t0: float, stop: float, end: float) -> list[Any]:
    """A 4-node job stepping every 2 s until ``stop``, its GPUs busy (a hung collective spins) until ``end``."""
    recs: list[Any] = []
    t = t0
    while t < end:
        recs += [GpuSample(ts=t + i * 1e-3, node=n, gpus=[GpuState(index=g, util=97.0, power_w=600.0,
                                                                    mem_used_mb=70000.0) for g in range(8)])
                 for i, n in enumerate(TOPO.nodes)]
        t += 5.0
    step, t = 0, t0 + 0.5
    while t < stop:
        recs += [StepTiming(ts=t, job="jobA", rank=r, node=TOPO.nodes[r // 8], step=step, duration_s=2.0)
                 for r in range(0, 32, 8)]
        step, t = step + 1, t + 2.0
    return recs


def _diagnose(shift_watchdog_s: float = 0.0) -> tuple[list[Any], DiagnosisEngine]:
    xid = list(KernelParser("n02", year=2023).parse(HERE.joinpath("kernel.log").read_text().splitlines()))
    lines = list(NcclParser("n00", job="jobA", year=2023).parse(HERE.joinpath("nccl.log").read_text().splitlines()))
    lines = [msgspec.structs.replace(e, ts=e.ts + shift_watchdog_s) for e in lines]
    fault = xid[0].ts
    recs = sorted([*_job(fault - 300, fault, lines[-1].ts + 400), *xid, *lines], key=lambda r: r.ts)
    engine = DiagnosisEngine(Config(), mode=BATCH)
    engine.set_topology(topology_record(TOPO, fault - 310))
    return run_records(engine, recs), engine


def test_a_watchdog_thirty_minutes_after_the_fault_is_that_faults_stall() -> None:
    outputs, engine = _diagnose()
    actions = [(o.type, o.nodes) for o in outputs if type(o).KIND == "actions"]
    assert actions == [("restart_job", ["n02"])]  # the Xid's restart; no second one for its own stall
    assert not [i for i in engine.incidents() if i.kind == "hang"]
    xid_incident = next(i for i in engine.book.incidents.values() if i.node == "n02")
    assert any(m.get("kind") == "hang" for m in xid_incident.muted)


def test_a_stall_that_began_after_the_faults_window_is_a_hang_of_its_own() -> None:
    # The same lines an hour later: the stall began 30 min after the Xid's restart window closed.
    outputs, engine = _diagnose(shift_watchdog_s=3600.0)
    hangs = [i for i in engine.incidents() if i.kind == "hang"]
    assert hangs and any(o.type in ("restart_job", "run_diagnostics") and o.incident_id == hangs[0].id
                         for o in outputs if type(o).KIND == "actions")
