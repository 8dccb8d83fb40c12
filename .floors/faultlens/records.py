"""Typed records of every faultlens topic: the import point for code outside stream/.

The records are declared once, in faultlens/schema.py (DESIGN.md: "schemas live in
one module of stream/"), as frozen msgspec Structs, and produced by the one
decoder, faultlens/decode.py (tolerant by field, strict by identity). This module
declares nothing of its own; it re-exports them so that diagnosis, models, the
explorer and the CLI say ``from faultlens.records import GpuSample`` without
reaching into the transport package, and it holds the one helper every
consumer of GPU samples needs: ``LastKnown``, which reads a null field as
"unchanged since the last sample".

Why here and not the reverse (declarations here, re-exported by schema.py):
the declarations, their wire encoding and their lake schema change together,
and schema.py derives the Arrow schema and the decoder's plans from the type
hints; keeping them in one module keeps one place to edit per field.
"""

from __future__ import annotations

from typing import Any

import msgspec

from faultlens.schema import (
    RECORDS,
    SCHEMA_VERSION,
    Action,
    ActionStatus,
    Command,
    DeadLetter,
    Finding,
    GpuSample,
    GpuState,
    Incident,
    JobTopology,
    KernelEvent,
    NcclEvent,
    Quarantine,
    StackDump,
    StepTiming,
    asdict,
    field_names,
    replace,
)

__all__ = [
    "RECORDS", "SCHEMA_VERSION", "Action", "ActionStatus", "Command", "DeadLetter", "Finding", "GpuSample",
    "GpuState", "Incident", "JobTopology", "KernelEvent", "LastKnown", "NcclEvent", "Quarantine", "StackDump",
    "StepTiming", "asdict", "field_names", "replace",
]  # fmt: skip

_GPU_FIELDS = field_names(GpuState)
_GPU_DEFAULTS = {f.name: f.default for f in msgspec.structs.fields(GpuState)}


class LastKnown:
    """Fills the null fields of GPU samples with the last known value of the same GPU.

    A field is null when the producer could not give it (nvidia-smi's ``N/A``,
    NaN) or the decoder could not read it. Diagnosis takes that as "unchanged":
    a cumulative counter that is unreadable for one sample must not look like a
    reset to 0 and then a rise, nor crash a comparison. A field never known yet
    takes its default. The lake keeps the null; only the in-memory copy handed
    to diagnosis is filled.
    """

    def __init__(self) -> None:
        self._last: dict[tuple[str, int], GpuState] = {}
        # node -> its newest sample taken columnar (faultlens.decode.GpuColumns, no null in it): its GPUs are
        # the last known ones, made GpuStates only when a later sample of the node is filled
        self._pending: dict[str, Any] = {}

    def note(self, columns: Any) -> None:
        """A columnar sample with no null was taken without GpuStates: its GPUs are now the last known."""
        self._pending[columns.node] = columns

    def fill(self, sample: Any) -> Any:
        """The sample with every null GPU field filled (the same object when none is null)."""
        if getattr(sample, "KIND", None) != "gpu":
            return sample
        node, last = sample.node, self._last
        if self._pending:
            taken = self._pending.pop(node, None)
            if taken is not None:
                for g in taken.record().gpus:
                    last[(node, g.index)] = g
        gpus = sample.gpus
        filled: list[GpuState] | None = None
        for i, g in enumerate(gpus):
            key = (node, g.index)
            values = msgspec.structs.astuple(g)
            if None in values:
                prev = last.get(key)
                g = replace(g, **{name: (getattr(prev, name) if prev is not None else _GPU_DEFAULTS[name])
                                  for name, v in zip(_GPU_FIELDS, values, strict=True) if v is None})
                if filled is None:
                    filled = list(gpus[:i])
            if filled is not None:
                filled.append(g)
            last[key] = g
        return sample if filled is None else replace(sample, gpus=filled)
