"""The explorer's connection to the lake, and the small query helpers every view uses.

The lake is read-only here. ``connect`` uses ``faultlens.stream.catalog.open_lake``
and adds, for any table it lacks, a view over ``LAKE/<table>/**/*.parquet`` (or an
empty view with the table's lake schema), so the explorer also works on a lake with
only some tables, e.g. one built by tests.

Rollups (``gpu_1m``, ``steps_1m``) keep the explorer fast on week-long, 1,024-GPU
jobs: heatmaps, fleet health, ETTR and the downtime ledger read only them. When a
lake has no rollup files, ``connect`` defines them as views over the raw tables
(same columns), which is fine for small lakes. Their columns are documented in
ui/README.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import duckdb
import orjson
import polars as pl
import pyarrow as pa

from faultlens.stream.catalog import LAKE_TABLES, open_lake, rollup_schema
from faultlens.stream.lake import MANIFEST_DIR
from faultlens.stream.retention import reading
from faultlens.ui.labels import LABELS_SCHEMA

# Heatmaps and timelines are sent to the browser as Vega-Lite data: Altair refuses
# more than 5,000 rows, so bins are widened in DuckDB until a chart fits.
MAX_CHART_ROWS = 5_000
# The lake of each open connection (by id; the newest 64): its queries hold the lake's reader lock,
# so retention (stream/retention.py) never drops an hour under one.
_LAKES: dict[int, Path] = {}


def is_lake(path: str | Path) -> bool:
    """Whether ``path`` holds a lake: a table directory (``incidents/``, ``gpu/``, ...) or a manifest."""
    root = Path(path)
    return root.is_dir() and (any((root / t).is_dir() for t in (*LAKE_TABLES, "gpu_1m", "steps_1m"))
                              or (root / MANIFEST_DIR).is_dir())


def _empty_select(schema: pa.Schema) -> str:
    """An empty relation with ``schema``'s columns, in SQL (registered Arrow tables are not seen by cursors)."""
    sql_type = {pa.float64(): "DOUBLE", pa.int64(): "BIGINT", pa.bool_(): "BOOLEAN"}
    cols = ", ".join(f'CAST(NULL AS {sql_type.get(f.type, "VARCHAR")}) AS "{f.name}"' for f in schema)
    return f"SELECT {cols} WHERE false"


def connect(lake_path: str | Path) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection on the lake: the stream catalog's views plus ``labels``.

    Opening is cheap (views only), so callers open one per page run and see
    tables that got their first file since.
    """
    lake = Path(lake_path)
    con = open_lake(lake)
    # The rollup partials as written (no per-minute merge): sums, min/max and
    # distinct counts over them are exact, and a week of 1,024 GPUs is 10 M rows
    # that the merged views would group key by key on every query.
    for table in ("gpu_1m", "steps_1m"):
        if any((lake / table).glob("date=*/hour=*/*.parquet")):
            glob = (lake / table / "date=*" / "hour=*" / "*.parquet").as_posix().replace("'", "''")
            con.execute(f"CREATE OR REPLACE VIEW {table}_parts AS SELECT * FROM "
                        f"read_parquet('{glob}', hive_partitioning = true, union_by_name = true)")
        else:
            con.execute(f"CREATE OR REPLACE VIEW {table}_parts AS {_empty_select(rollup_schema(table))}")
    labels = lake / "labels"
    if any(labels.glob("date=*/hour=*/*.parquet")):
        glob = (labels / "date=*" / "hour=*" / "*.parquet").as_posix().replace("'", "''")
        con.execute(
            f"CREATE OR REPLACE VIEW labels AS SELECT * FROM "
            f"read_parquet('{glob}', hive_partitioning = true, union_by_name = true)"
        )
    else:
        con.execute(f"CREATE OR REPLACE VIEW labels AS {_empty_select(LABELS_SCHEMA)}")
    _LAKES[id(con)] = lake
    while len(_LAKES) > 64:
        del _LAKES[next(iter(_LAKES))]
    return con


def query(con: duckdb.DuckDBPyConnection, sql: str, params: Iterable[Any] | None = None) -> pl.DataFrame:
    """A query's result as a polars frame."""
    lake = _LAKES.get(id(con))
    with reading(lake) if lake is not None else contextlib.nullcontext():
        frame = pl.from_arrow(con.sql(sql, params=list(params or [])).to_arrow_table())
    assert isinstance(frame, pl.DataFrame)
    return frame


def fetch_rows(con: duckdb.DuckDBPyConnection, sql: str, params: Iterable[Any] | None = None) -> list[tuple[Any, ...]]:
    """All rows of a query, fetched at once (DuckDB refuses new work while a result is half read)."""
    lake = _LAKES.get(id(con))
    with reading(lake) if lake is not None else contextlib.nullcontext():
        return con.sql(sql, params=list(params) if params else None).fetchall()


def json_or(text: Any, default: Any) -> Any:
    """A JSON column's value decoded; ``default`` when empty or not JSON."""
    if text is None or text == "":
        return default
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return default


def time_window(since: float | None, until: float | None, column: str = "ts") -> tuple[str, list[Any]]:
    """A SQL condition (and its parameters, which callers extend) for ``since <= column < until``."""
    clauses: list[str] = []
    params: list[Any] = []
    if since is not None:
        clauses.append(f"{column} >= ?")
        params.append(float(since))
    if until is not None:
        clauses.append(f"{column} < ?")
        params.append(float(until))
    return (" AND ".join(clauses) or "TRUE"), params
