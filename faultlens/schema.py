"""The single source of truth for faultlens messages and lake tables.

Every record kind that crosses a process boundary is declared here once, as a
frozen ``msgspec.Struct`` with no Kafka, DuckDB or Streamlit imports (Structs,
not dataclasses: the one decoder, faultlens/decode.py, builds them straight from
JSON or MessagePack in C at a few microseconds a message). From that one
declaration come:

* the JSON wire format (UTF-8, always carrying ``"v": SCHEMA_VERSION``) and the
  agent's MessagePack wire for gpu and steps (faultlens/decode.py),
* decoding: ``decode`` / ``from_dict`` are faultlens/decode.py's, tolerant by
  field and strict by identity (docs/schemas.md, "Decoding"),
* the Arrow schema of the record's lake table (``lake_schema``).

faultlens/records.py re-exports the record types for code outside stream/.

Nested values (``fields``, ``suspects``, ``evidence``...) are JSON objects on
the wire and JSON strings in the lake, so every lake table stays flat and fast
to scan. The GPU sample is the exception that matters for volume: one message
holds all GPUs of a node; its lake table ``gpu`` has one row per GPU.

docs/schemas.md documents each kind with an example; tests check that the
examples there decode.

Over 500 lines on purpose: most of it is the thirteen record declarations, and
they stay in one module because they are the one contract every part reads
(decoding lives in faultlens/decode.py and faultlens/coercion.py, Arrow batches in
stream/decode_arrow.py); the lake layout at the end is derived from them.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import msgspec

from faultlens.vocabulary import ActionType, values

if TYPE_CHECKING:  # pyarrow is imported by the Arrow functions only: the agent never loads it
    import pyarrow as pa

SCHEMA_VERSION = 1
# Versions this code can read. A message from a newer producer is dead-lettered
# with reason "unknown_version" rather than misread.
READABLE_VERSIONS = frozenset({1})
MAX_MESSAGE_BYTES = 1_000_000


# Integers are 64-bit in the lake: a larger one is refused by the typed decode and
# nulled by the per-field path (reason out_of_range), never a failed Parquet write.
Int64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]


class _Record(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of every record kind: immutable, typed, positional or keyword construction.

    ``forbid_unknown_fields`` applies to the typed fast decode only: a message with
    an extra key goes through the per-field path, which ignores the key and counts it.
    """


# --------------------------------------------------------------------------- telemetry


class GpuState(_Record, frozen=True, omit_defaults=True):
    """One GPU at one instant. Error counters are cumulative, as NVML reports them.

    Every field but ``index`` may be None: a value the producer could not give
    (nvidia-smi's ``N/A``, ``[Not Supported]``, NaN) or that did not decode is
    null, never a guess; consumers skip it. Encoded sparse: a field at its
    default is left out of the wire (readers fill it back in).
    """

    index: Int64
    uuid: str = ""
    pci_bus: str = ""
    util: float | None = 0.0
    mem_util: float | None = 0.0
    mem_used_mb: float | None = 0.0
    temp_c: float | None = 0.0
    power_w: float | None = 0.0
    sm_clock_mhz: float | None = 0.0
    mem_clock_mhz: float | None = 0.0
    throttle_reasons: Int64 | None = 0
    ecc_sbe: Int64 | None = 0
    ecc_dbe: Int64 | None = 0
    ecc_sbe_agg: Int64 | None = 0
    ecc_dbe_agg: Int64 | None = 0
    retired_pages: Int64 | None = 0
    remap_pending: bool | None = False
    remap_failure: bool | None = False
    remapped_rows_corr: Int64 | None = 0
    remapped_rows_unc: Int64 | None = 0
    pcie_replay: Int64 | None = 0
    nvlink_errors: Int64 | None = 0
    nvlink_crc_errors: Int64 | None = 0
    nvlink_replay_errors: Int64 | None = 0
    nvlink_recovery_errors: Int64 | None = 0
    recovery_action: Int64 | None = 0
    lost: bool | None = False  # NVML answered GpuIsLost / the device vanished


