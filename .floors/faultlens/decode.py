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
import sys
import time
from array import array
from dataclasses import dataclass
from typing import Any, ClassVar

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
from faultlens.schema import GpuSample, GpuState

JSON_TYPE = "application/json"
MSGPACK_TYPE = "application/msgpack"
CONTENT_TYPE_HEADER = "content-type"
# Kinds faultlens's agent sends as MessagePack (high volume); any other kind is JSON.
MSGPACK_KINDS = frozenset({"gpu", "steps"})

_LITTLE = array("d").itemsize == 8 and array("q").itemsize == 8 and sys.byteorder == "little"
_COERCE = {float: to_float, int: to_int, bool: to_bool, str: to_str, list: to_list, dict: to_dict}


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    coerce: Any
    optional: bool
    required: bool
    default: Any


_PLANS: dict[type, tuple[_Field, ...]] = {}


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


def _plan(cls: type) -> tuple[_Field, ...]:
    plan = _PLANS.get(cls)
    if plan is None:
        hints = schema._hints(cls)
        defaults = schema.field_defaults(cls)
        out = []
        for name in schema.field_names(cls):
            base, optional = schema._base_type(hints[name])
            origin = getattr(base, "__origin__", None) or base
            coerce = to_ts if name == "ts" else _COERCE.get(origin, to_list)
            default = defaults[name]
            out.append(_Field(name, coerce, optional, default is msgspec.NODEFAULT, default))
        plan = _PLANS[cls] = tuple(out)
    return plan


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
    plan = _plan(cls)
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


_FLOAT_GPU_FIELDS = tuple(f.name for f in _plan(GpuState) if f.coerce is to_float)


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


def is_msgpack(payload: bytes | bytearray | memoryview | str, content_type: str | bytes | None = None) -> bool:
    """MessagePack by its header, or by a first byte that is a MessagePack map marker (never JSON's)."""
    if content_type is not None:
        ct = content_type.decode("latin-1") if isinstance(content_type, (bytes, bytearray)) else content_type
        if ct.startswith(MSGPACK_TYPE):
            return True
        if ct.startswith(JSON_TYPE):
            return False
    if isinstance(payload, str) or not payload:
        return False
    b = payload[0]
    return 0x80 <= b <= 0x8F or b in (0xDE, 0xDF)


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
        record = gpu_columns(obj) if columnar else _columnar_gpu_fast(obj)
        if record is not None:
            return _check(record, kind, bounds)  # the same time bounds as every other path (2100, 1970)
        obj = columns_to_obj(obj, kind)
    return from_obj(kind, obj, issues, bounds=bounds)


# --------------------------------------------------------------------------- the agent's MessagePack

# The gpu sample goes columnar, as a map:
#   v, ts, node, job   as in JSON
#   n                  the number of GPUs
#   cols               the numeric columns present, comma-separated ("index,util,temp_c,...")
#   data               those columns' values, column after column, n each, as little-endian
#                      8-byte numbers: float64 for float fields, int64 for integer fields
#                      and for flags (0/1)
#   uuid, pci_bus      the n strings joined by newlines (left out when all empty); a
#                      string holding a newline goes to nulls instead
#   nulls              (only when a value is null) {field: [n values with nils]}
# A numeric column whose values are all at the field's default (0) is left out: the
# sparse wire. The stream processor reads the ``data`` of a whole batch as one matrix per
# layout without making a Python object of any value (stream/decode_arrow.py).
GPU_COLUMNS: tuple[tuple[str, str], ...] = tuple(
    (f.name, {to_float: "d", to_int: "q", to_bool: "q", to_str: "s"}[f.coerce]) for f in _plan(GpuState)
)
GPU_NUMERIC = tuple(name for name, code in GPU_COLUMNS if code != "s")
GPU_STRINGS = tuple(name for name, code in GPU_COLUMNS if code == "s")
_GPU_DEFAULTS = schema.field_defaults(GpuState)
_MSGPACK = msgspec.msgpack.Encoder()


