"""The single source of truth for faultlens messages and lake tables.

Every record kind that crosses a process boundary is declared here once, as a
plain frozen dataclass with no Kafka, DuckDB or Streamlit imports. From that one
declaration come:

* the JSON wire format (UTF-8, always carrying ``"v": SCHEMA_VERSION``),
* decoding with validation (``decode``: a bad message raises ``SchemaError``
  with a short, stable reason that the dead-letter topic records),
* the Arrow schema of the record's lake table (``lake_schema``).

Nested values (``fields``, ``suspects``, ``evidence``...) are JSON objects on
the wire and JSON strings in the lake, so every lake table stays flat and fast
to scan. The GPU sample is the exception that matters for volume: one message
holds all GPUs of a node; its lake table ``gpu`` has one row per GPU.

docs/schemas.md documents each kind with an example; tests check that the
examples there decode.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, get_type_hints

import orjson

from faultlens.errors import SchemaError
from faultlens.vocabulary import ActionType, values

if TYPE_CHECKING:  # pyarrow is imported by the Arrow functions only: the agent never loads it
    import pyarrow as pa

SCHEMA_VERSION = 1
# Versions this code can read. A message from a newer producer is dead-lettered
# with reason "unknown_version" rather than misread.
READABLE_VERSIONS = frozenset({1})
MAX_MESSAGE_BYTES = 1_000_000


def _list() -> Any:
    return field(default_factory=list)


def _dict() -> Any:
    return field(default_factory=dict)


# --------------------------------------------------------------------------- telemetry


@dataclass(frozen=True, slots=True)
class GpuState:
    """One GPU at one instant. Error counters are cumulative, as NVML reports them."""

    index: int
    uuid: str = ""
    pci_bus: str = ""
    util: float = 0.0
    mem_util: float = 0.0
    mem_used_mb: float = 0.0
    temp_c: float = 0.0
    power_w: float = 0.0
    sm_clock_mhz: float = 0.0
    mem_clock_mhz: float = 0.0
    throttle_reasons: int = 0
    ecc_sbe: int = 0
    ecc_dbe: int = 0
    ecc_sbe_agg: int = 0
    ecc_dbe_agg: int = 0
    retired_pages: int = 0
    remap_pending: bool = False
    remap_failure: bool = False
    remapped_rows_corr: int = 0
    remapped_rows_unc: int = 0
    pcie_replay: int = 0
    nvlink_errors: int = 0
    nvlink_crc_errors: int = 0
    nvlink_replay_errors: int = 0
    nvlink_recovery_errors: int = 0
    recovery_action: int = 0
    lost: bool = False  # NVML answered GpuIsLost / the device vanished


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One node's NVML sample of all its GPUs at one instant (topic ``gpu``)."""

    KIND: ClassVar[str] = "gpu"
    ts: float
    node: str
    gpus: list[GpuState] = _list()
    job: str | None = None
    v: int = SCHEMA_VERSION


@dataclass(frozen=True, slots=True)
class KernelEvent:
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
    xid: int | None = None
    pci_bus: str | None = None
    gpu: int | None = None
    pid: int | None = None
    rank: int | None = None
    fields: dict[str, Any] = _dict()
    v: int = SCHEMA_VERSION


@dataclass(frozen=True, slots=True)
class NcclEvent:
    """One NCCL / torch.distributed log record (topic ``nccl``), raw plus parsed."""

    KIND: ClassVar[str] = "nccl"
    ts: float
    node: str
    kind: str
    raw: str
    message: str = ""
    level: str | None = None  # INFO | WARN | ERROR (NCCL's own) or None
    rank: int | None = None
    host: str | None = None
    pid: int | None = None
    job: str | None = None
    op_type: str | None = None
    seq_num: int | None = None
    timeout_ms: int | None = None
    ran_for_ms: int | None = None
    exception: str | None = None
    fields: dict[str, Any] = _dict()
    v: int = SCHEMA_VERSION