class GpuSample(_Record, frozen=True):
    """One node's NVML sample of all its GPUs at one instant (topic ``gpu``)."""

    KIND: ClassVar[str] = "gpu"
    ts: float
    node: str
    gpus: list[GpuState] = []
    job: str | None = None
    v: Int64 = SCHEMA_VERSION


class KernelEvent(_Record, frozen=True):
    """One kernel log record (topic ``kernel``): the raw text plus parsed fields.

    ``raw`` holds the whole record, continuation lines included. ``kind`` is the
    parser's name for what the line is (``xid``, ``sxid``, ``fell_off_bus``,
    ``pcie_aer``, ``ib_link_down`` ...; ``other`` for ordinary noise).
    """

    KIND: ClassVar[str] = "kernel"
    ts: float
    node: str
    kind: str
    raw: str
    message: str = ""
    xid: Int64 | None = None
    pci_bus: str | None = None
    gpu: Int64 | None = None
    pid: Int64 | None = None
    rank: Int64 | None = None
    fields: dict[str, Any] = {}
    v: Int64 = SCHEMA_VERSION


class NcclEvent(_Record, frozen=True):
    """One NCCL / torch.distributed log record (topic ``nccl``), raw plus parsed."""

    KIND: ClassVar[str] = "nccl"
    ts: float
    node: str
    kind: str
    raw: str
    message: str = ""
    level: str | None = None  # INFO | WARN | ERROR (NCCL's own) or None
    rank: Int64 | None = None
    host: str | None = None
    pid: Int64 | None = None
    job: str | None = None
    op_type: str | None = None
    seq_num: Int64 | None = None
    timeout_ms: Int64 | None = None
    ran_for_ms: Int64 | None = None
    exception: str | None = None
    fields: dict[str, Any] = {}
    v: Int64 = SCHEMA_VERSION


class StepTiming(_Record, frozen=True):
    """One rank's timing of one training step, with its workload (topic ``steps``)."""

    KIND: ClassVar[str] = "steps"
    ts: float
    job: str
    rank: Int64
    node: str
    step: Int64
    duration_s: float
    n_seqs: Int64 = 0
    sum_len: Int64 = 0
    sum_len_sq: Int64 = 0
    tokens: Int64 = 0
    loss: float | None = None
    grad_norm: float | None = None
    fwd_s: float | None = None
    bwd_s: float | None = None
    comm_s: float | None = None
    tp: Int64 | None = None
    pp: Int64 | None = None
    dp: Int64 | None = None
    cp: Int64 | None = None
    v: Int64 = SCHEMA_VERSION


class StackDump(_Record, frozen=True):
    """One process's stack dump, all threads, as ``py-spy dump`` printed it (topic ``stacks``)."""

    KIND: ClassVar[str] = "stacks"
    ts: float
    job: str
    node: str
    rank: Int64 | None
    pid: Int64 | None
    text: str
    request_id: str | None = None
    error: str | None = None  # timeout, permission denied... when no dump came
    v: Int64 = SCHEMA_VERSION


class JobTopology(_Record, frozen=True):
    """A job's topology (topic ``jobs``). ``ranks`` maps str(rank) -> {node, gpu}."""

    KIND: ClassVar[str] = "jobs"
    ts: float
    job: str
    tp: Int64
    pp: Int64
    dp: Int64
    cp: Int64 = 1
    order: str = "tp-cp-dp-pp"
    ranks: dict[str, dict[str, Any]] = {}
    num_layers: Int64 | None = None
    micro_batches: Int64 | None = None
    v: Int64 = SCHEMA_VERSION


# --------------------------------------------------------------------------- diagnosis outputs


