"""Batches of bus messages -> lake Arrow tables, through the one decoder (faultlens/decode.py).

The stream processor hands one topic partition's batch here. Records come from
``decode`` (or, for a whole batch at once, from the same typed msgspec decoders
in one call); this module only lays them out as Arrow columns, and turns the
decoder's reports into dead letters and quarantine rows.

Two fast paths, each falling back to message-by-message decoding (which gives
the same rows) when anything in the batch is off:

* JSON gpu samples: the batch is wrapped as one JSON array and decoded by the
  typed decoder in one call; GPU rows go to Arrow column by column.
* The agent's columnar MessagePack gpu samples (``decode.encode_wire``): the
  batch is wrapped as one MessagePack array and decoded in one call; each
  column's little-endian bytes of the whole batch are joined into one Arrow
  buffer, so no value is ever a Python object.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from faultlens import decode as dec
from faultlens import gpu_wire, schema
from faultlens.errors import SchemaError
from faultlens.stream.lake import table_name

DEADLETTER_PAYLOAD_MAX = 64 * 1024  # bytes of a message kept in the lake (dead letter, quarantine)
_GPU_LAKE = schema.lake_schema("gpu")
_ARROW_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError)
_GPU_FIELDS = schema.field_names(schema.GpuState)
_NP = {"d": np.float64, "q": np.int64}


@dataclass
class Decoded:
    """What one topic-partition batch of messages became."""

    tables: dict[str, pa.Table] = field(default_factory=dict)  # lake table -> rows
    dead: list[schema.DeadLetter] = field(default_factory=list)
    quarantine: list[schema.Quarantine] = field(default_factory=list)  # fields nulled
    unknown: dict[str, int] = field(default_factory=dict)  # unknown key -> messages that had it


def dead_letter(topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
                err: SchemaError) -> schema.DeadLetter:
    """The dead letter of one message (payload kept up to 64 KB, ``size`` the real size)."""
    raw = value or b""
    kept = raw[:DEADLETTER_PAYLOAD_MAX]
    return schema.DeadLetter(
        ts=time.time(), topic=topic, partition=partition, offset=offset, reason=err.reason,
        detail=(err.detail + (f" (payload truncated to {len(kept)} bytes)" if len(kept) < len(raw) else ""))[:2000],
        key=key.decode("utf-8", "backslashreplace") if key else None,
        payload=_payload_text(kept), size=len(raw),
    )  # fmt: skip


def _payload_text(raw: bytes) -> str:
    if dec.is_msgpack(raw):  # binary: kept as JSON text of what it holds when it parses at all
        try:
            return schema._JSON.encode(msgspec.msgpack.decode(raw)).decode()[:DEADLETTER_PAYLOAD_MAX]
        except (msgspec.DecodeError, msgspec.EncodeError, TypeError, ValueError):
            return raw.hex()[:DEADLETTER_PAYLOAD_MAX]
    return raw.decode("utf-8", "backslashreplace")


def content_type(record: Any) -> str | None:
    """The ``content-type`` header of a consumer record (kafka-python: ``headers`` pairs)."""
    for k, v in getattr(record, "headers", None) or ():
        if k == dec.CONTENT_TYPE_HEADER:
            return v.decode("latin-1") if isinstance(v, (bytes, bytearray)) else str(v)
    return None


def _quarantine(kind: str, partition: int, r: Any, node: str | None, issues: list[dec.FieldIssue],
                out: Decoded) -> None:
    now = time.time()
    payload: str | None = None
    for i in issues:
        if i.reason == dec.UNKNOWN_FIELD:
            out.unknown[i.field] = out.unknown.get(i.field, 0) + 1
            continue
        if payload is None:
            payload = _payload_text((r.value or b"")[:DEADLETTER_PAYLOAD_MAX])
        out.quarantine.append(schema.Quarantine(ts=now, topic=kind, field=i.field, reason=i.reason, value=i.value,
                                                node=node, partition=partition, offset=r.offset, payload=payload))


# --------------------------------------------------------------------------- gpu rows


def gpu_table(records: Sequence[schema.GpuSample]) -> pa.Table:
    """GPU samples -> gpu lake rows (one per GPU), column by column."""
    counts = [len(s.gpus) for s in records]
    parents = np.repeat(np.arange(len(records)), counts)
    head = {
        "ts": pa.array([s.ts for s in records], pa.float64()).take(parents),
        "node": pa.array([s.node for s in records], pa.string()).take(parents),
        "job": pa.array([s.job for s in records], pa.string()).take(parents),
    }
    tuples = [msgspec.structs.astuple(g) for s in records for g in s.gpus]
    columns = list(zip(*tuples, strict=True)) if tuples else [()] * len(_GPU_FIELDS)
    arrays = []
    for f in _GPU_LAKE:
        if f.name in head:
            arrays.append(head[f.name])
            continue
        col = columns[_GPU_FIELDS.index("index" if f.name == "gpu" else f.name)]
        np_type = np.float64 if pa.types.is_floating(f.type) else np.int64 if pa.types.is_integer(f.type) else None
        if np_type is not None and None not in col:
            arrays.append(pa.array(np.fromiter(col, np_type, len(col)), f.type))
        else:
            arrays.append(pa.array(col, f.type))
    return pa.Table.from_arrays(arrays, schema=_GPU_LAKE)


_JSON_GPU_BATCH = msgspec.json.Decoder(list[schema.GpuSample])


def _json_gpu_batch(values: Sequence[bytes]) -> list[schema.GpuSample] | None:
    """Every message of the batch through the typed decoder in one call; None if any is off."""
    try:
        recs = _JSON_GPU_BATCH.decode(b"[" + b",".join(values) + b"]")
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError):
        return None
    readable = schema.READABLE_VERSIONS
    if len(recs) != len(values) or any(s.v not in readable for s in recs):
        return None  # a message that held two objects, or a version we cannot read
    if not _times_in_bounds([s.ts for s in recs]):
        return None  # a stamp in ms, at 2100 or 1970: the per-message decoder dead-letters it, with the reason
    return recs


def _times_in_bounds(times: Any) -> bool:
    """Every time of a batch finite and inside the decoder's bounds (decode.TimeBounds)."""
    ts = np.asarray(times, np.float64)
    if not len(ts):
        return True
    bounds = dec.time_bounds()
    return bool(np.isfinite(ts).all()) and bounds.earliest_ts <= float(ts.min()) and float(ts.max()) <= bounds.latest()