@dataclass(frozen=True, slots=True)
class StepTiming:
    """One rank's timing of one training step, with its workload (topic ``steps``)."""

    KIND: ClassVar[str] = "steps"
    ts: float
    job: str
    rank: int
    node: str
    step: int
    duration_s: float
    n_seqs: int = 0
    sum_len: int = 0
    sum_len_sq: int = 0
    tokens: int = 0
    loss: float | None = None
    grad_norm: float | None = None
    fwd_s: float | None = None
    bwd_s: float | None = None
    comm_s: float | None = None
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    cp: int | None = None
    v: int = SCHEMA_VERSION


@dataclass(frozen=True, slots=True)
class StackDump:
    """One process's stack dump, all threads, as ``py-spy dump`` printed it (topic ``stacks``)."""

    KIND: ClassVar[str] = "stacks"
    ts: float
    job: str
    node: str
    rank: int | None
    pid: int | None
    text: str
    request_id: str | None = None
    error: str | None = None  # timeout, permission denied... when no dump came
    v: int = SCHEMA_VERSION


@dataclass(frozen=True, slots=True)
class JobTopology:
    """A job's topology (topic ``jobs``). ``ranks`` maps str(rank) -> {node, gpu}."""

    KIND: ClassVar[str] = "jobs"
    ts: float
    job: str
    tp: int
    pp: int
    dp: int
    cp: int = 1
    order: str = "tp-cp-dp-pp"
    ranks: dict[str, dict[str, Any]] = _dict()
    num_layers: int | None = None
    micro_batches: int | None = None
    v: int = SCHEMA_VERSION


# --------------------------------------------------------------------------- diagnosis outputs


@dataclass(frozen=True, slots=True)
class Incident:
    """An incident opened or updated (topic ``incidents``, CloudEvents envelope).

    ``suspects``: [{node, gpu?, ranks?, score, reason}]; ``evidence``: [{ts, source,
    node?, rank?, text, figures?}]; ``muted``: [{item, by_rule}].
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
    suspects: list[dict[str, Any]] = _list()
    evidence: list[dict[str, Any]] = _list()
    muted: list[dict[str, Any]] = _list()
    actions: list[str] = _list()
    summary: str = ""
    root_cause: str | None = None  # set by a person in the explorer (label)
    v: int = SCHEMA_VERSION


ACTION_TYPES = values(ActionType)


@dataclass(frozen=True, slots=True)
class Action:
    """A remediation action for the job runner (topic ``actions``, CloudEvents envelope)."""

    KIND: ClassVar[str] = "actions"
    id: str
    incident_id: str
    job: str
    ts: float
    type: str  # one of ACTION_TYPES
    nodes: list[str] = _list()
    suspects: list[dict[str, Any]] = _list()
    evidence: list[dict[str, Any]] = _list()
    confidence: float = 0.0
    dry_run: bool = True
    reason: str = ""
    plan: dict[str, Any] | None = None  # adapt_parallelism: the chosen plan and options
    v: int = SCHEMA_VERSION


@dataclass(frozen=True, slots=True)
class ActionStatus:
    """The runner's result of an action (topic ``action-status``)."""

    KIND: ClassVar[str] = "action-status"
    ts: float
    action_id: str
    job: str
    adapter: str
    status: str  # done | failed | dry_run | refused
    detail: str = ""
    commands: list[list[str]] = _list()
    v: int = SCHEMA_VERSION


