"""The Parquet lake: Hive-partitioned tables written atomically.

Layout: ``<lake>/<table>/date=YYYY-MM-DD/hour=HH/<name>.parquet`` (UTC), where
``<table>`` is the record kind with ``-`` replaced by ``_`` (``action-status``
-> ``action_status``), plus the rollup tables ``gpu_1m`` and ``steps_1m``.

Every file is written to a hidden temporary name beside its final place
(``.<name>.parquet.tmp``, which no ``*.parquet`` glob matches), fsynced, then
renamed; the directory is fsynced after the rename. A reader therefore sees a
file whole or not at all. File names say who wrote them:

* ``<kind>-p<partition>-o<first>-<last>-<commit>.parquet``: the stream processor,
  rows of offsets first..last of one topic partition (see stream.processor);
* ``w-<uuid>.parquet``: ``LakeWriter.write``/``write_rows``/``write_table``
  called directly (batch diagnosis, tests, tools that have no Kafka);
* ``c-<uuid>.parquet``: compaction output (stream.compaction).
"""

from __future__ import annotations

import datetime as _dt
import os
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from faultlens import schema
from faultlens.errors import LakeError
from faultlens.files import fsync_dir

MANIFEST_DIR = "_manifest"
PARQUET_COMPRESSION = "zstd"
PARQUET_COMPRESSION_LEVEL = 1  # fast enough for the ingest target, ~2x smaller than snappy here


def table_name(kind: str) -> str:
    """Lake table of a record kind: ``action-status`` -> ``action_status``."""
    return kind.replace("-", "_")


# The column that decides the date/hour partition of a row.
PARTITION_COLUMN = {"incidents": "updated_ts", "gpu_1m": "minute", "steps_1m": "minute"}


def partition_column(table: str) -> str:
    return PARTITION_COLUMN.get(table, "ts")


def hour_path(table: str, hour_index: int) -> str:
    """``<table>/date=YYYY-MM-DD/hour=HH`` of an hour counted from the epoch (UTC)."""
    t = _dt.datetime.fromtimestamp(hour_index * 3600, _dt.UTC)
    return f"{table}/date={t:%Y-%m-%d}/hour={t:%H}"


def dictionary_columns(schema_: pa.Schema) -> list[str]:
    """The columns worth a Parquet dictionary: strings (node, job, uuid...). Numbers go plain, which
    zstd packs as well or better (benchmarks/ingest.py: gpu files 5% smaller, rollup files 10%)
    and which costs 10-20% less CPU to write than trying a dictionary on every column."""
    return [f.name for f in schema_ if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)
            or pa.types.is_dictionary(f.type)]


def write_parquet_atomic(path: Path, table: pa.Table) -> None:
    """Write ``table`` to ``path`` so that readers see all of it or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            pq.write_table(
                table, f, compression=PARQUET_COMPRESSION, compression_level=PARQUET_COMPRESSION_LEVEL,
                use_dictionary=dictionary_columns(table.schema),
            )
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        raise LakeError(f"writing {path} failed: {exc}") from exc


def split_by_hour(table_name_: str, table: pa.Table) -> list[tuple[int, pa.Table]]:
    """The rows of ``table`` grouped by the UTC hour of its partition column."""
    if table.num_rows == 0:
        return []
    col = table.column(partition_column(table_name_))
    hours = pc.cast(pc.floor(pc.divide(pc.cast(col, pa.float64()), 3600.0)), pa.int64())
    lo, hi = pc.min_max(hours).values()
    if lo.as_py() == hi.as_py():
        return [(lo.as_py(), table)]
    out = []
    for h in pc.unique(hours).to_pylist():
        out.append((h, table.filter(pc.equal(hours, h))))
    return out


class LakeWriter:
    """Puts rows into the lake without Kafka.

    >>> LakeWriter("lake").write("kernel", [schema.KernelEvent(ts=1.0, node="n1", kind="xid", raw="...")])  # doctest: +SKIP

    Each call writes new files (one per table hour); nothing is ever rewritten
    in place, so concurrent readers are safe. Incidents are versioned by
    ``updated_ts``: write every version, the ``incidents_latest`` view picks
    the last one.
    """

    def __init__(self, lake_path: str | os.PathLike[str]):
        self.root = Path(lake_path)

    def write(self, kind: str, records: Iterable[Any]) -> list[Path]:
        """Records of ``kind`` (faultlens.schema dataclasses) -> new lake files."""
        rows: list[dict[str, Any]] = []
        for record in records:
            if type(record).KIND != kind:
                raise LakeError(f"a {type(record).KIND} record given to write({kind!r})")
            rows.extend(schema.lake_row(record))
        return self.write_rows(kind, rows)

    def write_rows(self, kind: str, rows: Sequence[dict[str, Any]]) -> list[Path]:
        """Lake rows (dicts shaped as ``schema.lake_row`` makes them) -> new lake files."""
        if not rows:
            return []
        try:
            table = pa.Table.from_pylist(list(rows), schema=schema.lake_schema(kind))
        except (pa.ArrowInvalid, pa.ArrowTypeError, KeyError) as exc:
            raise LakeError(f"rows do not fit the {kind} lake schema: {exc}") from exc
        return self.write_table(table_name(kind), table)

    def write_table(self, table: str, data: pa.Table, *, stem: str | None = None) -> list[Path]:
        """An Arrow table already in the lake schema of ``table`` -> one file per hour.

        ``stem`` names the files (``<stem>.parquet``, ``<stem>-h<hour>.parquet``
        when the rows span hours); by default ``w-<uuid>``.
        """
        return [path for path, _ in self.write_table_counted(table, data, stem=stem)]

    def write_table_counted(self, table: str, data: pa.Table, *, stem: str | None = None) -> list[tuple[Path, int]]:
        """``write_table`` that also says how many rows went to each file."""
        stem = stem or f"w-{uuid.uuid4().hex}"
        parts = split_by_hour(table, data)
        out = []
        for hour, rows in parts:
            name = f"{stem}.parquet" if len(parts) == 1 else f"{stem}-h{hour}.parquet"
            path = self.root / hour_path(table, hour) / name
            write_parquet_atomic(path, rows)
            out.append((path, rows.num_rows))
        return out

    def relative(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()