class Incident(_Record, frozen=True):
    """An incident opened or updated (topic ``incidents``, CloudEvents envelope).

    ``suspects``: [{node, gpu?, ranks?, score, reason}]; ``evidence``: [{ts, source,
    node?, rank?, text, figures?}]; ``muted``: [{item, by_rule}]; ``suppressed``: [{ts, reason,
    type, nodes, text}] with ``suppressed_counts`` {reason: n}.
    """

    KIND: ClassVar[str] = "incidents"
    id: str
    job: str
    opened_ts: float
    updated_ts: float
    status: str  # open | mitigated | resolved
    category: str  # DESIGN.md explain vocabulary
    kind: str  # fault kind, e.g. gpu_lost, ecc_uncorrectable, hang, fail_slow
    title: str
    severity: str = "critical"  # info | warning | critical
    confidence: float = 0.0
    suspects: list[dict[str, Any]] = []
    evidence: list[dict[str, Any]] = []
    muted: list[dict[str, Any]] = []
    actions: list[str] = []
    # what the guard did not let out as decided (diagnosis.guard): newest few, and counts by reason
    suppressed: list[dict[str, Any]] = []
    suppressed_counts: dict[str, int] = {}
    summary: str = ""
    root_cause: str | None = None  # set by a person in the explorer (label)
    v: Int64 = SCHEMA_VERSION


ACTION_TYPES = values(ActionType)


class Action(_Record, frozen=True):
    """A remediation action for the job runner (topic ``actions``, CloudEvents envelope)."""

    KIND: ClassVar[str] = "actions"
    id: str
    incident_id: str
    job: str
    ts: float
    type: str  # one of ACTION_TYPES
    nodes: list[str] = []
    suspects: list[dict[str, Any]] = []
    evidence: list[dict[str, Any]] = []
    confidence: float = 0.0
    dry_run: bool = True
    reason: str = ""
    plan: dict[str, Any] | None = None  # adapt_parallelism: the chosen plan and options
    # Online: how old (wall clock) the incident's newest evidence was when this was decided, how far the
    # engine's event time was behind the wall clock then (its consumer lag), and the bound both were judged
    # by ([diagnosis] max_evidence_age_s): the runner refuses the action once age + its own age pass it.
    # None / 0: batch or replayed input, no bound.
    evidence_age_s: float | None = None
    consumer_lag_s: float | None = None
    evidence_window_s: float = 0.0
    v: Int64 = SCHEMA_VERSION


class ActionStatus(_Record, frozen=True):
    """The runner's result of an action (topic ``action-status``)."""

    KIND: ClassVar[str] = "action-status"
    ts: float
    action_id: str
    job: str
    adapter: str
    status: str  # done | failed | dry_run | refused | pending (the scheduler cannot take it now: retried)
    detail: str = ""
    commands: list[list[str]] = []
    # The scheduler's state as the runner read it back before and after each command (Slurm adapter):
    # {"when": "before"|"after drain"|..., "node" or "job": name, and Slurm's fields, e.g. State, Reason}.
    observed: list[dict[str, Any]] = []
    v: Int64 = SCHEMA_VERSION


class Command(_Record, frozen=True):
    """A request to agents (topic ``commands``), e.g. ``dump_stacks`` of job J."""

    KIND: ClassVar[str] = "commands"
    id: str
    ts: float
    kind: str
    job: str
    nodes: list[str] = []  # empty: every node running the job
    params: dict[str, Any] = {}
    v: Int64 = SCHEMA_VERSION


class DeadLetter(_Record, frozen=True):
    """A message that could not be decoded, with the reason (topic ``deadletter``)."""

    KIND: ClassVar[str] = "deadletter"
    ts: float
    topic: str
    partition: Int64
    offset: Int64
    reason: str
    detail: str = ""
    key: str | None = None
    payload: str = ""  # the original bytes, decoded as UTF-8 with backslash escapes
    size: Int64 = 0
    v: Int64 = SCHEMA_VERSION


@dataclass(frozen=True, slots=True)
class Finding:
    """One piece of diagnostic evidence about a machine, before incidents group it.

    Produced by rules (diagnosis/), detectors and classifiers (models/); not a
    topic of its own: findings travel inside incidents as evidence. ``action`` is
    the per-line action vocabulary of ``explain`` (none, restart_job, reset_gpu,
    evict_node, rollback_code, run_diagnostics, notify).
    """

    ts: float
    kind: str  # fault kind, e.g. gpu_lost, ecc_uncorrectable, nvlink, ib_link, fail_slow
    category: str  # explain vocabulary: gpu_hardware, gpu_memory, nvlink, pcie, network, ...
    severity: str  # info | warning | critical
    action: str
    confidence: float
    source: str  # kernel | nccl | gpu | steps | stacks | model:<name>
    rule: str  # the catalog entry or model that produced it
    text: str  # the raw line, or a sentence with the figures
    node: str | None = None
    job: str | None = None
    gpu: Int64 | None = None
    rank: Int64 | None = None
    figures: dict[str, Any] = field(default_factory=dict)