@dataclass(frozen=True, slots=True)
class Command:
    """A request to agents (topic ``commands``), e.g. ``dump_stacks`` of job J."""

    KIND: ClassVar[str] = "commands"
    id: str
    ts: float
    kind: str
    job: str
    nodes: list[str] = _list()  # empty: every node running the job
    params: dict[str, Any] = _dict()
    v: int = SCHEMA_VERSION


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A message that could not be decoded, with the reason (topic ``deadletter``)."""

    KIND: ClassVar[str] = "deadletter"
    ts: float
    topic: str
    partition: int
    offset: int
    reason: str
    detail: str = ""
    key: str | None = None
    payload: str = ""  # the original bytes, decoded as UTF-8 with backslash escapes
    size: int = 0
    v: int = SCHEMA_VERSION


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
    gpu: int | None = None
    rank: int | None = None
    figures: dict[str, Any] = _dict()


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
    )
}
TELEMETRY_KINDS = ("gpu", "kernel", "nccl", "steps", "stacks", "jobs")


# --------------------------------------------------------------------------- encode / decode


# GpuState fields left out of the wire while at their default (zero / false).
# They are error counters and flags, zero on a healthy GPU, and they were 60% of
# a sample's bytes; the gauges are always sent. A reader fills an absent field
# with its default, so dense messages (older agents, hand-written files) decode
# the same. Measured in benchmarks/ingest.py: 4.1 KB -> 1.7 KB per 8-GPU sample.
GPU_SPARSE_FIELDS = frozenset(
    {
        "throttle_reasons", "ecc_sbe", "ecc_dbe", "ecc_sbe_agg", "ecc_dbe_agg", "retired_pages",
        "remap_pending", "remap_failure", "remapped_rows_corr", "remapped_rows_unc", "pcie_replay",
        "nvlink_errors", "nvlink_crc_errors", "nvlink_replay_errors", "nvlink_recovery_errors",
        "recovery_action", "lost",
    }
)  # fmt: skip


_GPU_WIRE_FIELDS = tuple((f.name, f.name in GPU_SPARSE_FIELDS, f.default) for f in dataclasses.fields(GpuState))


def _gpu_wire(g: GpuState) -> dict[str, Any]:
    out = {}
    for name, sparse, default in _GPU_WIRE_FIELDS:
        value = getattr(g, name)
        if not (sparse and value == default):
            out[name] = value
    return out


def _to_jsonable(record: Any) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if f.name == "gpus":
            value = [_gpu_wire(g) for g in value]
        out[f.name] = value
    return out


def to_dict(record: Any) -> dict[str, Any]:
    """The record as the JSON object that goes on the wire."""
    return _to_jsonable(record)


def encode(record: Any) -> bytes:
    """UTF-8 JSON bytes of a record (with ``"v"``)."""
    return orjson.dumps(_to_jsonable(record))


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    h = _HINTS.get(cls)
    if h is None:
        h = {k: v for k, v in get_type_hints(cls).items() if k != "KIND"}
        _HINTS[cls] = h
    return h


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(type without None, optional?)"""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else tp), True
    return tp, False


def _coerce(name: str, value: Any, tp: Any, kind: str) -> Any:
    base, optional = _base_type(tp)
    if value is None:
        if optional:
            return None
        raise SchemaError("null_field", kind=kind, detail=name)
    origin = typing.get_origin(base) or base
    ok = True
    if origin is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif origin is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        if not ok and isinstance(value, float) and value.is_integer():
            value, ok = int(value), True
    elif origin is bool:
        ok = isinstance(value, bool)
    elif origin is str:
        ok = isinstance(value, str)
    elif origin is list:
        ok = isinstance(value, list)
    elif origin is dict:
        ok = isinstance(value, dict)
    if not ok:
        raise SchemaError("bad_type", kind=kind, detail=f"{name}: expected {origin.__name__}, got {type(value).__name__}")
    return value


def from_dict(kind: str, obj: Any) -> Any:
    """Validate a decoded JSON object and build the record of ``kind``."""
    cls = RECORDS.get(kind)
    if cls is None:
        raise SchemaError("unknown_kind", kind=kind)
    if not isinstance(obj, dict):
        raise SchemaError("not_an_object", kind=kind)
    v = obj.get("v")
    if not _readable(v):
        raise SchemaError("unknown_version", kind=kind, detail=f"v={v!r}")
    build = _shapes(cls).builder(obj)
    if build is not None:
        try:
            return build(*obj.values())
        except _OffShape:
            pass  # a value of another type: the generic path decides, with the exact error
    return _from_dict_checked(cls, kind, obj)


