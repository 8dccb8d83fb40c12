"""Kernel signatures without an incident kind of their own take the signature's action.

A recognised kernel family that no policy signal names (a local filesystem gone read-only,
an XFS shutdown, a kernel oops, an uncorrected machine check) opens one ``unclassified`` incident on its
node; route.unclassified is "signature": the incident does what the line's catalog entry
says (explain's per-line verdict), under the route's confidence floor and the guard rails
(min_confidence_evict, de-duplication, blast radius, dry-run). The lines are real ones from
datasets/conformance (each entry names its source).
"""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from faultlens.collectors.kernel import KernelParser
from faultlens.config import Config, GuardConfig
from faultlens.datasets import realworld
from faultlens.diagnosis.engine import DiagnosisEngine, run_records

NODES = ["gpu-a07", "gpu-a11", "gpu-b02", "gpu-b09"]
JOB = {"job": "llm-7b", "tp": 8, "pp": 1, "dp": 4, "cp": 1, "order": "tp-cp-dp-pp",
       "ranks": {str(r): {"node": NODES[r // 8], "gpu": r % 8} for r in range(32)}}
T0 = 1_732_000_000.0


def _entry(entry_id: str) -> dict:
    return next(e for e in realworld.load() if e["id"] == entry_id)


def _run(entry_id: str, node: str = "gpu-a11", config: Config | None = None, engine: DiagnosisEngine | None = None):
    engine = engine or DiagnosisEngine(config or Config(), batch=True)
    engine.set_topology(JOB)
    parsed = KernelParser(year=2024, node=node).parse(_entry(entry_id)["text"].split("\n"))
    records = [msgspec.structs.replace(r, ts=T0 + i) for i, r in enumerate(parsed)]
    outputs = run_records(engine, records)
    actions = [o for o in outputs if type(o).KIND == "actions"]
    incidents = [i for i in engine.incidents() if i.kind == "unclassified"]
    return incidents, actions


@pytest.mark.parametrize(("entry_id", "action"), [
    ("storage-001", "evict_nodes"),      # EXT4 remounted read-only (node-problem-detector's generator)
    ("storage-012", "evict_nodes"),      # XFS corruption, forced shutdown
    ("host-009", "run_diagnostics"),     # kernel oops (NULL pointer dereference)
    ("host-018", "run_diagnostics"),     # kernel oops, older wording, behind a syslog + dmesg prefix
    ("host-001", "evict_nodes"),         # uncorrected machine check (MCE)
])
def test_unclassified_takes_the_signatures_action(entry_id, action):
    incidents, actions = _run(entry_id)
    assert len(incidents) == 1 and incidents[0].suspects[0]["node"] == "gpu-a11"
    mine = [a for a in actions if a.incident_id == incidents[0].id]
    assert [(a.type, a.nodes) for a in mine] == [(action, ["gpu-a11"])]
    assert "signature kernel." in mine[0].reason and mine[0].dry_run


def test_a_notify_signature_stays_a_notification():
    incidents, actions = _run("storage-010")  # md RAID degraded: the catalog says notify
    assert len(incidents) == 1
    assert [a.type for a in actions if a.incident_id == incidents[0].id] == ["notify"]


def test_the_guards_confidence_floor_still_applies():
    strict = dataclasses.replace(Config(), guard=GuardConfig(min_confidence_evict=0.99))
    incidents, actions = _run("storage-001", config=strict)
    assert [a.type for a in actions if a.incident_id == incidents[0].id] == ["notify"]
    assert "min_confidence_evict" in actions[-1].reason


def test_the_blast_radius_caps_evictions_from_signatures_too():
    # 2 of the job's 4 nodes an hour (the share allows 2 too; at 25% it would be one, counted across decisions)
    capped = dataclasses.replace(Config(), guard=GuardConfig(max_evictions_per_job_per_hour=2, max_evicted_fraction=0.5))
    engine = DiagnosisEngine(capped, batch=True)
    actions = []
    for node in NODES:  # the same read-only remount on every node of the job
        actions += _run("storage-001", node=node, engine=engine)[1]
    assert [n for a in actions if a.type == "evict_nodes" for n in a.nodes] == NODES[:2]
    notified = [a for a in actions if a.type == "notify"]
    assert len(notified) == 2 and all("max_evictions_per_job_per_hour" in a.reason for a in notified)


def test_the_same_line_twice_is_one_action():
    engine = DiagnosisEngine(Config(), batch=True)
    first = _run("storage-012", engine=engine)[1]
    again = _run("storage-012", engine=engine)[1]
    assert [a.type for a in first if a.type == "evict_nodes"] == ["evict_nodes"]
    assert not [a for a in again if a.type == "evict_nodes"]


def test_online_the_signatures_action_goes_out_without_waiting_for_the_end():
    """Online (no final tick): the XFS shutdown's eviction is decided as the line arrives."""
    from faultlens.diagnosis.modes import ONLINE

    engine = DiagnosisEngine(Config(), mode=ONLINE)
    engine.set_topology(JOB)
    parsed = KernelParser(year=2024, node="gpu-b02").parse(_entry("storage-012")["text"].split("\n"))
    outputs = []
    for i, rec in enumerate(parsed):
        outputs += engine.observe(msgspec.structs.replace(rec, ts=T0 + i))
    outputs += engine.tick(T0 + 10)
    assert [(a.type, a.nodes) for a in outputs if type(a).KIND == "actions"][:1] == [("evict_nodes", ["gpu-b02"])]
