"""Batch diagnosis: a job's records (read from a batch directory by the caller) through the engine.

diagnosis/ may not import collectors/, so the directory is read in
faultlens/commands/diagnose.py (collectors.batch.read_batch_dir) and handed
here as records; this is the same engine the online service runs, ticked on
the records' own time. Stacks found in the input are used directly (no
dump_stacks command is sent).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from faultlens.config import Config
from faultlens.diagnosis.engine import Detector, DiagnosisEngine, run_records
from faultlens.diagnosis.nodehealth import NodeHealth
from faultlens.stream.schema import (
    Action,
    Command,
    GpuSample,
    Incident,
    JobTopology,
    KernelEvent,
    NcclEvent,
    StackDump,
    StepTiming,
)


def diagnose_records(job: JobTopology | dict[str, Any] | None, records: Iterable[Any], config: Config, *,
                     detectors: Sequence[Detector] = (), node_health: NodeHealth | None = None,
                     engine: DiagnosisEngine | None = None) -> tuple[list[Incident], list[Action]]:
    """Diagnose one job's time-ordered records; returns (final incidents, actions in order)."""
    engine = engine or DiagnosisEngine(config, detectors=detectors, node_health=node_health, batch=True)
    if job is not None:
        engine.set_topology(job)
    records, moved = retime_untrusted(list(records))
    engine.counts["retimed_records"] = moved
    # Stacks in a batch directory are a snapshot of the hang, whenever it was taken: available from the start.
    engine.add_stacks(r for r in records if isinstance(r, StackDump))
    outputs = run_records(engine, [r for r in records if not isinstance(r, StackDump)])
    actions = [o for o in outputs if isinstance(o, Action)]
    return engine.incidents(), actions


TRUSTED = (GpuSample, StepTiming)  # JSON lines with unix timestamps
YEAR_S = (365 * 86400.0, 366 * 86400.0)


def retime_untrusted(records: list[Any], *, slack_s: float = 86400.0) -> tuple[list[Any], int]:
    """Put log records whose parsed time cannot be right back on the job's clock.

    Kernel and NCCL text carries boot-relative (``dmesg``) or year-less
    (syslog) times, and launcher lines none at all. NVML samples and step
    timings carry unix times. Text records of one node and source more than
    ``slack_s`` outside their range are moved by a whole year when that lands
    inside; otherwise by one offset that puts the earliest at the start of the
    range, keeping their spacing (two link flaps a minute apart stay a minute
    apart). Records are re-sorted; the count moved is returned.
    """
    trusted = [r.ts for r in records if isinstance(r, TRUSTED)]
    if not trusted:
        return records, 0
    lo, hi = min(trusted), max(trusted)
    inside = lambda t: lo - slack_s <= t <= hi + slack_s  # noqa: E731
    strays: dict[tuple[str, str], list[float]] = {}
    for r in records:
        if isinstance(r, (KernelEvent, NcclEvent)) and not inside(r.ts):
            strays.setdefault((type(r).KIND, r.node), []).append(r.ts)
    if not strays:
        return records, 0
    shift: dict[tuple[str, str], float] = {}
    for key, times in strays.items():
        first = min(times)
        shift[key] = next((sign * y for y in YEAR_S for sign in (-1, 1) if inside(first + sign * y)), lo - first)
    out, moved = [], 0
    for r in records:
        if isinstance(r, (KernelEvent, NcclEvent)) and not inside(r.ts):
            r = dataclasses.replace(r, ts=min(r.ts + shift[(type(r).KIND, r.node)], hi))
            moved += 1
        out.append(r)
    out.sort(key=lambda r: getattr(r, "ts", 0.0))
    return out, moved


def commands_of(outputs: Iterable[Any]) -> list[Command]:
    return [o for o in outputs if isinstance(o, Command)]