def _readable(v: Any) -> bool:
    try:
        return v in READABLE_VERSIONS
    except TypeError:  # an object or array where the version belongs
        return False


def _from_dict_checked(cls: type, kind: str, obj: dict[str, Any]) -> Any:
    """The generic path: every field checked against its type hint (exact errors)."""
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in obj:
            kwargs[f.name] = _coerce(f.name, obj[f.name], hints[f.name], kind)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise SchemaError("missing_field", kind=kind, detail=f.name)
    if cls is GpuSample:
        gpu_hints = _hints(GpuState)
        gpus = []
        for g in kwargs.get("gpus", []):
            if not isinstance(g, dict) or "index" not in g:
                raise SchemaError("bad_gpu_entry", kind=kind)
            gpus.append(GpuState(**{k: _coerce(k, val, gpu_hints[k], kind) for k, val in g.items() if k in gpu_hints}))
        kwargs["gpus"] = gpus
    return cls(**kwargs)


# --------------------------------------------------------------------------- fast decoding
#
# Checking each value against its type hint with typing introspection costs
# about a microsecond, and a one-hour batch directory of 1,024 GPUs holds 3.7
# million GpuStates of 27 fields. So ``from_dict`` first looks up the object's
# keys, in order, in a small per-class table of constructors generated for that
# key order. Each one checks every value's exact type in one expression (an int
# where a float is declared is converted, as ``_coerce`` does) and fills the
# slots directly, as the dataclass's own __init__ does. A value of any other
# type (a null, a bool or string where a number belongs, a float where an int
# belongs), a missing required field or an unusual key order sends the object
# to the generic path, which builds the same record or raises the same
# SchemaError. Producers send one or two key orders each; the table is capped.
# The generated code names arguments and slots by position only: no key from
# the input is ever part of it.

_MAX_SHAPES = 64


class _OffShape(Exception):
    """A value is not of the declared type: the generic path decides."""


def _to_float(value: Any) -> float:
    if type(value) is int:
        return float(value)
    raise _OffShape


class _Shapes:
    """Key orders of one record class -> generated constructors (None: generic path)."""

    def __init__(self, cls: type):
        self.cls = cls
        self.fields = dataclasses.fields(cls)
        self.index = {f.name: i for i, f in enumerate(self.fields)}
        self.accept: list[tuple[type, bool] | None] = []  # (declared type, optional?) per field
        hints = _hints(cls)
        for f in self.fields:
            base, optional = _base_type(hints[f.name])
            origin = typing.get_origin(base) or base
            known = origin in (float, int, bool, str, list, dict)
            self.accept.append((origin, optional) if known else None)  # an unusual hint: always generic
        self.builders: dict[tuple[Any, ...], Any] = {}

    def builder(self, obj: dict[str, Any]) -> Any:
        keys = tuple(obj)
        try:
            return self.builders[keys]
        except KeyError:
            pass
        if len(self.builders) >= _MAX_SHAPES:
            return None
        build = self.builders[keys] = self._generate(keys)
        return build

    def _generate(self, keys: tuple[Any, ...]) -> Any:
        given: dict[int, int] = {}  # field position -> argument position
        for a, key in enumerate(keys):
            i = self.index.get(key) if isinstance(key, str) else None
            if i is not None:  # unknown keys are ignored, as the generic path does
                if self.accept[i] is None:
                    return None
                given[i] = a
        ns: dict[str, Any] = {"new": object.__new__, "C": self.cls, "T": type, "Off": _OffShape, "flt": _to_float,
                              "nested": _gpu_states}
        checks, body = [], ["    o = new(C)"]
        for i, f in enumerate(self.fields):
            ns[f"s{i}"] = getattr(self.cls, f.name).__set__  # the slot's own setter, as __init__ uses
            if i in given:
                arg = f"a{given[i]}"
                origin, optional = self.accept[i]  # type: ignore[misc]
                ns[f"t{i}"] = origin
                value = arg
                if origin is float:
                    value = f"({arg} if T({arg}) is float{f' or {arg} is None' if optional else ''} else flt({arg}))"
                else:
                    checks.append(f"({arg} is None or T({arg}) is t{i})" if optional else f"T({arg}) is t{i}")
                    if self.cls is GpuSample and f.name == "gpus":
                        value = f"nested({arg})"
            elif f.default is not dataclasses.MISSING:
                ns[f"d{i}"] = f.default
                value = f"d{i}"
            elif f.default_factory is not dataclasses.MISSING:
                ns[f"d{i}"] = f.default_factory
                value = f"d{i}()"
            else:
                return None  # a required field is missing: the generic path says which
            body.append(f"    s{i}(o, {value})")
        if checks:
            body.insert(0, f"    if not ({' and '.join(checks)}):\n        raise Off")
        args = ", ".join(f"a{a}" for a in range(len(keys)))
        exec(f"def build({args}):\n" + "\n".join(body) + "\n    return o\n", ns)  # noqa: S102 - positions only
        return ns["build"]


