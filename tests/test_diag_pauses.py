"""The job's own pauses are not hangs (issue 36, item 3): a framework's evaluation or checkpoint lines
(diagnosis/catalogs/pauses.toml) hold the hang call until the pause's max_s, and a silence whose steps
come back before it is decided resolves with no action: a pause that ends is never a restart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from faultlens.collectors.nccl import NcclParser
from faultlens.collectors.signatures import is_ordinary
from faultlens.config import Config
from faultlens.diagnosis.engine import DiagnosisEngine
from faultlens.diagnosis.modes import BATCH
from faultlens.diagnosis.pauses import load_pauses, pause_line
from faultlens.diagnosis.replay import run_records
from faultlens.schema import GpuSample, GpuState, NcclEvent, StepTiming
from faultlens.stream.topology import Topology
from tests.fleetgen import topology_record

LINES = [json.loads(x) for x in (Path(__file__).parent / "fixtures" / "pauses" / "lines.jsonl").read_text().splitlines()]
TOPO = Topology.packed(tp=8, pp=1, dp=4, gpus_per_node=8, job="jobA", node_fmt="n{:02d}")
T0 = 1_700_000_000.0
PAUSE_AT = T0 + 600.0


def test_every_pause_entry_matches_its_framework_lines_and_no_step_line() -> None:
    rules = tuple(load_pauses())
    for case in LINES:
        got = pause_line(case["line"], rules)
        assert (got.rule.name if got else None, got.ends if got else False) == (case["pause"], case["ends"]), case
    for rule in rules:
        assert {c["ends"] for c in LINES if c["pause"] == rule.name} == {False, True}, rule.name


def test_an_agent_ships_the_pause_lines_and_counts_step_lines() -> None:
    # kind framework_pause (collectors/catalogs/nccl.toml): not an ordinary line, so the agent ships it
    for case in LINES:
        recs = list(NcclParser("n", year=2024).parse([case["line"]]))
        assert [(r.kind, is_ordinary(r)) for r in recs] == ([("framework_pause", False)] if case["pause"] else
                                                             [("other", True)]), case["line"]


def _job(pause_s: float, lines: list[tuple[float, str]]) -> list[Any]:
    """A 4-node Megatron-like job stepping every 2 s, pausing ``pause_s`` at PAUSE_AT (GPUs busy, memory held)."""
    end = PAUSE_AT + pause_s + 600
    recs: list[Any] = []
    t = T0
    while t < end:
        recs += [GpuSample(ts=t + i * 1e-3, node=n, gpus=[GpuState(index=g, util=90.0, power_w=500.0,
                                                                    mem_used_mb=70000.0) for g in range(8)])
                 for i, n in enumerate(TOPO.nodes)]
        t += 5.0
    step, t = 0, T0 + 0.5
    while t < end:
        if PAUSE_AT <= t < PAUSE_AT + pause_s:
            t = PAUSE_AT + pause_s
            continue
        recs += [StepTiming(ts=t, job="jobA", rank=r, node=TOPO.nodes[r // 8], step=step, duration_s=2.0)
                 for r in range(0, 32, 8)]
        step, t = step + 1, t + 2.0
    recs += [NcclEvent(ts=PAUSE_AT + dt, node="n00", kind="other", job="jobA", rank=0, raw=raw) for dt, raw in lines]
    return sorted(recs, key=lambda r: r.ts)


def _actions(records: list[Any]) -> tuple[list[tuple[str, list[str]]], DiagnosisEngine]:
    engine = DiagnosisEngine(Config(), mode=BATCH)
    engine.set_topology(topology_record(TOPO, T0 - 10))
    return [(o.type, o.nodes) for o in run_records(engine, records) if type(o).KIND == "actions"], engine


def _line(name: str, ends: bool) -> str:
    return next(c["line"] for c in LINES if c["pause"] == name and c["ends"] is ends)


@pytest.mark.parametrize("pause", ["megatron_evaluation", "megatron_checkpoint", "deepspeed_checkpoint"])
def test_an_announced_evaluation_or_checkpoint_is_no_hang(pause: str) -> None:
    # 15 minutes of silence: past the job's hang threshold (60 s) and grace (180 s) many times over.
    actions, engine = _actions(_job(900.0, [(0.2, _line(pause, False)), (899.0, _line(pause, True))]))
    assert actions == []
    assert not [i for i in engine.incidents() if i.kind == "hang"]


def test_a_pause_that_ends_before_the_hang_is_decided_is_never_a_restart() -> None:
    # No framework line at all: the silence is called a hang at 60 s, the steps come back at 150 s,
    # before its 180 s grace is over: it resolves with no action.
    actions, engine = _actions(_job(150.0, []))
    assert actions == []
    hang = next(i for i in engine.incidents() if i.kind == "hang")
    assert hang.status == "resolved" and "resumed" in hang.summary


def test_an_announced_pause_that_outlasts_its_max_is_a_hang() -> None:
    # An evaluation announced, then 40 minutes without a step or its end line: past max_s (30 min).
    actions, _ = _actions(_job(2400.0, [(0.2, _line("megatron_evaluation", False))]))
    assert [t for t, _ in actions] in (["restart_job"], ["run_diagnostics"])
