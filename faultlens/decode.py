"""The one decoder: bytes or parsed objects -> typed records (faultlens/schema.py).

Every path that reads structured records uses this module: the stream
processor (stream/decode_arrow.py builds its Arrow batches from these
records), online diagnosis and the runner (``schema.decode``), the batch
reader (``from_obj``) and the agent's own steps lines.

Tolerant by field, strict by identity (DESIGN.md):

* A value is read through one coercion table (faultlens/coercion.py, its words in
  faultlens/coercion.toml): NVML's
  0/1 and nvidia-smi's ``Yes``/``No`` for booleans, numeric strings (with the
  field's unit: ``"72 C"``, ``"412.35 W"``), hex strings for bit masks,
  integral floats for counters. ``N/A``, ``[Not Supported]``, NaN, Infinity
  and any value a field cannot hold make that field null (or its default where
  the field has no null), and each is reported as a ``FieldIssue`` (the
  processor counts them per topic and field and writes them to the lake's
  ``quarantine`` table). Unknown extra keys are ignored and reported too.
* Only a record whose identity is unusable is refused (``SchemaError``, then a
  dead letter): a required field (declared without a default: node, ts, kind,
  a GPU's index...) missing or unreadable, a non-finite time, an unreadable
  version, a payload that is no JSON or MessagePack object, a null value or
  tombstone, and a time outside ``TimeBounds`` (``[time]`` in the config):
  before ``earliest_ts`` (a clock at 1970) or more than ``max_future_s`` ahead
  of the reader's clock (a stamp in milliseconds or microseconds, a clock at
  2100). Every path (typed, per-field, MessagePack, the processor's batch
  paths) checks time here, so none can let such a record through. A GPU entry without
  a usable index is dropped alone; its sample's other GPUs stay.

Speed: a message whose values already have the declared types (what
faultlens's own agent sends) is decoded in one typed msgspec call, in C; only a
message that fails that goes through the per-field table, which gives the
same record for every value the typed call accepts.

Wire formats: JSON (any producer) and, for gpu and steps, the agent's
MessagePack marked by a ``content-type: application/msgpack`` Kafka header
(``encode_wire``). A message without the header whose first byte is a
MessagePack map marker is read as MessagePack too: JSON text never starts so.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from faultlens import schema
from faultlens.coercion import (  # noqa: F401 - the table's names are part of the decoder's API
    FALSE_WORDS,
    ISSUE_VALUE_MAX,
    MAX_TS,
    NONFINITE_FIELDS,
    NULL_WORDS,
    TRUE_WORDS,
    UNITS,
    UNKNOWN_FIELD,
    Bad,
    FieldIssue,
    FieldPlan,
    field_plan,
    to_bool,
    to_dict,
    to_float,
    to_int,
    to_list,
    to_str,
    to_ts,
)
from faultlens.coercion import text_of as _text
from faultlens.errors import SchemaError
from faultlens.gpu_wire import (  # noqa: F401 - the wire's names are part of the decoder's API
    GPU_COLUMNS,
    GPU_NUMERIC,
    GPU_STRINGS,
    JSON_TYPE,
    MSGPACK_TYPE,
    GpuColumns,
    columnar_gpu_fast,
    columns_to_obj,
    content_type_of,
    encode_wire,
    gpu_columns,
    is_msgpack,
)
from faultlens.schema import GpuSample, GpuState

CONTENT_TYPE_HEADER = "content-type"
# Kinds faultlens's agent sends as MessagePack (high volume); any other kind is JSON.
MSGPACK_KINDS = frozenset({"gpu", "steps"})






# --------------------------------------------------------------------------- time bounds


@dataclass(frozen=True, slots=True)
class TimeBounds:
    """The times a record may carry: ``[earliest_ts, reader's clock + max_future_s]`` (``[time]``).

    Actions and commands are stamped by diagnosis, whose clock never leads the wall clock by more
    than ``max_clock_skew_s``: one dated further ahead is forged or damaged (``ts_future``), and a
    runner or agent must not act on it."""

    earliest_ts: float = 946_684_800.0  # 2000-01-01T00:00:00Z
    max_future_s: float = 86_400.0
    max_clock_skew_s: float = 300.0

    @classmethod
    def from_config(cls, config: Any) -> TimeBounds:
        t = config.time
        return cls(earliest_ts=t.earliest_ts, max_future_s=t.max_future_s, max_clock_skew_s=t.max_clock_skew_s)

    def latest(self, now: float | None = None, kind: str = "") -> float:
        ahead = self.max_clock_skew_s if kind in DECIDED_KINDS else self.max_future_s
        return (time.time() if now is None else now) + ahead

    def problem(self, ts: float, now: float | None = None, kind: str = "") -> tuple[str, str] | None:
        """``(reason, detail)`` when ``ts`` is outside the bounds, else None."""
        latest = self.latest(now, kind)
        if self.earliest_ts <= ts <= latest:
            return None
        if ts > latest:
            for scale, reason in ((1e3, "ts_milliseconds"), (1e6, "ts_microseconds"), (1e9, "ts_nanoseconds")):
                if max(self.earliest_ts, _Y2000) <= ts / scale <= latest:
                    return reason, f"ts {ts!r} is seconds since 1970 times {scale:g}: a stamp in the wrong unit"
            limit = "time.max_clock_skew_s" if kind in DECIDED_KINDS else "time.max_future_s"
            return "ts_future", f"ts {ts!r} is {ts - time.time():.0f} s ahead of this clock (limit {limit})"
        return "ts_past", f"ts {ts!r} is before time.earliest_ts={self.earliest_ts:g} (a clock left at 1970?)"


# A recorded directory (`faultlens diagnose DIR`) replays its own event time: a run from any date, even
# one stamped ahead of this machine's clock, is read as it was written; only what no calendar holds is
# refused (MAX_TS). The bounds protect live services, whose clocks a stamp can move.
RECORDED_TIME = TimeBounds(earliest_ts=-math.inf, max_future_s=math.inf, max_clock_skew_s=math.inf)

# What diagnosis decides (stamped on its own bounded clock, acted on by the runner and the agents).
DECIDED_KINDS = frozenset({"actions", "commands"})
_Y2000 = 946_684_800.0  # a stamp in another unit is named so only when it reads as a recent time
_BOUNDS: list[TimeBounds] = [TimeBounds()]


def set_time_bounds(bounds: TimeBounds) -> None:
    """The bounds every decode in this process applies (each service sets them from its config at start)."""
    _BOUNDS[0] = bounds


def time_bounds() -> TimeBounds:
    return _BOUNDS[0]


def _time_field(record: Any) -> float | None:
    ts = getattr(record, "ts", None)
    if ts is None:
        ts = getattr(record, "updated_ts", None)  # an incident
    return ts if isinstance(ts, (int, float)) else None


def check_time(record: Any, kind: str, now: float | None = None, bounds: TimeBounds | None = None) -> Any:
    """``record`` when its time is inside the bounds; else SchemaError with the reason.

    A job topology stamped 0 has no time (a hand-written job.json): it is kept, and moves no clock."""
    ts = _time_field(record)
    if ts is not None and not (ts == 0.0 and kind == "jobs"):
        problem = (bounds or _BOUNDS[0]).problem(ts, now, kind)
        if problem is not None:
            raise SchemaError(problem[0], kind=kind, detail=problem[1])
    return record


# --------------------------------------------------------------------------- objects -> records


def _version(obj: dict[str, Any], kind: str) -> None:
    """A readable version; none given is the current one (other producers do not write one)."""
    if "v" not in obj:
        return
    v = obj["v"]
    if type(v) is not int:
        try:
            v = to_int(v, "v")
        except Bad:
            raise SchemaError("unknown_version", kind=kind, detail=f"v={_text(v)}") from None
    if v not in schema.READABLE_VERSIONS:
        raise SchemaError("unknown_version", kind=kind, detail=f"v={v!r}")


def _tolerant(cls: type, kind: str, obj: dict[str, Any], issues: list[FieldIssue] | None, prefix: str = "") -> Any:
    """Per-field decode through the table: bad fields null (or default), reported; identity strict."""
    kwargs: dict[str, Any] = {}
    plan = field_plan(cls)
    for f in plan:
        if f.name not in obj:
            if f.required:
                raise SchemaError("missing_field", kind=kind, detail=prefix + f.name)
            continue
        value = obj[f.name]
        if value is None:
            if f.optional:
                kwargs[f.name] = None
                continue
            if f.required:
                raise SchemaError("null_field", kind=kind, detail=prefix + f.name)
            if issues is not None:
                issues.append(FieldIssue(prefix + f.name, "null", "null"))
            continue  # the default
        if cls is GpuSample and f.name == "gpus":
            kwargs["gpus"] = _gpus(value, kind, issues)
            continue
        try:
            kwargs[f.name] = f.coerce(value, f.name)
            if f.required and f.name == "ts" and not math.isfinite(kwargs["ts"]):
                raise Bad("nan")
        except Bad as bad:
            if f.required:
                raise SchemaError("bad_type", kind=kind, detail=f"{prefix}{f.name}: {bad.reason}: {_text(value)}") from None
            if issues is not None:
                issues.append(FieldIssue(prefix + f.name, bad.reason, _text(value)))
            if f.optional:
                kwargs[f.name] = None
    if issues is not None and len(obj) > len(kwargs):
        known = _known(cls)
        issues.extend(FieldIssue(prefix + str(k), UNKNOWN_FIELD, "") for k in obj if k not in known)
    return cls(**kwargs)


_KNOWN: dict[type, frozenset[str]] = {}


def _known(cls: type) -> frozenset[str]:
    k = _KNOWN.get(cls)
    if k is None:
        k = _KNOWN[cls] = frozenset(schema.field_names(cls))
    return k


def _gpus(value: Any, kind: str, issues: list[FieldIssue] | None) -> list[GpuState]:
    """A sample's GPU entries; an entry without a usable index is dropped alone (reported)."""
    if not isinstance(value, list):
        if issues is not None:
            issues.append(FieldIssue("gpus", "bad_type", _text(value)))
        return []
    out = []
    for g in value:
        if not isinstance(g, dict):
            if issues is not None:
                issues.append(FieldIssue("gpus", "bad_gpu_entry", _text(g)))
            continue
        try:
            out.append(_tolerant(GpuState, kind, g, issues, "gpus."))
        except SchemaError as exc:  # the entry's identity (its index) is unusable
            if issues is not None:
                issues.append(FieldIssue("gpus.index", "bad_gpu_entry", f"{exc.reason}: {exc.detail}"[:ISSUE_VALUE_MAX]))
    return out


def _check(record: Any, kind: str, bounds: TimeBounds | None = None) -> Any:
    """What the typed fast path cannot express: a readable version and a usable time."""
    if record.v not in schema.READABLE_VERSIONS:
        raise SchemaError("unknown_version", kind=kind, detail=f"v={record.v!r}")
    ts = getattr(record, "ts", 0.0)
    if ts - ts != 0.0:  # NaN or infinite (MessagePack can carry them)
        raise SchemaError("bad_type", kind=kind, detail=f"ts: not finite: {ts!r}")
    check_time(record, kind, bounds=bounds)  # ms/us stamps, 2100, 1970: the reason names which
    if not -MAX_TS <= ts <= MAX_TS:  # no calendar (nor the lake's hour partitions) holds it (bounds set wide)
        raise SchemaError("out_of_range", kind=kind, detail=f"ts: {ts!r}")
    return record


def _finite(record: Any) -> bool:
    """No NaN/Infinity in a record's float fields (MessagePack carries them; JSON cannot)."""
    for g in getattr(record, "gpus", ()):
        for name in _FLOAT_GPU_FIELDS:
            x = getattr(g, name)
            if x is not None and x - x != 0.0:
                return False
    return all(x is None or not isinstance(x, float) or x - x == 0.0 or name in NONFINITE_FIELDS
               for name, x in zip(record.__struct_fields__, msgspec.structs.astuple(record), strict=True))


_FLOAT_GPU_FIELDS = tuple(f.name for f in field_plan(GpuState) if f.coerce is to_float)


def from_obj(kind: str, obj: Any, issues: list[FieldIssue] | None = None, *, bounds: TimeBounds | None = None) -> Any:
    """A parsed JSON/MessagePack object -> the record of ``kind``; SchemaError when its identity is unusable.

    ``issues`` collects the fields nulled and the unknown keys.
    """
    cls = schema.RECORDS.get(kind)
    if cls is None:
        raise SchemaError("unknown_kind", kind=kind)
    if kind in ("incidents", "actions", "commands") and isinstance(obj, dict) and "specversion" in obj:
        obj = obj.get("data")  # a CloudEvents envelope
    if not isinstance(obj, dict):
        raise SchemaError("not_an_object", kind=kind)
    _version(obj, kind)
    try:
        record: Any = msgspec.convert(obj, cls)
        if _finite(record):  # a NaN/Infinity float (MessagePack, Python objects): the table nulls it
            return _check(record, kind, bounds)
    except msgspec.ValidationError:
        pass  # a value of another type: the table decides, field by field
    return _check(_tolerant(cls, kind, obj, issues), kind, bounds)


# --------------------------------------------------------------------------- bytes -> records

_JSON_DECODERS: dict[str, msgspec.json.Decoder[Any]] = {}
_MSGPACK_DECODERS: dict[str, msgspec.msgpack.Decoder[Any]] = {}
_ANY_MSGPACK = msgspec.msgpack.Decoder()


def json_decoder(kind: str) -> msgspec.json.Decoder[Any]:
    """The typed (strict) JSON decoder of one kind: the fast path."""
    d = _JSON_DECODERS.get(kind)
    if d is None:
        d = _JSON_DECODERS[kind] = msgspec.json.Decoder(schema.RECORDS[kind])
    return d


def _parse_json(payload: bytes | str, kind: str) -> Any:
    """Untyped JSON, accepting NaN/Infinity (Python's json writes them) as a last resort."""
    try:
        return msgspec.json.decode(payload)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: deep nesting
        first = exc
    try:
        text = payload.decode("utf-8") if isinstance(payload, (bytes, bytearray, memoryview)) else payload
        return json.loads(text, parse_constant=lambda c: float(c.replace("Infinity", "inf")))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise SchemaError("malformed_json", kind=kind, detail=str(first)) from None


def decode(kind: str, payload: bytes | str, *, content_type: str | bytes | None = None,
           issues: list[FieldIssue] | None = None, bounds: TimeBounds | None = None, columnar: bool = False) -> Any:
    """Bytes from the bus -> record; SchemaError(reason) when the record cannot be had.

    ``bounds``: the times accepted (default: this process's ``[time]`` bounds; ``RECORDED_TIME`` for a
    recorded directory). ``columnar``: the agent's columnar GPU sample comes back as ``GpuColumns`` when the
    fast path reads it (diagnosis's hot path); every other payload as its record."""
    if payload is None:
        raise SchemaError("tombstone", kind=kind, detail="a null value (tombstone) carries no record")
    if not payload:
        raise SchemaError("empty_message", kind=kind)
    if len(payload) > schema.MAX_MESSAGE_BYTES:
        raise SchemaError("oversized", kind=kind, detail=f"{len(payload)} bytes > {schema.MAX_MESSAGE_BYTES}")
    if kind not in schema.RECORDS:
        raise SchemaError("unknown_kind", kind=kind)
    if is_msgpack(payload, content_type):
        return _decode_msgpack(kind, payload, issues, bounds, columnar)
    try:
        record = json_decoder(kind).decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        pass
    else:
        return _check(record, kind, bounds)
    return from_obj(kind, _parse_json(payload, kind), issues, bounds=bounds)


def _decode_msgpack(kind: str, payload: bytes | str, issues: list[FieldIssue] | None,
                    bounds: TimeBounds | None = None, columnar: bool = False) -> Any:
    if isinstance(payload, str):
        raise SchemaError("malformed_msgpack", kind=kind, detail="text is not MessagePack")
    try:
        obj = _ANY_MSGPACK.decode(payload)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise SchemaError("malformed_msgpack", kind=kind, detail=str(exc)) from None
    if kind == "gpu" and isinstance(obj, dict) and "n" in obj and "gpus" not in obj:
        record = gpu_columns(obj) if columnar else columnar_gpu_fast(obj)
        if record is not None:
            return _check(record, kind, bounds)  # the same time bounds as every other path (2100, 1970)
        obj = columns_to_obj(obj, kind)
    return from_obj(kind, obj, issues, bounds=bounds)