class _Columns(msgspec.Struct, gc=False):
    """The agent's columnar MessagePack gpu sample (decode.encode_wire), for the batch path.

    Untracked by the garbage collector (``gc=False``; decoded from bytes, it can hold no
    reference back to itself): a batch is thousands of them."""

    ts: float
    node: str
    n: int
    cols: str
    data: bytes
    job: str | None = None
    v: int = schema.SCHEMA_VERSION
    uuid: str | None = None
    pci_bus: str | None = None
    nulls: dict[str, Any] | None = None


_MSGPACK_GPU_BATCH = msgspec.msgpack.Decoder(list[_Columns])
_TS, _NODE, _JOB, _N, _V, _COLS, _DATA, _NULLS = (
    attrgetter(k) for k in ("ts", "node", "job", "n", "v", "cols", "data", "nulls"))
_CODES = dict(dec.GPU_COLUMNS)
_LAKE_TYPES = {f.name: f.type for f in _GPU_LAKE}


def _msgpack_gpu_batch(values: Sequence[bytes]) -> pa.Table | None:
    """Columnar samples -> gpu lake rows, one numpy matrix per layout; None if anything is off.

    Per message only C-level maps run (attribute fetches, one join); no value
    becomes a Python object, except the strings (uuid, pci_bus).
    """
    n_msgs = len(values)
    head = b"\xdd" + n_msgs.to_bytes(4, "big")  # a MessagePack array of the batch's messages
    try:
        msgs = _MSGPACK_GPU_BATCH.decode(head + b"".join(values))
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError):
        return None
    counts = list(map(_N, msgs))
    if (not set(map(_V, msgs)) <= schema.READABLE_VERSIONS or min(counts) < 0 or not all(map(_NODE, msgs))
            or any(map(_NULLS, msgs)) or not gpu_wire.LITTLE_ENDIAN_8):
        return None
    cols = list(map(_COLS, msgs))
    if len(set(cols)) == 1 and len(set(counts)) == 1:
        groups = [(cols[0], counts[0], msgs)]  # the common case: one layout
    else:  # group by layout without a Python loop per message
        key = pc.dictionary_encode(pa.array(cols, pa.string())).indices.to_numpy().astype(np.int64)
        key = key * (max(counts) + 1) + np.asarray(counts, np.int64)
        order = np.argsort(key, kind="stable")
        _, starts = np.unique(key[order], return_index=True)
        groups = []
        for a, b in zip(starts, [*starts[1:], n_msgs], strict=True):
            idx = order[a:b].tolist()
            part = [msgs[i] for i in idx] if len(idx) < 2 else list(itemgetter(*idx)(msgs))
            groups.append((cols[idx[0]], counts[idx[0]], part))
    tables = []
    for layout, n, part in groups:
        table = _layout_table(part, layout, n)
        if table is None:
            return None
        tables.append(table)
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables)


