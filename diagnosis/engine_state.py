"""EngineState: everything an engine learns from its records, in one object, and its checkpoint parts.

The engine keeps its configuration, catalogs and workflows (built once, shared by every job's
engine) apart from this state (one per job): a new owner of a job builds the former itself
and takes the latter from the job's checkpoint (diagnosis.online.state). ``snapshot()``
writes the state as the checkpoint's ``engine`` parts, ``restore()`` reads them back (with the
checkpoint codec, diagnosis.online.codec, given by the caller).

The parts keep the names a checkpoint has always carried (``_jobs``, ``counters._gpus``...,
docs/schemas.md, "Diagnosis checkpoints"), so a checkpoint written by an earlier engine
restores into this one (tests/fixtures/checkpoints/).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import msgspec

from faultlens.diagnosis.guard import Guard
from faultlens.diagnosis.incidents import IncidentBook
from faultlens.diagnosis.jobwide import JobWideCorrelator
from faultlens.diagnosis.rules import CounterRules
from faultlens.diagnosis.stacks import StackAggregator
from faultlens.records import LastKnown

if TYPE_CHECKING:
    from faultlens.diagnosis.engine import JobState

# Checkpoint part -> EngineState field.
PARTS = {"book": "book", "detectors": "detectors", "guard": "guard", "aggregator": "aggregator", "_jobs": "jobs",
         "_node_job": "node_job", "_outputs": "outputs", "_evicted": "evicted", "_slow_remedy": "slow_remedy",
         "_node_gpus": "node_gpus", "_quarantined": "quarantined", "now": "now", "_final": "final",
         "counts": "counts", "_last_known": "last_known", "jobwide": "jobwide", "_classify_ctx": "classify_ctx"}
# Checkpoint part -> attribute of the counter rules: their per-GPU memory is state, their compiled rules are not.
COUNTER_PARTS = {"counters._gpus": "_gpus", "counters._present": "_present", "counters._runs": "_runs"}
GPU_MEMORY = "counters._gpus"  # written as plain rows (rules.CounterRules.memory_rows), not the generic form
# Parts a checkpoint written before they existed lacks: read as empty (counters._runs: no steady run).
OPTIONAL: dict[str, Callable[[], Any]] = {"counters._runs": dict}
ALL_PARTS = frozenset(PARTS) | frozenset(COUNTER_PARTS)


@dataclass(eq=False)
class EngineState:
    """One job's dynamic state (the engine's records, incidents, guard history, detectors' baselines)."""

    book: IncidentBook
    counters: CounterRules  # checkpointed: its per-GPU memory only (COUNTER_PARTS)
    guard: Guard
    jobwide: JobWideCorrelator
    detectors: list[Any]
    classify_ctx: Any  # the signature catalog's context (repeats, derived Xids); None: a caller-given classify
    aggregator: StackAggregator = field(default_factory=StackAggregator)
    jobs: dict[str, JobState] = field(default_factory=dict)
    node_job: dict[str, str] = field(default_factory=dict)  # node -> the job a topology puts it in
    outputs: list[Any] = field(default_factory=list)  # actions and commands decided, not yet drained
    evicted: dict[str, set[str]] = field(default_factory=dict)  # job -> machines this engine had evicted
    # job -> slow machine -> (the remedy it got, the incident): one decision per slow machine
    slow_remedy: dict[str, dict[str, tuple[str, str]]] = field(default_factory=dict)
    node_gpus: dict[str, set[int]] = field(default_factory=dict)  # node -> the GPU indexes its topology places
    quarantined: set[tuple[str, int]] = field(default_factory=set)  # (node, GPU index) entries already reported
    now: float = 0.0
    final: bool = False  # set by tick(final=True): decide now, nothing more will come
    counts: dict[str, int] = field(default_factory=lambda: {"records": 0, "signals": 0, "bad_records": 0,
                                                            "findings": 0})
    last_known: LastKnown = field(default_factory=LastKnown)  # a null GPU field (N/A) reads as unchanged

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def snapshot(self, encode: Callable[[Any, str], Any]) -> dict[str, Any]:
        """The checkpoint's ``engine`` parts, each written by ``encode(value, part name)`` (codec.encode).

        The book's reference to the node-health store (a static part) is cut while it is written."""
        prior, self.book.prior_blames = self.book.prior_blames, None
        try:
            parts = {name: encode(getattr(self, attr), name) for name, attr in PARTS.items()}
        finally:
            self.book.prior_blames = prior
        for name, attr in COUNTER_PARTS.items():
            if name == GPU_MEMORY:  # thousands of GPUs: plain rows, a steady node's reused
                parts[name] = {"$gpumem": self.counters.memory_rows()}
            else:
                parts[name] = encode(getattr(self.counters, attr), name)
        return parts

    def restore(self, parts: dict[str, Any], decode: Callable[[Any], Any], *, prior_blames: Any = None) -> None:
        """Put back what ``snapshot`` wrote, each part read by ``decode`` (codec.decode; the counter rules
        keep their compiled rules). ValueError when a part does not read or the parts are not a snapshot's;
        whatever ``decode`` raises (codec.CodecError) passes through."""
        if set(parts) | OPTIONAL.keys() != ALL_PARTS | OPTIONAL.keys():
            raise ValueError(f"checkpoint parts {sorted(parts)} are not {sorted(ALL_PARTS)}")
        decoded = {name: self._decode(name, part, decode) for name, part in parts.items()}
        for name, empty in OPTIONAL.items():
            decoded.setdefault(name, empty())
        for name, value in decoded.items():
            if name in COUNTER_PARTS:
                setattr(self.counters, COUNTER_PARTS[name], value)
            else:
                setattr(self, PARTS[name], value)
        self.book.prior_blames = prior_blames

    def _decode(self, name: str, part: Any, decode: Callable[[Any], Any]) -> Any:
        if name == GPU_MEMORY and isinstance(part, dict) and "$gpumem" in part:
            try:
                return self.counters.load_memory_rows(part["$gpumem"])
            except (ValueError, TypeError, msgspec.ValidationError) as exc:
                raise ValueError(f"{name}: {exc}") from None
        return decode(part)  # the generic form (checkpoints written before the rows)


def checkpointed_fields() -> set[str]:
    """EngineState fields a checkpoint carries (a test requires all of them)."""
    return set(PARTS.values()) | {"counters"}


def state_fields() -> set[str]:
    return {f.name for f in fields(EngineState)}
