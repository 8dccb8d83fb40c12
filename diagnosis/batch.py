"""Batch diagnosis: a job's records (read from a batch directory by the caller) through the engine.

diagnosis/ may not import collectors/, so the directory is read in
faultlens/commands/diagnose.py (collectors.batch.read_batch_dir) and handed
here as records; this is the same engine the online service runs, ticked on
the records' own time. Stacks found in the input are used directly (no
dump_stacks command is sent).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from faultlens.config import Config
from faultlens.diagnosis.engine import Detector, DiagnosisEngine, run_records
from faultlens.diagnosis.modes import BATCH
from faultlens.diagnosis.nodehealth import NodeHealth
from faultlens.schema import Action, Command, Incident, JobTopology, StackDump


def diagnose_records(job: JobTopology | dict[str, Any] | None, records: Iterable[Any], config: Config, *,
                     detectors: Sequence[Detector] = (), node_health: NodeHealth | None = None,
                     engine: DiagnosisEngine | None = None,
                     progress: Callable[[int], None] | None = None,
                     stacks: Iterable[StackDump] | None = None) -> tuple[list[Incident], list[Action]]:
    """Diagnose one job's time-ordered records; returns (final incidents, actions in order).

    The records must already be on the job's clock: collectors.batch anchors
    boot-relative and year-less log times per node and marks the estimated ones.
    ``progress(n)`` is called with the number of records fed so far. ``stacks``: the input's stack
    dumps, given apart; then ``records`` is consumed as it comes (a stream, never held whole).
    """
    engine = engine or DiagnosisEngine(config, detectors=detectors, node_health=node_health, mode=BATCH)
    if job is not None:
        engine.set_topology(job)
    if stacks is None:
        records = records if isinstance(records, list) else list(records)
        stacks = [r for r in records if isinstance(r, StackDump)]
    # Stacks in a batch directory are a snapshot of the hang, whenever it was taken: available from the start.
    engine.add_stacks(stacks)
    outputs = run_records(engine, (r for r in records if not isinstance(r, StackDump)), progress=progress)
    actions = [o for o in outputs if isinstance(o, Action)]
    return engine.incidents(), actions


def commands_of(outputs: Iterable[Any]) -> list[Command]:
    return [o for o in outputs if isinstance(o, Command)]