def _layout_table(msgs: list[_Columns], cols: str, n: int) -> pa.Table | None:
    """Samples of one layout (same columns, same GPU count) -> gpu lake rows."""
    names = cols.split(",") if cols else []
    if "index" not in names or any(_CODES.get(c, "s") == "s" for c in names) or len(set(names)) != len(names):
        return None
    m, width = len(msgs), 8 * n * len(names)
    blobs = list(map(_DATA, msgs))
    if list(map(len, blobs)) != [width] * m:
        return None
    times = list(map(_TS, msgs))
    if not _times_in_bounds(times):
        return None  # the per-message decoder says which message and why
    ts = pa.array(times, pa.float64())
    # One copy puts every column's values of the batch side by side (column-major).
    floats = np.frombuffer(b"".join(blobs), "<f8").reshape(m, len(names), n).transpose(1, 0, 2).reshape(len(names), m * n)
    ints = floats.view("<i8")
    parents = np.repeat(np.arange(m), n)
    jobs = list(map(_JOB, msgs))
    job = (pa.array(jobs[:1], pa.string()).take(np.zeros(m * n, np.int64)) if jobs.count(jobs[0]) == m
           else pa.array(jobs, pa.string()).take(parents))
    arrays: dict[str, Any] = {
        "ts": ts.take(parents),
        "node": pa.array(list(map(_NODE, msgs)), pa.string()).take(parents),
        "job": job,
    }
    for j, name in enumerate(names):
        lake = "gpu" if name == "index" else name
        target = _LAKE_TYPES[lake]
        if _CODES[name] == "d":
            col = floats[j]
            if not np.isfinite(col).all():
                return None  # NaN/Infinity: the table nulls and reports them, message by message
            arrays[lake] = pa.array(col, target)
        elif pa.types.is_boolean(target):
            arrays[lake] = pa.array(ints[j] != 0, target)
        else:
            arrays[lake] = pa.array(ints[j], target)
    total = m * n
    for name in dec.GPU_STRINGS:  # n strings joined by newlines per sample
        pieces = list(map(attrgetter(name), msgs))
        if pieces.count(None) == m:
            arrays[name] = pa.array([""] * total, pa.string())
            continue
        if None in pieces:
            pieces = ["\n".join([""] * n) if p is None else p for p in pieces]
        try:
            split = pc.split_pattern(pa.array(pieces, pa.string()), "\n")
        except _ARROW_ERRORS:
            return None
        if n == 0 or not pc.all(pc.equal(pc.list_value_length(split), n)).as_py():
            return None
        arrays[name] = split.flatten()
    for f in _GPU_LAKE:
        if f.name not in arrays:  # a column at its default (0) in every sample
            arrays[f.name] = _zeros(f.type, total)
    return pa.Table.from_arrays([arrays[f.name] for f in _GPU_LAKE], schema=_GPU_LAKE)


