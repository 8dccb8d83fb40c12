"""The agent's MessagePack wire for GPU samples: columnar, and read without a Python object per value.

``encode_wire`` writes it (faultlens's own agent, ``content-type: application/msgpack``);
``columns_to_obj`` turns it back into the JSON-shaped object the tolerant decoder reads
(faultlens/decode.py); ``gpu_columns`` is the fast path for a well-formed sample, kept
columnar (``GpuColumns``) until a reader needs GpuStates.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any, ClassVar

import msgspec

from faultlens import schema
from faultlens.coercion import MAX_TS, field_plan, to_bool, to_float, to_int, to_str
from faultlens.coercion import text_of as _text
from faultlens.errors import SchemaError
from faultlens.schema import GpuSample, GpuState

JSON_TYPE = "application/json"
MSGPACK_TYPE = "application/msgpack"
LITTLE_ENDIAN_8 = array("d").itemsize == 8 and array("q").itemsize == 8 and sys.byteorder == "little"


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
    (f.name, {to_float: "d", to_int: "q", to_bool: "q", to_str: "s"}[f.coerce]) for f in field_plan(GpuState)
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
    if not LITTLE_ENDIAN_8:
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


def _fastfield_plan(cols: str) -> tuple[tuple[str, str], ...] | None:
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
        span = column_spans(self.cols, self.n).get(name)
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
        plan = _fastfield_plan(self.cols) or ()
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
_BOOL_GPU_FIELDS = frozenset(f.name for f in field_plan(GpuState) if f.coerce is to_bool)


def column_spans(cols: str, n: int) -> dict[str, tuple[int, int]]:
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
    plan = _fastfield_plan(cols)
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
    if runs is None or len(data) != 8 * n * len(_fastfield_plan(cols) or ()):
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


def columnar_gpu_fast(obj: dict[str, Any]) -> GpuSample | None:
    """The agent's well-formed columnar sample -> its record (gpu_columns' checks, then the record); None:
    anything unusual, which the careful path reads and reports."""
    columns = gpu_columns(obj)
    if columns is None:
        return None
    try:
        return columns.record()
    except msgspec.ValidationError:
        return None