_SHAPES: dict[type, _Shapes] = {}


def _shapes(cls: type) -> _Shapes:
    s = _SHAPES.get(cls)
    if s is None:
        s = _SHAPES[cls] = _Shapes(cls)
    return s


def _gpu_states(entries: list[Any]) -> list[GpuState]:
    """A sample's GPU entries through GpuState's table; anything else raises _OffShape."""
    shapes = _shapes(GpuState)
    builders = shapes.builders
    try:
        return [builders[tuple(g)](*g.values()) for g in entries if type(g) is dict or _off()]
    except (KeyError, TypeError):  # TypeError: None (a key order for the generic path) is not callable
        pass
    out = []
    for g in entries:  # a key order not seen yet, or one for the generic path
        build = shapes.builder(g)
        if build is None:
            raise _OffShape
        out.append(build(*g.values()))
    return out


def _off() -> bool:
    raise _OffShape


def decode(kind: str, payload: bytes | str) -> Any:
    """Bytes from the bus -> record; raises SchemaError(reason) for anything wrong."""
    if len(payload) > MAX_MESSAGE_BYTES:
        raise SchemaError("oversized", kind=kind, detail=f"{len(payload)} bytes > {MAX_MESSAGE_BYTES}")
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise SchemaError("malformed_json", kind=kind, detail=str(exc)) from None
    if kind in ("incidents", "actions") and isinstance(obj, dict) and "specversion" in obj:
        obj = obj.get("data")
    return from_dict(kind, obj)


# --------------------------------------------------------------------------- CloudEvents


CLOUDEVENT_TYPES = {
    "incidents": "io.faultlens.incident.v1",
    "actions": "io.faultlens.action.v1",
}


def cloudevent(record: Incident | Action, *, source: str = "/faultlens/diagnosis") -> dict[str, Any]:
    """Wrap an incident or action in a CloudEvents 1.0 structured-mode envelope."""
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
        "data": _to_jsonable(record),
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
    for f in dataclasses.fields(cls):
        base, optional = _base_type(hints[f.name])
        nullable = optional or f.name in _json_columns(cls)
        fields.append(pa.field(f.name, _arrow_type(hints[f.name]), nullable))
    return pa.schema(fields)


def lake_row(record: Any) -> list[dict[str, Any]]:
    """Lake rows of one record (several for a GPU sample). JSON columns as text."""
    kind = type(record).KIND
    if kind == "gpu":
        rows = []
        for g in record.gpus:
            row = {"ts": record.ts, "node": record.node, "job": record.job}
            row.update(dataclasses.asdict(g))
            row["gpu"] = row.pop("index")
            rows.append(row)
        return rows
    jcols = _json_columns(type(record))
    row = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        row[f.name] = orjson.dumps(value).decode() if f.name in jcols and value is not None else value
    return [row]


def json_columns(kind: str) -> frozenset[str]:
    """Columns of a lake table that hold JSON text (nested values)."""
    return frozenset() if kind == "gpu" else _json_columns(RECORDS[kind])