# A lake table that is not a topic: one row per field the decoder could not read
# (nulled in its record) with the raw message, so a producer's quirk can be seen.
class Quarantine(_Record, frozen=True):
    """A field nulled by the decoder (lake table ``quarantine``; not a topic)."""

    KIND: ClassVar[str] = "quarantine"
    ts: float  # when it was decoded
    topic: str  # the record kind (gpu, steps...) or a file name in batch reads
    field: str  # e.g. "gpus.temp_c", "duration_s"
    reason: str  # not_available, not_supported, nan, bad_type, bad_unit, out_of_range, ...
    value: str = ""  # the value as it came, as JSON text (truncated)
    node: str | None = None
    partition: Int64 = -1
    offset: Int64 = -1
    payload: str = ""  # the raw message (truncated to 64 KB)
    v: Int64 = SCHEMA_VERSION


RECORDS: dict[str, type] = {
    cls.KIND: cls
    for cls in (
        GpuSample,
        KernelEvent,
        NcclEvent,
        StepTiming,
        StackDump,
        JobTopology,
        Incident,
        Action,
        ActionStatus,
        Command,
        DeadLetter,
        Quarantine,
    )
}
TELEMETRY_KINDS = ("gpu", "kernel", "nccl", "steps", "stacks", "jobs")


# --------------------------------------------------------------------------- record helpers


# GpuState fields that are error counters and flags, zero on a healthy GPU (60% of a
# dense sample's bytes). Every GpuState field at its default is left out of the wire
# (``omit_defaults``); readers fill defaults back, so dense messages decode the same.
GPU_SPARSE_FIELDS = frozenset(
    {
        "throttle_reasons", "ecc_sbe", "ecc_dbe", "ecc_sbe_agg", "ecc_dbe_agg", "retired_pages",
        "remap_pending", "remap_failure", "remapped_rows_corr", "remapped_rows_unc", "pcie_replay",
        "nvlink_errors", "nvlink_crc_errors", "nvlink_replay_errors", "nvlink_recovery_errors",
        "recovery_action", "lost",
    }
)  # fmt: skip


def field_names(cls: type) -> tuple[str, ...]:
    """Declared field names of a record type, in order."""
    return cls.__struct_fields__  # type: ignore[attr-defined, no-any-return]


def replace(record: Any, **changes: Any) -> Any:
    """A copy of ``record`` with ``changes`` (``dataclasses.replace`` for records)."""
    return msgspec.structs.replace(record, **changes)


def asdict(record: Any) -> dict[str, Any]:
    """The record's fields as a dict (nested records stay records)."""
    return msgspec.structs.asdict(record)


def field_defaults(cls: type) -> dict[str, Any]:
    """Field name -> default value (``msgspec.NODEFAULT`` for a required field; factories called)."""
    out = {}
    for f in msgspec.structs.fields(cls):
        if f.default is not msgspec.NODEFAULT:
            out[f.name] = f.default
        elif f.default_factory is not msgspec.NODEFAULT:
            out[f.name] = f.default_factory()
        else:
            out[f.name] = msgspec.NODEFAULT
    return out


_JSON = msgspec.json.Encoder()


def to_dict(record: Any) -> dict[str, Any]:
    """The record as the JSON object that goes on the wire."""
    return msgspec.to_builtins(record)  # type: ignore[no-any-return]


def encode(record: Any) -> bytes:
    """UTF-8 JSON bytes of a record (with ``"v"``). The agent's MessagePack: faultlens/decode.py."""
    return _JSON.encode(record)


def decode(kind: str, payload: bytes | str, *, content_type: str | None = None) -> Any:
    """Bytes from the bus -> record; raises SchemaError(reason) for anything wrong (faultlens/decode.py)."""
    from faultlens import decode as _decode

    return _decode.decode(kind, payload, content_type=content_type)