def _gpu_columns(sample: GpuSample) -> dict[str, Any]:
    gpus = sample.gpus
    out: dict[str, Any] = {"v": sample.v, "ts": sample.ts, "node": sample.node, "job": sample.job, "n": len(gpus)}
    names: list[str] = []
    data = bytearray()
    nulls: dict[str, list[Any]] = {}
    for name, code in GPU_COLUMNS:
        vals = [getattr(g, name) for g in gpus]
        default = _GPU_DEFAULTS.get(name)
        if name != "index" and all(v == default and type(v) is type(default) for v in vals):
            continue
        if code == "s":
            if all(type(v) is str and "\n" not in v for v in vals):
                out[name] = "\n".join(vals)
            else:
                nulls[name] = vals
            continue
        if None in vals:
            nulls[name] = vals
            continue
        try:
            data += array(code, vals).tobytes()
        except (OverflowError, TypeError):  # a value beyond the column's type: as it is, the reader decides
            nulls[name] = vals
            continue
        names.append(name)
    if not _LITTLE:
        raise RuntimeError("the MessagePack gpu wire is little-endian; use JSON on this machine")
    out["cols"] = ",".join(names)
    out["data"] = bytes(data)
    if nulls:
        out["nulls"] = nulls
    return out


def encode_wire(record: Any) -> bytes:
    """The bytes faultlens's agent sends: MessagePack for gpu and steps, JSON for the rest."""
    kind = type(record).KIND
    if kind == "gpu":
        return _MSGPACK.encode(_gpu_columns(record))
    if kind == "steps":
        return _MSGPACK.encode(record)
    return schema.encode(record)


def content_type_of(value: bytes) -> str:
    """The ``content-type`` header value of an encoded message."""
    return MSGPACK_TYPE if is_msgpack(value) else JSON_TYPE