_ZEROS: dict[pa.DataType, pa.Array] = {}


def _zeros(type_: pa.DataType, n: int) -> pa.Array:
    """``n`` zeros (false) of a type: a zero-copy slice of a cached array."""
    cached = _ZEROS.get(type_)
    if cached is None or len(cached) < n:
        size = max(n, 1 << 17)
        if pa.types.is_boolean(type_):
            cached = pa.array(np.zeros(size, np.bool_), type_)
        else:
            cached = pa.array(np.zeros(size, np.float64 if pa.types.is_floating(type_) else np.int64), type_)
        _ZEROS[type_] = cached
    return cached.slice(0, n)


# --------------------------------------------------------------------------- one batch


def decode_batch(kind: str, topic: str, partition: int, records: Sequence[Any]) -> Decoded:
    """Consumer records (``.offset .key .value [.headers]``) of one partition -> lake tables, dead letters, quarantine."""
    out = Decoded()
    if kind == "gpu" and records:
        table = _fast_gpu(records)
        if table is not None:
            out.tables["gpu"] = table
            return out
    decoded: list[tuple[Any, Any]] = []
    for r in records:
        issues: list[dec.FieldIssue] = []
        try:
            rec = dec.decode(kind, r.value, content_type=content_type(r), issues=issues)
        except SchemaError as err:
            out.dead.append(dead_letter(topic, partition, r.offset, r.key, r.value, err))
            continue
        except (ValueError, TypeError, RecursionError) as exc:  # anything the decoder did not foresee
            unforeseen = SchemaError("undecodable", kind=kind, detail=repr(exc)[:500])
            out.dead.append(dead_letter(topic, partition, r.offset, r.key, r.value, unforeseen))
            continue
        if issues:
            _quarantine(kind, partition, r, getattr(rec, "node", None), issues, out)
        decoded.append((r, rec))
    if decoded:
        _tables(kind, topic, partition, decoded, out)
    return out


_VALUE = attrgetter("value")


def _fast_gpu(records: Sequence[Any]) -> pa.Table | None:
    """The whole batch in one typed call, when every message is of one wire format and fine."""
    values = list(map(_VALUE, records))
    if None in values:
        return None  # a tombstone: dead-lettered message by message
    lengths = list(map(len, values))
    if min(lengths) == 0 or max(lengths) > schema.MAX_MESSAGE_BYTES:
        return None
    # The first message says which batch decoder to try; each checks every message
    # (a JSON text never parses as MessagePack nor the reverse): a mix goes message by message.
    if dec.is_msgpack(values[0], content_type(records[0])):
        return _msgpack_gpu_batch(values)
    recs = _json_gpu_batch(values)
    if recs is None:
        return None
    try:
        return gpu_table(recs)
    except _ARROW_ERRORS:
        return None


def _tables(kind: str, topic: str, partition: int, decoded: list[tuple[Any, Any]], out: Decoded) -> None:
    if kind == "gpu":
        try:
            out.tables["gpu"] = gpu_table([rec for _, rec in decoded])
            return
        except _ARROW_ERRORS:
            pass  # one message's value does not fit a column: find it below
    lake_schema = schema.lake_schema(kind)
    try:
        out.tables[table_name(kind)] = pa.Table.from_pylist([row for _, rec in decoded for row in schema.lake_row(rec)],
                                                            schema=lake_schema)
        return
    except _ARROW_ERRORS:
        pass  # a value the record holds but the lake column cannot (an integer beyond 64 bits)
    kept: list[dict[str, Any]] = []
    for r, rec in decoded:
        rows = schema.lake_row(rec)
        try:
            pa.Table.from_pylist(rows, schema=lake_schema)
        except _ARROW_ERRORS as exc:
            err = SchemaError("bad_type", kind=kind, detail=f"does not fit the lake column: {exc}")
            out.dead.append(dead_letter(topic, partition, r.offset, r.key, r.value, err))
            continue
        kept.extend(rows)
    if kept:
        out.tables[table_name(kind)] = pa.Table.from_pylist(kept, schema=lake_schema)