def from_dict(kind: str, obj: Any) -> Any:
    """A parsed JSON object -> record of ``kind``, through the one decoder (faultlens/decode.py)."""
    from faultlens import decode as _decode

    return _decode.from_obj(kind, obj)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    h = _HINTS.get(cls)
    if h is None:
        h = {k: v for k, v in typing.get_type_hints(cls).items() if k != "KIND"}
        _HINTS[cls] = h
    return h


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(type without None, optional?)"""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else tp), True
    return tp, False


# --------------------------------------------------------------------------- CloudEvents


CLOUDEVENT_TYPES = {
    "incidents": "io.faultlens.incident.v1",
    "actions": "io.faultlens.action.v1",
    "commands": "io.faultlens.command.v1",
}


def cloudevent(record: Incident | Action | Command, *, source: str = "/faultlens/diagnosis") -> dict[str, Any]:
    """Wrap an incident, action or agent command in a CloudEvents 1.0 structured-mode envelope
    (actions and commands are signed on it: stream/signing.py)."""
    import datetime as _dt

    kind = type(record).KIND
    ts = record.updated_ts if isinstance(record, Incident) else record.ts
    event_id = f"{record.id}:{ts:.6f}" if isinstance(record, Incident) else record.id
    return {
        "specversion": "1.0",
        "id": event_id,
        "source": source,
        "type": CLOUDEVENT_TYPES[kind],
        "time": _dt.datetime.fromtimestamp(ts, _dt.UTC).isoformat().replace("+00:00", "Z"),
        "subject": record.job,
        "datacontenttype": "application/json",
        "v": SCHEMA_VERSION,
        "data": to_dict(record),
    }


# --------------------------------------------------------------------------- lake (Arrow)


def _arrow_type(tp: Any) -> pa.DataType:
    import pyarrow as pa

    base, _ = _base_type(tp)
    origin = typing.get_origin(base) or base
    return {
        float: pa.float64(),
        int: pa.int64(),
        bool: pa.bool_(),
        str: pa.string(),
    }.get(origin, pa.string())  # lists and dicts are stored as JSON text


def _json_columns(cls: type) -> frozenset[str]:
    hints = _hints(cls)
    return frozenset(
        name for name, tp in hints.items() if (typing.get_origin(_base_type(tp)[0]) or _base_type(tp)[0]) in (list, dict)
    )


def lake_schema(kind: str) -> pa.Schema:
    """Arrow schema of the lake table for ``kind`` (gpu: one row per GPU)."""
    import pyarrow as pa

    if kind == "gpu":
        head = [pa.field("ts", pa.float64(), False), pa.field("node", pa.string(), False), pa.field("job", pa.string())]
        gpu_fields = [pa.field(name, _arrow_type(tp)) for name, tp in _hints(GpuState).items()]
        gpu_fields[0] = pa.field("gpu", pa.int64(), False)  # `index` is a SQL keyword
        return pa.schema(head + gpu_fields)
    cls = RECORDS[kind]
    hints = _hints(cls)
    fields = []
    for name in field_names(cls):
        base, optional = _base_type(hints[name])
        nullable = optional or name in _json_columns(cls)
        fields.append(pa.field(name, _arrow_type(hints[name]), nullable))
    return pa.schema(fields)


def lake_row(record: Any) -> list[dict[str, Any]]:
    """Lake rows of one record (several for a GPU sample). JSON columns as text."""
    kind = type(record).KIND
    if kind == "gpu":
        rows = []
        for g in record.gpus:
            row = {"ts": record.ts, "node": record.node, "job": record.job}
            row.update(msgspec.structs.asdict(g))
            row["gpu"] = row.pop("index")
            rows.append(row)
        return rows
    jcols = _json_columns(type(record))
    row = {}
    for name in field_names(type(record)):
        value = getattr(record, name)
        row[name] = _JSON.encode(value).decode() if name in jcols and value is not None else value
    return [row]


def json_columns(kind: str) -> frozenset[str]:
    """Columns of a lake table that hold JSON text (nested values)."""
    return frozenset() if kind == "gpu" else _json_columns(RECORDS[kind])