def columns_to_obj(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    """A columnar gpu sample -> the JSON-shaped object (a bad column nulls its field, reported later)."""
    n, cols, data = obj.get("n"), obj.get("cols", ""), obj.get("data", b"")
    if type(n) is not int or n < 0 or not isinstance(cols, str) or not isinstance(data, bytes):
        raise SchemaError("bad_gpu_entry", kind=kind, detail=f"columnar sample with n={_text(n)} cols={_text(cols)}")
    names = [c for c in cols.split(",") if c]
    if len(data) != 8 * n * len(names):
        raise SchemaError("bad_gpu_entry", kind=kind, detail=f"data holds {len(data)} bytes, not 8 x {n} x {len(names)}")
    gpus: list[dict[str, Any]] = [{} for _ in range(n)]
    codes = dict(GPU_COLUMNS)
    columns: dict[str, Any] = {}
    for j, name in enumerate(names):
        a = array("q" if codes.get(name) == "q" else "d")
        a.frombytes(data[8 * n * j: 8 * n * (j + 1)])
        columns[name] = a.tolist()
    for name in GPU_STRINGS:
        if name in obj:
            columns[name] = obj[name].split("\n") if isinstance(obj[name], str) else obj[name]
    nulls = obj.get("nulls")
    if isinstance(nulls, dict):
        columns.update(nulls)
    for name, vals in columns.items():
        if not isinstance(vals, list) or len(vals) != n:
            vals = [vals] * n  # a column that is no array of n: each GPU's value fails the table
        for g, x in zip(gpus, vals, strict=True):
            g[name] = x
    out: dict[str, Any] = {k: obj[k] for k in ("v", "ts", "node", "job") if k in obj}
    out["gpus"] = gpus
    for k in obj:
        if k not in _COLUMNAR_KEYS:
            out[k] = obj[k]  # an unknown key: reported as such
    return out


_COLUMNAR_KEYS = frozenset({"v", "ts", "node", "job", "n", "cols", "data", "nulls", *GPU_STRINGS})


# --------------------------------------------------------------------------- the columnar fast path

_FAST_KEYS = frozenset({"v", "ts", "node", "job", "n", "cols", "data", *GPU_STRINGS})
_FAST_PLANS: dict[str, tuple[tuple[str, str], ...] | None] = {}


def _fast_plan(cols: str) -> tuple[tuple[str, str], ...] | None:
    """(name, array code) of each column of a ``cols`` header, or None when the careful path must read it
    (an empty, repeated or unknown name, or no index). Cached: an agent sends the same few headers."""
    if cols in _FAST_PLANS:
        return _FAST_PLANS[cols]
    codes = dict(GPU_COLUMNS)
    names = cols.split(",")
    ok = "index" in names and len(set(names)) == len(names) and all(codes.get(n, "s") != "s" for n in names)
    plan = tuple((n, codes[n]) for n in names) if ok else None
    if len(_FAST_PLANS) < 256:
        _FAST_PLANS[cols] = plan
    return plan


class GpuColumns(msgspec.Struct, frozen=True):
    """The agent's columnar GPU sample, checked and kept as it came: numeric columns as little-endian bytes.

    What diagnosis's hot path reads (diagnosis.rules.CounterRules.steady): a sample whose counters are
    those of its node's previous sample needs no GpuState at all, so none is built; ``record()`` gives the
    GpuSample the careful path gives, for every other use. Only ``gpu_columns`` makes one (every check of
    the fast path passed); a checkpoint may hold one (the last sample of a steady run)."""

    v: int
    ts: float
    node: str
    job: str | None
    n: int
    cols: str  # the numeric columns, comma-separated, as on the wire
    data: bytes
    uuid: str | None = None  # the n strings joined by newlines, as on the wire (None: left out)
    pci_bus: str | None = None

    KIND: ClassVar[str] = "gpu"

    def column(self, name: str) -> bytes | None:
        """A numeric column's bytes (8 x n), or None when the wire left it out (every value at its default)."""
        span = _column_spans(self.cols, self.n).get(name)
        return None if span is None else self.data[span[0]:span[1]]

    def floats(self, name: str) -> list[float]:
        """A float column's values (the field's default for each GPU when the wire left it out)."""
        return self._values(name, "d")

    def ints(self, name: str) -> list[int]:
        """An integer column's values (the field's default for each GPU when the wire left it out)."""
        return self._values(name, "q")

    def _values(self, name: str, code: str) -> list[Any]:
        raw = self.column(name)
        if raw is None:
            return [_GPU_DEFAULTS[name]] * self.n
        a = array(code)
        a.frombytes(raw)
        return a.tolist()

    def record(self) -> GpuSample:
        """The GpuSample the careful path gives for these bytes."""
        plan = _fast_plan(self.cols) or ()
        view = memoryview(self.data)
        width = 8 * self.n
        names: list[str] = []
        columns: list[list[Any]] = []
        for j, (name, code) in enumerate(plan):
            values = array(code)
            values.frombytes(view[width * j: width * (j + 1)])
            names.append(name)
            columns.append(values.tolist())
        for name in GPU_STRINGS:
            text = getattr(self, name)
            if text is not None:
                names.append(name)
                columns.append(text.split("\n"))
        top: dict[str, Any] = {"v": self.v, "ts": self.ts, "node": self.node, "job": self.job,
                               "gpus": [dict(zip(names, row, strict=True)) for row in zip(*columns, strict=True)]}
        return msgspec.convert(top, GpuSample)


_SPANS: dict[tuple[str, int], dict[str, tuple[int, int]]] = {}
_BOOL_GPU_FIELDS = frozenset(f.name for f in _plan(GpuState) if f.coerce is to_bool)


def _column_spans(cols: str, n: int) -> dict[str, tuple[int, int]]:
    """name -> (start, end) of each column of a ``cols`` header in the data of n GPUs (cached)."""
    spans = _SPANS.get((cols, n))
    if spans is None:
        names = [c for c in cols.split(",") if c]
        spans = {name: (8 * n * j, 8 * n * (j + 1)) for j, name in enumerate(names)}
        if len(_SPANS) < 1024:
            _SPANS[(cols, n)] = spans
    return spans


_FLOAT_RUNS: dict[tuple[str, int], tuple[tuple[int, int], ...] | None] = {}


def _float_runs(cols: str, n: int) -> tuple[tuple[int, int], ...] | None:
    """The byte ranges of the float columns, neighbours joined (one finiteness check each); None when a
    column rules the fast path out (a flag as 0/1: the typed decode is strict about bools). Cached."""
    key = (cols, n)
    if key in _FLOAT_RUNS:
        return _FLOAT_RUNS[key]
    plan = _fast_plan(cols)
    runs: list[list[int]] = []
    ok = plan is not None
    for j, (name, code) in enumerate(plan or ()):
        if name in _BOOL_GPU_FIELDS:
            ok = False
        if code == "d":
            if runs and runs[-1][1] == 8 * n * j:
                runs[-1][1] = 8 * n * (j + 1)
            else:
                runs.append([8 * n * j, 8 * n * (j + 1)])
    out = tuple((a, b) for a, b in runs) if ok else None
    if len(_FLOAT_RUNS) < 1024:
        _FLOAT_RUNS[key] = out
    return out


def gpu_columns(obj: dict[str, Any]) -> GpuColumns | None:
    """The agent's well-formed columnar sample, checked, as GpuColumns; None: anything unusual (nulls, an
    unknown key or column, a flag column, a NaN or infinity, a value of another type, an unreadable version
    or time), which the careful path (columns_to_obj, from_obj) reads and reports.

    Why: the careful path builds each GPU's dict field by field and then checks every float of every GPU
    again; this one checks the float columns with one sum per run of them and builds nothing per GPU. Its
    ``record()`` is the record the careful path gives (tests/test_decode_fast.py compares them)."""
    if not _FAST_KEYS.issuperset(obj):
        return None
    n, cols, data = obj.get("n"), obj.get("cols"), obj.get("data")
    if type(n) is not int or type(cols) is not str or type(data) is not bytes or n < 0:
        return None
    runs = _float_runs(cols, n)
    if runs is None or len(data) != 8 * n * len(_fast_plan(cols) or ()):
        return None
    view = memoryview(data)
    for a, b in runs:
        values = array("d")
        values.frombytes(view[a:b])
        total = sum(values)  # a NaN or an infinity makes it non-finite (so may a huge sum: the careful path)
        if total - total != 0.0:
            return None
    strings: dict[str, str] = {}
    for name in GPU_STRINGS:
        if name not in obj:
            continue
        text = obj[name]
        if type(text) is not str or text.count("\n") != n - 1:
            return None
        strings[name] = text
    top: dict[str, Any] = {k: obj[k] for k in ("v", "ts", "node", "job") if k in obj}
    top["gpus"] = ()
    try:
        head: GpuSample = msgspec.convert(top, GpuSample)  # the same typed checks of v, ts, node and job
    except msgspec.ValidationError:
        return None
    ts = head.ts
    if head.v not in schema.READABLE_VERSIONS or ts - ts != 0.0 or not -MAX_TS <= ts <= MAX_TS:
        return None
    return GpuColumns(v=head.v, ts=ts, node=head.node, job=head.job, n=n, cols=cols, data=data, **strings)


def _columnar_gpu_fast(obj: dict[str, Any]) -> GpuSample | None:
    """The agent's well-formed columnar sample -> its record (gpu_columns' checks, then the record); None:
    anything unusual, which the careful path reads and reports."""
    columns = gpu_columns(obj)
    if columns is None:
        return None
    try:
        return columns.record()
    except msgspec.ValidationError:
        return None
