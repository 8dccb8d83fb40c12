"""DuckDB over the lake: the processor's catalog (offset manifest) and read views.

Two things live here:

* ``Catalog``: the stream processor's own DuckDB file. Its ``manifest`` table
  holds one row per lake file the processor committed, with the topic
  partition and offset range the rows came from. The authoritative copy of
  each commit is also a small Parquet file in ``<lake>/_manifest/`` (written
  atomically, and it is the commit point): DuckDB lets only one process open
  the catalog file, but every processor instance of a consumer group must see
  the offsets of partitions it takes over, so they all read the lake's copy.
* ``open_lake(lake_path)``: an in-memory DuckDB connection with one view per
  lake table, the rollup views ``gpu_1m``/``steps_1m``, ``incidents_latest``
  and ``actions_status``. Tables with no files yet are empty views with the
  right columns, so queries never fail on a young lake.

Rollups: at every commit the processor writes *partial* per-minute aggregates
(count, sum, min, max) of the rows in that commit; the views merge partials of
the same key, so a minute spread over several commits is still exact.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from faultlens import schema
from faultlens.errors import LakeError
from faultlens.stream.lake import MANIFEST_DIR, table_name, write_parquet_atomic

MANIFEST_SCHEMA = pa.schema(
    [
        pa.field("commit_id", pa.string(), False),
        pa.field("committed_ts", pa.float64(), False),
        pa.field("kind", pa.string(), False),  # record kind of the source topic
        pa.field("topic", pa.string(), False),
        pa.field("partition", pa.int64(), False),
        pa.field("first_offset", pa.int64(), False),
        pa.field("last_offset", pa.int64(), False),
        pa.field("lake_table", pa.string()),  # null: a range with no rows (all messages empty)
        pa.field("file", pa.string()),  # relative to the lake root
        pa.field("rows", pa.int64(), False),
    ]
)

_MANIFEST_DDL = """
CREATE TABLE IF NOT EXISTS manifest (
    commit_id VARCHAR NOT NULL, committed_ts DOUBLE NOT NULL, kind VARCHAR NOT NULL,
    topic VARCHAR NOT NULL, "partition" BIGINT NOT NULL, first_offset BIGINT NOT NULL,
    last_offset BIGINT NOT NULL, lake_table VARCHAR, file VARCHAR, "rows" BIGINT NOT NULL
)
"""


def _duckdb() -> Any:
    try:
        import duckdb
    except ImportError as exc:  # pragma: no cover - server extra
        raise LakeError("the lake catalog needs duckdb: pip install 'faultlens[server]'") from exc
    return duckdb


def manifest_glob(lake: Path) -> str:
    return (lake / MANIFEST_DIR / "m-*.parquet").as_posix()


def sql_literal(text: str) -> str:
    """``text`` as one SQL string literal: a lake path with ``'`` (or ``"``, spaces) stays one path.

    Views cannot take bound parameters, so their paths are quoted here; a statement that can
    binds them instead (``read_parquet(?)``)."""
    if "\x00" in text:
        raise LakeError(f"a path with a NUL character cannot be read: {text!r}")
    return "'" + text.replace("'", "''") + "'"


class Catalog:
    """The processor's DuckDB file: the offset manifest, mirrored from the lake."""

    def __init__(self, path: str | os.PathLike[str], lake_path: str | os.PathLike[str]):
        duckdb = _duckdb()
        self.path = Path(path)
        self.lake = Path(lake_path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = duckdb.connect(str(self.path))
        except duckdb.Error as exc:
            raise LakeError(f"cannot open the catalog {self.path}: {exc}") from exc
        self.db.execute(_MANIFEST_DDL)

    def close(self) -> None:
        self.db.close()

    # -- commits

    def commit(self, commit_id: str, rows: list[dict[str, Any]]) -> None:
        """Record one commit: the lake copy first (the commit point), then this file."""
        now = time.time()
        for r in rows:
            r.setdefault("commit_id", commit_id)
            r.setdefault("committed_ts", now)
        table = pa.Table.from_pylist(rows, schema=MANIFEST_SCHEMA)
        write_parquet_atomic(self.lake / MANIFEST_DIR / f"m-{commit_id}.parquet", table)
        self._insert(table)

    def _insert(self, table: pa.Table) -> None:
        self.db.register("_new_manifest", table)
        try:
            self.db.execute("INSERT INTO manifest SELECT * FROM _new_manifest")
        finally:
            self.db.unregister("_new_manifest")

    def sync_from_lake(self) -> int:
        """Copy commits present in the lake but not here (other instances, a crash). Returns rows added."""
        if not any((self.lake / MANIFEST_DIR).glob("m-*.parquet")):
            return 0
        before = self.db.execute("SELECT count(*) FROM manifest").fetchone()[0]
        self.db.execute(
            f"""INSERT INTO manifest SELECT {", ".join(f'"{n}"' for n in MANIFEST_SCHEMA.names)}
                FROM read_parquet(?) m
                WHERE m.commit_id NOT IN (SELECT DISTINCT commit_id FROM manifest)""",
            [manifest_glob(self.lake)],
        )
        # Merged manifest files may repeat rows; keep one of each.
        self.db.execute("CREATE OR REPLACE TEMP TABLE _m AS SELECT DISTINCT * FROM manifest")
        self.db.execute("DELETE FROM manifest")
        self.db.execute("INSERT INTO manifest SELECT * FROM _m")
        self.db.execute("DROP TABLE _m")
        return self.db.execute("SELECT count(*) FROM manifest").fetchone()[0] - before

    # -- reading

    def next_offsets(self, topics: Iterable[str] | None = None) -> dict[tuple[str, int], int]:
        """(topic, partition) -> the offset to consume next: last committed + 1.

        "Last" is the most recent commit, not the highest offset: a broker that
        lost its log (the memory-only embedded one) restarts its offsets at 0.
        """
        rows = self.db.execute(
            """SELECT topic, "partition", arg_max(last_offset, (committed_ts, last_offset))
               FROM manifest GROUP BY ALL"""
        ).fetchall()
        wanted = set(topics) if topics is not None else None
        return {(t, p): o + 1 for t, p, o in rows if wanted is None or t in wanted}

    def commit_ids(self) -> set[str]:
        """Every commit the manifest holds (stream/dedupe.py keeps only their ``_seq`` files)."""
        return {r[0] for r in self.db.execute("SELECT DISTINCT commit_id FROM manifest").fetchall()}

    def committed_files(self) -> set[str]:
        return {r[0] for r in self.db.execute("SELECT DISTINCT file FROM manifest WHERE file IS NOT NULL").fetchall()}

    def rows_by_table(self) -> dict[str, int]:
        return dict(self.db.execute('SELECT lake_table, sum("rows") FROM manifest WHERE lake_table IS NOT NULL GROUP BY ALL').fetchall())


# --------------------------------------------------------------------------- rollups (partials)

GPU_GAUGES = ("temp_c", "power_w", "util", "sm_clock_mhz")
GPU_COUNTERS = (
    "ecc_sbe", "ecc_dbe", "retired_pages", "remapped_rows_unc", "pcie_replay",
    "nvlink_errors", "nvlink_crc_errors", "nvlink_replay_errors", "nvlink_recovery_errors",
)  # fmt: skip


def _minute(ts: pa.ChunkedArray | pa.Array) -> pa.Array:
    return pc.multiply(pc.floor(pc.divide(ts, 60.0)), 60.0)


def gpu_rollup_partial(gpu: pa.Table) -> pa.Table:
    """Per (job, node, gpu, minute) partial aggregates of ``gpu`` lake rows."""
    t = gpu.select(["job", "node", "gpu", "ts", *GPU_GAUGES, "mem_used_mb", "throttle_reasons", *GPU_COUNTERS])
    t = t.append_column("minute", _minute(t.column("ts")))
    aggs: list[tuple[str, str]] = [("ts", "count")]
    for g in GPU_GAUGES:
        aggs += [(g, "sum"), (g, "max")]
    aggs += [("sm_clock_mhz", "min"), ("mem_used_mb", "max"), ("throttle_reasons", "max")]
    for c in GPU_COUNTERS:
        aggs += [(c, "min"), (c, "max")]
    out = t.group_by(["job", "node", "gpu", "minute"], use_threads=False).aggregate(aggs)
    return out.rename_columns([n.replace("ts_count", "n") for n in out.column_names])


def steps_rollup_partial(steps: pa.Table) -> pa.Table:
    """Per (job, rank, node, minute) partial aggregates of ``steps`` lake rows."""
    t = steps.select(["job", "rank", "node", "ts", "duration_s", "tokens", "step"])
    t = t.append_column("minute", _minute(t.column("ts")))
    out = t.group_by(["job", "rank", "node", "minute"], use_threads=False).aggregate(
        [("ts", "count"), ("duration_s", "sum"), ("duration_s", "max"), ("duration_s", "min"),
         ("tokens", "sum"), ("step", "min"), ("step", "max")]
    )  # fmt: skip
    return out.rename_columns([n.replace("ts_count", "n") for n in out.column_names])


def rollup_schema(table: str) -> pa.Schema:
    """Arrow schema of a rollup partial table (derived from an empty aggregation)."""
    kind = {"gpu_1m": "gpu", "steps_1m": "steps"}[table]
    empty = schema.lake_schema(kind).empty_table()
    return (gpu_rollup_partial if kind == "gpu" else steps_rollup_partial)(empty).schema


_GPU_1M_SQL = (
    "SELECT job, node, gpu, minute, to_timestamp(minute) AS time, sum(n) AS samples, "
    + ", ".join(f"sum({g}_sum) / sum(n) AS {g}_avg, max({g}_max) AS {g}_max" for g in GPU_GAUGES)
    + ", min(sm_clock_mhz_min) AS sm_clock_mhz_min, max(mem_used_mb_max) AS mem_used_mb_max"
    + ", max(throttle_reasons_max) AS throttle_reasons_max, "
    + ", ".join(f"max({c}_max) AS {c}, max({c}_max) - min({c}_min) AS {c}_delta" for c in GPU_COUNTERS)
    + " FROM {src} GROUP BY job, node, gpu, minute"
)
_STEPS_1M_SQL = (
    "SELECT job, rank, node, minute, to_timestamp(minute) AS time, sum(n) AS steps, "
    "sum(duration_s_sum) / sum(n) AS duration_s_avg, max(duration_s_max) AS duration_s_max, "
    "min(duration_s_min) AS duration_s_min, sum(tokens_sum) AS tokens, "
    "min(step_min) AS step_min, max(step_max) AS step_max FROM {src} GROUP BY job, rank, node, minute"
)


# --------------------------------------------------------------------------- read views

LAKE_TABLES = tuple(table_name(k) for k in schema.RECORDS)


def _empty_select(arrow_schema: pa.Schema) -> str:
    duck = {
        pa.float64(): "DOUBLE", pa.int64(): "BIGINT", pa.bool_(): "BOOLEAN", pa.string(): "VARCHAR",
    }  # fmt: skip
    cols = [f'CAST(NULL AS {duck.get(f.type, "VARCHAR")}) AS "{f.name}"' for f in arrow_schema]
    cols += ["CAST(NULL AS DATE) AS date", "CAST(NULL AS BIGINT) AS hour"]
    return f"SELECT {', '.join(cols)} WHERE false"


def _source(lake: Path, table: str, arrow_schema: pa.Schema) -> str:
    if not any((lake / table).glob("date=*/hour=*/*.parquet")):
        return f"({_empty_select(arrow_schema)})"
    glob = (lake / table / "date=*" / "hour=*" / "*.parquet").as_posix()
    return (f"read_parquet({sql_literal(glob)}, hive_partitioning=true, union_by_name=true, "
            "hive_types={'date': DATE, 'hour': BIGINT})")


def create_views(db: Any, lake_path: str | os.PathLike[str]) -> None:
    """(Re)create every lake view on ``db``; call again to see tables that got their first file."""
    lake = Path(lake_path)
    kinds = {table_name(k): k for k in schema.RECORDS}
    for table, kind in kinds.items():
        db.execute(f"CREATE OR REPLACE VIEW {table} AS SELECT * FROM {_source(lake, table, schema.lake_schema(kind))}")
    for table, sql in (("gpu_1m", _GPU_1M_SQL), ("steps_1m", _STEPS_1M_SQL)):
        db.execute(f"CREATE OR REPLACE VIEW {table} AS {sql.format(src=_source(lake, table, rollup_schema(table)))}")
    db.execute(
        "CREATE OR REPLACE VIEW incidents_latest AS SELECT * FROM incidents "
        # Two versions can share updated_ts (opened and decided in one engine pass): the one
        # further along (mitigated/resolved over open, with suspects over without) is the latest.
        "QUALIFY row_number() OVER (PARTITION BY id ORDER BY updated_ts DESC, "
        "CASE status WHEN 'resolved' THEN 2 WHEN 'mitigated' THEN 1 ELSE 0 END DESC, length(suspects) DESC) = 1"
    )
    db.execute(
        """CREATE OR REPLACE VIEW actions_status AS
           WITH latest AS (
               SELECT * FROM action_status
               QUALIFY row_number() OVER (PARTITION BY action_id ORDER BY ts DESC) = 1)
           SELECT a.*, s.status AS status, s.adapter AS adapter, s.detail AS status_detail,
                  s.ts AS status_ts
           FROM (SELECT * FROM actions
                 QUALIFY row_number() OVER (PARTITION BY id ORDER BY ts DESC) = 1) a
           LEFT JOIN latest s ON s.action_id = a.id"""
    )
    if any((lake / MANIFEST_DIR).glob("m-*.parquet")):
        db.execute(f"CREATE OR REPLACE VIEW manifest AS SELECT * FROM read_parquet({sql_literal(manifest_glob(lake))})")
    else:
        db.execute(f"CREATE OR REPLACE VIEW manifest AS {_empty_select(MANIFEST_SCHEMA)}")


def open_lake(lake_path: str | os.PathLike[str]) -> Any:
    """An in-memory DuckDB connection with a view per lake table (read-only use).

    >>> db = open_lake("lake")                                     # doctest: +SKIP
    >>> db.sql("SELECT node, max(temp_c_max) FROM gpu_1m GROUP BY node").fetchall()  # doctest: +SKIP
    """
    db = _duckdb().connect(":memory:")
    create_views(db, lake_path)
    return db


def lake_row_counts(lake_path: str | Path) -> dict[str, int]:
    """Rows per lake table, read through DuckDB (for tools and tests)."""
    db = open_lake(lake_path)
    try:
        return {t: db.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in LAKE_TABLES}
    finally:
        db.close()
