"""Every query the explorer and the report run, as plain functions.

Each view takes a DuckDB connection opened on the lake (``connect``) and returns a
polars frame (or a small dict). Pages and the report only call these and render
what comes back, so every number a person sees is computed here, once, and tested
without Streamlit.

The lake is read-only here. ``connect`` uses ``faultlens.stream.catalog.open_lake``
when the stream part provides it and adds, for any table it lacks, a view over
``LAKE/<table>/**/*.parquet`` (or an empty view with the table's lake schema), so
the explorer also works on a lake with only some tables, e.g. one built by tests.

Rollups (``gpu_1m``, ``steps_1m``) keep the explorer fast on week-long, 1,024-GPU
jobs: heatmaps, fleet health, ETTR and the downtime ledger read only them. When a
lake has no rollup files, ``connect`` defines them as views over the raw tables
(same columns), which is fine for small lakes. Their columns are documented in
ui/README.md.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import orjson
import polars as pl
import pyarrow as pa

from faultlens.stream.catalog import open_lake, rollup_schema
from faultlens.stream.schema import json_columns
from faultlens.stream.topology import Topology

SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}
# Heatmaps and timelines are sent to the browser as Vega-Lite data: Altair refuses
# more than 5,000 rows, so bins are widened in DuckDB until a chart fits.
MAX_CHART_ROWS = 5_000
EVIDENCE_MARGIN_S = 900.0  # raw lines shown this long before/after an incident

LABELS_SCHEMA = pa.schema(
    [
        pa.field("ts", pa.float64(), False),
        pa.field("incident_id", pa.string(), False),
        pa.field("job", pa.string()),
        pa.field("verdict", pa.string(), False),  # confirmed | corrected
        pa.field("diagnosed_kind", pa.string()),
        pa.field("diagnosed_category", pa.string()),
        pa.field("kind", pa.string(), False),  # the root cause a person settled on
        pa.field("category", pa.string()),
        pa.field("nodes", pa.string()),  # JSON list of culprit nodes
        pa.field("author", pa.string()),
        pa.field("note", pa.string()),
    ]
)

# --------------------------------------------------------------------------- connection


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
    return con


def _q(con: duckdb.DuckDBPyConnection, sql: str, params: Iterable[Any] | None = None) -> pl.DataFrame:
    frame = pl.from_arrow(con.sql(sql, params=list(params or [])).to_arrow_table())
    assert isinstance(frame, pl.DataFrame)
    return frame


def _rows(con: duckdb.DuckDBPyConnection, sql: str, params: Iterable[Any] | None = None) -> list[tuple[Any, ...]]:
    """All rows of a query, fetched at once (DuckDB refuses new work while a result is half read)."""
    return con.sql(sql, params=list(params) if params else None).fetchall()


def _json(text: Any, default: Any) -> Any:
    if text is None or text == "":
        return default
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return default


def _window(since: float | None, until: float | None, column: str = "ts") -> tuple[str, list[float]]:
    clauses, params = [], []
    if since is not None:
        clauses.append(f"{column} >= ?")
        params.append(float(since))
    if until is not None:
        clauses.append(f"{column} < ?")
        params.append(float(until))
    return (" AND ".join(clauses) or "TRUE"), params


# --------------------------------------------------------------------------- overview


def jobs(con: duckdb.DuckDBPyConnection) -> pl.DataFrame:
    """One row per job: its layout, nodes, time span and open incidents."""
    return _q(
        con,
        """
        WITH j AS (
          SELECT * EXCLUDE (_rn) FROM (
            SELECT *, row_number() OVER (PARTITION BY job ORDER BY ts DESC) AS _rn FROM jobs) WHERE _rn = 1),
        s AS (SELECT job, min(minute) AS first_ts, max(minute) + 60 AS last_ts, max(step_max) + 1 AS steps
              FROM steps_1m_parts GROUP BY job),
        i AS (SELECT job, count(*) FILTER (WHERE status = 'open') AS open_incidents, count(*) AS incidents
              FROM incidents_latest GROUP BY job)
        SELECT j.job, j.tp, j.pp, j.dp, j.cp, j.tp * j.pp * j.dp * j.cp AS world_size,
               len(json_keys(j.ranks)) AS ranks,
               list_distinct(json_extract_string(j.ranks, '$.*.node')) AS node_list,
               s.first_ts, s.last_ts, coalesce(s.steps, 0) AS steps,
               coalesce(i.open_incidents, 0) AS open_incidents, coalesce(i.incidents, 0) AS incidents
        FROM j LEFT JOIN s USING (job) LEFT JOIN i USING (job)
        ORDER BY open_incidents DESC, job
        """,
    ).with_columns(pl.col("node_list").list.len().alias("nodes")).drop("node_list")


def incidents(
    con: duckdb.DuckDBPyConnection, *, job: str | None = None, status: str | None = None,
    since: float | None = None, until: float | None = None,
) -> pl.DataFrame:
    """Incidents (latest version of each), most severe and newest first, with the top suspect."""
    where, params = _window(since, until, "opened_ts")
    if job:
        where += " AND job = ?"
        params.append(job)
    if status:
        where += " AND status = ?"
        params.append(status)
    return _q(
        con,
        f"""
        SELECT id, job, severity, status, kind, category, title, confidence,
               json_extract_string(suspects, '$[0].node') AS culprit,
               json_extract_string(suspects, '$[0].reason') AS reason,
               opened_ts, updated_ts, root_cause,
               CASE severity WHEN 'critical' THEN 0 WHEN 'warning' THEN 1 ELSE 2 END AS _sev
        FROM incidents_latest WHERE {where}
        ORDER BY _sev, opened_ts DESC
        """,
        params,
    ).drop("_sev")


def open_incidents_by_severity(con: duckdb.DuckDBPyConnection) -> dict[str, int]:
    """Open incidents counted per severity (every severity present, zero included)."""
    rows = _rows(con, "SELECT severity, count(*) FROM incidents_latest WHERE status = 'open' GROUP BY severity")
    out = dict.fromkeys(SEVERITY_ORDER, 0)
    out.update({sev: int(n) for sev, n in rows})
    return out


def actions(con: duckdb.DuckDBPyConnection, *, incident_id: str | None = None, job: str | None = None) -> pl.DataFrame:
    """Actions with the runner's latest status; ``pending`` where the runner has not answered."""
    where, params = "TRUE", []
    if incident_id:
        where += " AND incident_id = ?"
        params.append(incident_id)
    if job:
        where += " AND job = ?"
        params.append(job)
    return _q(
        con,
        f"""
        SELECT id, incident_id, job, ts, type, nodes, confidence, dry_run, reason,
               coalesce(status, 'pending') AS status, status_ts, adapter, status_detail AS detail
        FROM actions_status WHERE {where} ORDER BY ts DESC
        """,
        params,
    ).with_columns(
        pl.col("nodes").map_elements(lambda t: ", ".join(_json(t, [])), return_dtype=pl.String),
    )


def actions_summary(con: duckdb.DuckDBPyConnection) -> dict[str, int]:
    """Actions counted as pending (no runner answer yet) or by the runner's status."""
    rows = _rows(con, "SELECT coalesce(status, 'pending'), count(*) FROM actions_status GROUP BY ALL")
    out = {"pending": 0, "done": 0, "dry_run": 0, "failed": 0, "refused": 0}
    out.update({s: int(n) for s, n in rows})
    return out


def data_end(con: duckdb.DuckDBPyConnection, lake_path: str | Path | None = None) -> float | None:
    """The end of the newest minute in the GPU rollup: "now" for a lake that may be a replay.

    With ``lake_path`` only the newest hour partition is read (a week-long
    rollup is too big to scan for one number).
    """
    floor = 0.0
    if lake_path is not None:
        hours = sorted(Path(lake_path).glob("gpu_1m/date=*/hour=*"))
        if hours:
            date = hours[-1].parent.name.split("=", 1)[1]
            hour = int(hours[-1].name.split("=", 1)[1])
            floor = dt.datetime.fromisoformat(date).replace(hour=hour, tzinfo=dt.UTC).timestamp()
    value = _rows(con, "SELECT max(minute) FROM gpu_1m_parts WHERE minute >= ?", [floor])[0][0]
    return None if value is None else float(value) + 60.0


def fleet_health(
    con: duckdb.DuckDBPyConnection, *, window_s: float = 3600.0, lake_path: str | Path | None = None,
) -> pl.DataFrame:
    """Per node over the last ``window_s`` of data: counters, Xids, open incidents, a verdict.

    Verdict: ``critical`` when a GPU is lost, a double-bit ECC error or a row-remap
    failure appeared, or an open critical incident blames the node first; ``warning`` on
    Xids, hardware/thermal throttling, NVLink/PCIe errors or temperature over
    85 C; else ``ok``. Lost GPUs and row-remap failures are flags the rollup does
    not keep, so they come from the raw table (only flagged rows are read).
    """
    end = data_end(con, lake_path)
    if end is None:
        return pl.DataFrame(schema={"node": pl.String, "health": pl.String})
    start = end - window_s
    return _q(
        con,
        """
        WITH pg AS (
          SELECT node, gpu, max(temp_c_max) AS temp_c_max, min(sm_clock_mhz_min) AS sm_clock_mhz_min,
                 max(ecc_dbe_max) - min(ecc_dbe_min) AS dbe, max(pcie_replay_max) - min(pcie_replay_min) AS pcie,
                 max(nvlink_errors_max) - min(nvlink_errors_min) AS nvlink,
                 bool_or(throttle_reasons_max >= 8) AS throttled, max(minute) + 60 AS last_seen
          FROM gpu_1m_parts WHERE minute >= ? GROUP BY node, gpu),
        g AS (
          SELECT node, count(*) AS gpus, max(temp_c_max) AS temp_c_max, min(sm_clock_mhz_min) AS sm_clock_mhz_min,
                 sum(dbe)::BIGINT AS ecc_dbe_delta, sum(pcie)::BIGINT AS pcie_replay_delta,
                 sum(nvlink)::BIGINT AS nvlink_errors_delta, bool_or(throttled) AS throttled,
                 max(last_seen) AS last_seen
          FROM pg GROUP BY node),
        f AS (SELECT node, bool_or(lost) AS lost, bool_or(remap_failure) AS remap_failure
              FROM gpu WHERE ts >= ? AND (lost OR remap_failure) GROUP BY node),
        k AS (SELECT node, count(*) FILTER (WHERE xid IS NOT NULL) AS xids FROM kernel WHERE ts >= ? GROUP BY node),
        i AS (SELECT json_extract_string(suspects, '$[0].node') AS node, severity
              FROM incidents_latest WHERE status = 'open'),
        ic AS (SELECT node, count(*) AS open_incidents, bool_or(severity = 'critical') AS critical FROM i GROUP BY node)
        SELECT g.node,
               CASE WHEN coalesce(f.lost, false) OR g.ecc_dbe_delta > 0 OR coalesce(f.remap_failure, false) OR coalesce(ic.critical, false) THEN 'critical'
                    WHEN coalesce(k.xids, 0) > 0 OR g.throttled OR g.nvlink_errors_delta > 0
                         OR g.pcie_replay_delta > 0 OR g.temp_c_max > 85 OR coalesce(ic.open_incidents, 0) > 0
                    THEN 'warning' ELSE 'ok' END AS health,
               g.gpus, coalesce(ic.open_incidents, 0) AS open_incidents, coalesce(k.xids, 0) AS xids,
               g.temp_c_max, g.sm_clock_mhz_min, g.ecc_dbe_delta, g.pcie_replay_delta, g.nvlink_errors_delta,
               coalesce(f.remap_failure, false) AS remap_failure, coalesce(f.lost, false) AS lost,
               make_timestamp(CAST(g.last_seen * 1e6 AS BIGINT)) AS last_seen
        FROM g LEFT JOIN f USING (node) LEFT JOIN k USING (node) LEFT JOIN ic USING (node)
        ORDER BY CASE health WHEN 'critical' THEN 0 WHEN 'warning' THEN 1 ELSE 2 END, node
        """,
        [start, start, start],
    )


def ettr(
    con: duckdb.DuckDBPyConnection, *, job: str | None = None, since: float | None = None, until: float | None = None,
) -> pl.DataFrame:
    """Effective training time ratio per job: productive step time / wall-clock.

    Productive time is the step time the ranks spent, averaged over ranks (the
    per-rank rollup keeps each rank's step count and mean duration per minute);
    wall-clock runs from the job's first to its last step minute in the window (or
    the window itself when given). Hangs, restarts and slow steps all lower it.
    """
    where, params = _window(since, until, "minute")
    if job:
        where += " AND job = ?"
        params.append(job)
    frame = _q(
        con,
        f"""
        SELECT job, min(minute) AS first_ts, max(minute) + 60 AS last_ts,
               max(step_max) - min(step_min) + 1 AS steps,
               sum(duration_s_sum) / count(DISTINCT rank) AS productive_s
        FROM steps_1m_parts WHERE {where} GROUP BY job ORDER BY job
        """,
        params,
    )
    start = pl.lit(since) if since is not None else pl.col("first_ts")
    end = pl.lit(until) if until is not None else pl.col("last_ts")
    return frame.with_columns((end - start).alias("wall_s")).with_columns(
        (pl.col("productive_s") / pl.col("wall_s")).clip(0.0, 1.0).alias("ettr")
    )


# --------------------------------------------------------------------------- incident detail


def incident(con: duckdb.DuckDBPyConnection, incident_id: str) -> dict[str, Any] | None:
    """The latest version of one incident with its JSON fields decoded; None when unknown."""
    frame = _q(con, "SELECT * FROM incidents_latest WHERE id = ?", [incident_id])
    if frame.is_empty():
        return None
    row = frame.row(0, named=True)
    for col in json_columns("incidents"):
        row[col] = _json(row.get(col), [])
    return row


def _incident_window(inc: dict[str, Any]) -> tuple[float, float]:
    times = [float(inc["opened_ts"]), float(inc["updated_ts"])]
    times += [float(e["ts"]) for e in inc.get("evidence", []) if isinstance(e.get("ts"), (int, float))]
    return min(times) - EVIDENCE_MARGIN_S, max(times) + EVIDENCE_MARGIN_S


def suspects(inc: dict[str, Any]) -> pl.DataFrame:
    """Suspects of an incident, highest score first."""
    rows = [
        {
            "node": s.get("node"),
            "gpu": s.get("gpu"),
            "ranks": ", ".join(str(r) for r in s.get("ranks") or []),
            "score": float(s.get("score") or 0.0),
            "reason": s.get("reason", ""),
        }
        for s in inc.get("suspects", [])
    ]
    schema = {"node": pl.String, "gpu": pl.Int64, "ranks": pl.String, "score": pl.Float64, "reason": pl.String}
    return pl.DataFrame(rows, schema=schema).sort("score", descending=True)


def evidence_timeline(con: duckdb.DuckDBPyConnection, inc: dict[str, Any], *, limit: int = 500) -> pl.DataFrame:
    """The incident's evidence plus the raw kernel/NCCL lines of its suspects around it, by time.

    ``evidence`` is True for the items diagnosis cited; the rest is context (every
    non-routine kernel and NCCL line of the suspect nodes in the window).
    """
    cited = [
        {
            "ts": float(e.get("ts") or inc["opened_ts"]),
            "source": str(e.get("source", "")),
            "node": e.get("node"),
            "rank": e.get("rank"),
            "text": str(e.get("text", "")),
            "evidence": True,
        }
        for e in inc.get("evidence", [])
    ]
    schema = {"ts": pl.Float64, "source": pl.String, "node": pl.String, "rank": pl.Int64,
              "text": pl.String, "evidence": pl.Boolean}
    frame = pl.DataFrame(cited, schema=schema)
    nodes = sorted({s["node"] for s in inc.get("suspects", []) if s.get("node")})
    if nodes:
        start, end = _incident_window(inc)
        context = _q(
            con,
            """
            SELECT ts, 'kernel' AS source, node, rank, raw AS text, false AS evidence
            FROM kernel WHERE node IN (SELECT unnest(?)) AND ts BETWEEN ? AND ? AND kind <> 'other'
            UNION ALL
            SELECT ts, 'nccl', node, rank, raw, false
            FROM nccl WHERE node IN (SELECT unnest(?)) AND ts BETWEEN ? AND ? AND coalesce(level, '') <> 'INFO'
            ORDER BY ts LIMIT ?
            """,
            [nodes, start, end, nodes, start, end, limit],
        ).cast(schema)
        seen = set(zip(frame["node"].to_list(), frame["text"].to_list(), strict=True))
        context = context.filter(
            ~pl.struct("node", "text").map_elements(lambda r: (r["node"], r["text"]) in seen, return_dtype=pl.Boolean)
        )
        frame = pl.concat([frame, context])
    return frame.sort("ts").with_columns(
        pl.from_epoch(pl.col("ts"), time_unit="s").alias("time")
    ).select("time", "source", "node", "rank", "evidence", "text", "ts")


def job_topology(con: duckdb.DuckDBPyConnection, job: str, *, at_ts: float | None = None) -> Topology | None:
    """The job's topology as it was at ``at_ts`` (else its latest); None when the lake has none.

    A job restarted after an eviction publishes a new topology; an incident is
    drawn on the one that was running when it opened.
    """
    frame = _q(
        con,
        "SELECT * FROM jobs WHERE job = ? ORDER BY (ts <= coalesce(?, ts)) DESC, ts DESC LIMIT 1",
        [job, at_ts],
    )
    if frame.is_empty():
        return None
    row = frame.row(0, named=True)
    row["ranks"] = _json(row.get("ranks"), {})
    return Topology.from_job(row)


def job_nodes(con: duckdb.DuckDBPyConnection, job: str) -> list[str]:
    """Every node the job ran on, over all its topology versions (evicted ones included)."""
    rows = _rows(
        con,
        "SELECT DISTINCT unnest(json_extract_string(ranks, '$.*.node')) AS node FROM jobs WHERE job = ? ORDER BY 1",
        [job],
    )
    return [r[0] for r in rows]


def suspect_ranks(inc: dict[str, Any], topo: Topology, *, min_share: float = 0.5) -> set[int]:
    """Ranks the strong suspects name: explicit ranks, else the rank on the named GPU, else the node's ranks.

    A suspect is strong when its score is at least ``min_share`` of the top
    score; weak ones (bystanders diagnosis listed and cleared) are not drawn.
    """
    out: set[int] = set()
    by_place = {place: rank for rank, place in topo.placement.items()}
    top = max((float(s.get("score") or 0.0) for s in inc.get("suspects", [])), default=0.0)
    for s in inc.get("suspects", []):
        if float(s.get("score") or 0.0) < min_share * top:
            continue
        if s.get("ranks"):
            out.update(int(r) for r in s["ranks"])
        elif s.get("gpu") is not None and (s.get("node"), int(s["gpu"])) in by_place:
            out.add(by_place[(s["node"], int(s["gpu"]))])
        elif s.get("node"):
            out.update(topo.ranks_on(s["node"]))
    return out


def topology_grid(con: duckdb.DuckDBPyConnection, inc: dict[str, Any]) -> pl.DataFrame:
    """One row per rank: parallel coordinates, placement and its state in this incident.

    ``state`` is ``suspect`` (a rank the suspects name), ``evicted`` (on a node an
    evict_nodes action of this incident removes) or ``healthy``. ``column`` lays
    ranks out dp-major then tp, so the grid reads tp x dp across and pp down.
    """
    topo = job_topology(con, inc["job"], at_ts=float(inc["opened_ts"]))
    if topo is None:
        return pl.DataFrame()
    evicted_nodes: set[str] = set()
    for row in actions(con, incident_id=inc["id"]).iter_rows(named=True):
        if row["type"] == "evict_nodes":
            evicted_nodes.update(n.strip() for n in row["nodes"].split(",") if n.strip())
    bad = suspect_ranks(inc, topo)
    rows = []
    for rank in range(topo.world_size):
        c = topo.coords(rank)
        node, gpu = topo.placement.get(rank, ("?", -1))
        state = "suspect" if rank in bad else "evicted" if node in evicted_nodes else "healthy"
        rows.append({"rank": rank, "node": node, "gpu": gpu, **c,
                     "column": (c["dp"] * topo.cp + c["cp"]) * topo.tp + c["tp"], "state": state})
    return pl.DataFrame(rows)


_FRAME = re.compile(r"^\s+(?P<func>[^\s(]+) \((?P<file>[^:)]+)(?::\d+)?\)")


def stack_fingerprint(text: str) -> str:
    """A stack dump reduced to its main thread's frames, without line numbers, pids or addresses."""
    frames: list[str] = []
    in_thread = False
    for line in text.splitlines():
        if line.startswith("Thread "):
            if frames:
                break  # the first (main) thread is enough to tell ranks apart
            in_thread = True
            continue
        m = _FRAME.match(line)
        if in_thread and m:
            frames.append(f"{m['func']} ({m['file']})")
    return " < ".join(frames[:6]) if frames else text.strip().splitlines()[0] if text.strip() else "(empty)"


def stack_groups(con: duckdb.DuckDBPyConnection, inc: dict[str, Any]) -> pl.DataFrame:
    """The job's stack dumps around the incident grouped by fingerprint; smallest groups first.

    The dominant group is the healthy majority; the small ones are the outliers
    ByteRobust's aggregation looks for.
    """
    start, end = _incident_window(inc)
    dumps = _q(
        con,
        "SELECT rank, node, text, error FROM stacks WHERE job = ? AND ts BETWEEN ? AND ?",
        [inc["job"], start, end],
    )
    schema = {"group": pl.String, "ranks": pl.String, "nodes": pl.String, "count": pl.Int64, "share": pl.Float64}
    if dumps.is_empty():
        return pl.DataFrame(schema=schema)
    dumps = dumps.with_columns(
        pl.when(pl.col("error").is_not_null()).then(pl.lit("(no dump: ") + pl.col("error") + pl.lit(")"))
        .otherwise(pl.col("text").map_elements(stack_fingerprint, return_dtype=pl.String)).alias("group")
    )
    total = dumps.height
    return (
        dumps.group_by("group")
        .agg(
            pl.col("rank").sort().cast(pl.String).str.join(", ").alias("ranks"),
            pl.col("node").unique().sort().str.join(", ").alias("nodes"),
            pl.len().cast(pl.Int64).alias("count"),
        )
        .with_columns((pl.col("count") / total).alias("share"))
        .sort(["count", "group"])
        .select(list(schema))
    )


def _huber_fit(x: np.ndarray, y: np.ndarray, *, iterations: int = 20, k: float = 1.345) -> np.ndarray:
    """Robust linear fit (Huber weights by IRLS) so that a few slow steps do not bend the line."""
    mean, scale = x.mean(axis=0), x.std(axis=0)
    scale[scale == 0] = 1.0
    design = np.column_stack([np.ones(len(x)), (x - mean) / scale])
    weights = np.ones(len(y))
    beta = np.zeros(design.shape[1])
    for _ in range(iterations):
        sw = np.sqrt(weights)
        beta, *_ = np.linalg.lstsq(design * sw[:, None], y * sw, rcond=None)
        resid = y - design @ beta
        mad = np.median(np.abs(resid - np.median(resid))) * 1.4826 or 1e-9
        u = np.abs(resid) / (k * mad)
        weights = np.where(u <= 1, 1.0, 1.0 / np.maximum(u, 1e-12))
    # back to raw-feature coefficients: intercept, then one per feature
    coef = beta[1:] / scale
    return np.concatenate([[beta[0] - (coef * mean).sum()], coef])


STEP_FEATURES = ("sum_len", "sum_len_sq", "n_seqs")


def step_prediction(
    con: duckdb.DuckDBPyConnection, job: str, *, onset_ts: float, before_s: float = 1800.0, after_s: float = 900.0,
    fit_rows: int = 20_000,
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Step time observed vs predicted from the workload around ``onset_ts``.

    The prediction is a robust linear fit of a rank's step duration on its
    workload (sum of sequence lengths, their squares, number of sequences) over
    the healthy steps before the onset (ResiHP's predictor, fitted locally here so
    the explorer needs no trained model). Long-sequence batches are predicted as
    slow, so only unexplained slowness shows as residual.

    Returns (per step: time, observed (slowest rank), predicted, residual;
    per rank: mean residual, highest first — the fail-slow suspects).
    """
    start, end = onset_ts - before_s, onset_ts + after_s
    feats = ", ".join(STEP_FEATURES)
    sample = (f"SELECT {feats}, duration_s FROM steps WHERE job = ? AND ts BETWEEN ? AND ? "
              f"USING SAMPLE reservoir({int(fit_rows)} ROWS) REPEATABLE (7)")
    healthy = _q(con, sample, [job, start, onset_ts])
    if healthy.height < 8:  # nothing before the onset: fit on the whole window
        healthy = _q(con, sample, [job, start, end])
    empty_steps = pl.DataFrame(schema={"time": pl.Datetime("us"), "step": pl.Int64, "observed_s": pl.Float64,
                                       "predicted_s": pl.Float64, "residual_s": pl.Float64})
    empty_ranks = pl.DataFrame(schema={"rank": pl.Int64, "node": pl.String, "steps": pl.Int64,
                                       "residual_s": pl.Float64, "slowdown": pl.Float64})
    if healthy.height < 8:
        return empty_steps, empty_ranks
    x = healthy.select(STEP_FEATURES).cast(pl.Float64).to_numpy()
    b = _huber_fit(x, healthy["duration_s"].cast(pl.Float64).to_numpy())
    c = [float(v) for v in b]
    pred = f"({c[0]!r} + {c[1]!r} * sum_len + {c[2]!r} * sum_len_sq + {c[3]!r} * n_seqs)"
    per_step = _q(
        con,
        f"""
        WITH r AS (SELECT step, ts, rank, node, duration_s, {pred} AS predicted_s
                   FROM steps WHERE job = ? AND ts BETWEEN ? AND ?)
        SELECT step, max(ts) AS ts, max(duration_s) AS observed_s, max(predicted_s) AS predicted_s
        FROM r GROUP BY step ORDER BY step
        """,
        [job, start, end],
    )
    if per_step.height > MAX_CHART_ROWS:  # keep the chart under Altair's row limit
        every = math.ceil(per_step.height / MAX_CHART_ROWS)
        per_step = per_step.group_by((pl.col("step") // every) * every).agg(
            pl.col("ts").max(), pl.col("observed_s").max(), pl.col("predicted_s").max()
        ).sort("step")
    per_step = per_step.with_columns(
        (pl.col("observed_s") - pl.col("predicted_s")).alias("residual_s"),
        pl.from_epoch(pl.col("ts"), time_unit="s").alias("time"),
    ).select("time", "step", "observed_s", "predicted_s", "residual_s")
    per_rank = _q(
        con,
        f"""
        SELECT rank, any_value(node) AS node, count(*) AS steps,
               avg(duration_s - {pred}) AS residual_s, avg(duration_s) / nullif(avg({pred}), 0) AS slowdown
        FROM steps WHERE job = ? AND ts BETWEEN ? AND ? GROUP BY rank ORDER BY residual_s DESC LIMIT 10
        """,
        [job, onset_ts, end],
    )
    return per_step, per_rank


# --------------------------------------------------------------------------- machine page


def machines(con: duckdb.DuckDBPyConnection) -> list[str]:
    """Every node with GPU data, sorted."""
    return [r[0] for r in _rows(con, "SELECT DISTINCT node FROM gpu_1m_parts ORDER BY node")]


HEATMAP_METRICS = {
    "temp_c_max": "temperature max (C)",
    "sm_clock_mhz_min": "SM clock min (MHz)",
    "power_w_avg": "power (W)",
    "util_avg": "utilisation (%)",
    "ecc_sbe_delta": "ECC single-bit errors",
    "ecc_dbe_delta": "ECC double-bit errors",
    "pcie_replay_delta": "PCIe replays",
    "nvlink_errors_delta": "NVLink errors",
}


def gpu_heatmap(
    con: duckdb.DuckDBPyConnection, node: str, metric: str, *, since: float | None = None, until: float | None = None,
) -> pl.DataFrame:
    """GPU x time cells of one counter for one node, binned so the chart stays under 5,000 cells.

    Counters show their increase within each bin; gauges the bin's worst value
    (max temperature, min clock) or mean (power, utilisation).
    """
    if metric not in HEATMAP_METRICS:
        raise ValueError(f"unknown metric {metric!r}; known: {', '.join(HEATMAP_METRICS)}")
    where, params = _window(since, until, "minute")
    span = _rows(
        con, f"SELECT min(minute), max(minute), count(DISTINCT gpu) FROM gpu_1m_parts WHERE node = ? AND {where}",
        [node, *params],
    )[0]
    if span[0] is None:
        return pl.DataFrame(schema={"time": pl.Datetime("us"), "end": pl.Datetime("us"), "gpu": pl.Int64,
                                    "value": pl.Float64})
    minutes = (span[1] - span[0]) / 60 + 1
    bins_allowed = max(1, MAX_CHART_ROWS // max(1, span[2]))
    bin_s = 60 * max(1, math.ceil(minutes / bins_allowed))
    # Over the rollup partials, exactly: gauges keep their worst value or their
    # sum/count; a cumulative counter's increase in a bin is its max - min there.
    if metric.endswith("_delta"):
        counter = metric.removesuffix("_delta")
        value = f"max({counter}_max) - min({counter}_min)"
    elif metric.endswith("_avg"):
        gauge = metric.removesuffix("_avg")
        value = f"sum({gauge}_sum) / sum(n)"
    else:
        value = f"{'min' if metric.endswith('_min') else 'max'}({metric})"
    return _q(
        con,
        f"""
        SELECT make_timestamp(CAST(floor(minute / {bin_s}) * {bin_s} * 1e6 AS BIGINT)) AS time,
               make_timestamp(CAST((floor(minute / {bin_s}) + 1) * {bin_s} * 1e6 AS BIGINT)) AS "end", gpu,
               CAST({value} AS DOUBLE) AS value
        FROM gpu_1m_parts WHERE node = ? AND {where} GROUP BY ALL ORDER BY time, gpu
        """,
        [node, *params],
    )


def kernel_events(
    con: duckdb.DuckDBPyConnection, node: str, *, since: float | None = None, until: float | None = None,
    limit: int = 500,
) -> pl.DataFrame:
    """A node's non-routine kernel events, newest first."""
    where, params = _window(since, until)
    return _q(
        con,
        f"""
        SELECT make_timestamp(CAST(ts * 1e6 AS BIGINT)) AS time, kind, xid, gpu, pci_bus, raw
        FROM kernel WHERE node = ? AND kind <> 'other' AND {where} ORDER BY ts DESC LIMIT ?
        """,
        [node, *params, limit],
    )


def node_incidents(con: duckdb.DuckDBPyConnection, node: str) -> pl.DataFrame:
    """Every incident whose suspects name the node, newest first."""
    return _q(
        con,
        """
        SELECT id, job, make_timestamp(CAST(opened_ts * 1e6 AS BIGINT)) AS opened, severity, status, kind,
               category, title, root_cause
        FROM incidents_latest WHERE list_contains(json_extract_string(suspects, '$[*].node'), ?)
        ORDER BY opened_ts DESC
        """,
        [node],
    )


# --------------------------------------------------------------------------- report figures


def xid_histogram(
    con: duckdb.DuckDBPyConnection, *, nodes: list[str] | None = None, since: float | None = None,
    until: float | None = None,
) -> pl.DataFrame:
    """Xid events counted per code (and the nodes that logged them)."""
    where, params = _window(since, until)
    if nodes:
        where += " AND node IN (SELECT unnest(?))"
        params.append(nodes)
    return _q(
        con,
        f"""
        SELECT xid, count(*) AS events, count(DISTINCT node) AS nodes
        FROM kernel WHERE xid IS NOT NULL AND {where} GROUP BY xid ORDER BY events DESC, xid
        """,
        params,
    )


def downtime_ledger(
    con: duckdb.DuckDBPyConnection, job: str, *, since: float | None = None, until: float | None = None,
    attribution_s: float = 900.0,
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Where the wall-clock went: gaps in step progress, each attributed to an incident.

    A gap is a run of minutes with no completed step between the job's first and
    last step. It is blamed on the incident opened closest before it (up to
    ``attribution_s`` before its start, or inside it); a labelled root cause wins
    over the diagnosed kind. What remains between productive time and wall-clock
    outside gaps is "slow steps and overhead".

    Returns (per cause: lost_s, incidents, share; per gap: start, end, lost_s, incident, cause).
    """
    where, params = _window(since, until, "minute")
    mins = _q(
        con,
        f"""SELECT minute, sum(duration_s_sum) / count(DISTINCT rank) AS step_s FROM steps_1m_parts
            WHERE job = ? AND {where} GROUP BY minute ORDER BY minute""",
        [job, *params],
    )
    gaps_schema = {"start_ts": pl.Float64, "end_ts": pl.Float64, "lost_s": pl.Float64,
                   "incident": pl.String, "cause": pl.String}
    ledger_schema = {"cause": pl.String, "lost_s": pl.Float64, "incidents": pl.Int64, "share": pl.Float64}
    if mins.is_empty():
        return pl.DataFrame(schema=ledger_schema), pl.DataFrame(schema=gaps_schema)
    present = mins["minute"].to_numpy()
    # a gap between two step minutes a and b (b - a > 60) lasts from a + 60 to b
    diffs = np.diff(present)
    idx = np.nonzero(diffs > 60)[0]
    gaps = [(float(present[i] + 60), float(present[i + 1])) for i in idx]
    incs = _q(
        con,
        """
        SELECT i.id, i.opened_ts, coalesce(l.kind, i.root_cause, i.kind) AS cause
        FROM incidents_latest i LEFT JOIN (
          SELECT * EXCLUDE (_rn) FROM (
            SELECT *, row_number() OVER (PARTITION BY incident_id ORDER BY ts DESC) AS _rn FROM labels)
          WHERE _rn = 1) l ON l.incident_id = i.id
        WHERE i.job = ? ORDER BY i.opened_ts
        """,
        [job],
    ).rows()
    rows = []
    for start, end in gaps:
        best = None
        for inc_id, opened, cause in incs:
            if start - attribution_s <= opened <= end and (best is None or abs(opened - start) < abs(best[1] - start)):
                best = (inc_id, opened, cause)
        rows.append({"start_ts": start, "end_ts": end, "lost_s": end - start,
                     "incident": best[0] if best else None, "cause": best[2] if best else "unattributed"})
    gap_frame = pl.DataFrame(rows, schema=gaps_schema)
    first = since if since is not None else float(present[0])
    last = until if until is not None else float(present[-1] + 60)
    wall = last - first
    productive = float(mins["step_s"].sum())
    in_gaps = float(gap_frame["lost_s"].sum())
    by_cause = gap_frame.group_by("cause").agg(
        pl.col("lost_s").sum(), pl.col("incident").drop_nulls().n_unique().cast(pl.Int64).alias("incidents")
    )
    rest = max(0.0, wall - productive - in_gaps)
    ledger = pl.concat([
        by_cause.select(list(ledger_schema)[:3]),
        pl.DataFrame([{"cause": "slow steps and overhead", "lost_s": rest, "incidents": 0}],
                     schema={k: ledger_schema[k] for k in ("cause", "lost_s", "incidents")}),
    ]).with_columns((pl.col("lost_s") / wall if wall > 0 else pl.lit(0.0)).alias("share")).sort(
        "lost_s", descending=True
    )
    return ledger, gap_frame


def reliability(
    con: duckdb.DuckDBPyConnection, job: str, *, since: float | None = None, until: float | None = None,
) -> dict[str, float | int | None]:
    """MTBF and MTTR of a job over the window.

    Failures are the job's critical incidents. MTBF = wall-clock / failures;
    MTTR = mean length of the progress gaps attributed to an incident (time from
    the last step before the failure to the first step after recovery).
    """
    e = ettr(con, job=job, since=since, until=until)
    wall = float(e["wall_s"][0]) if e.height else 0.0
    where, params = _window(since, until, "opened_ts")
    failures = _rows(
        con, f"SELECT count(*) FROM incidents_latest WHERE job = ? AND severity = 'critical' AND {where}",
        [job, *params],
    )[0][0]
    _, gaps = downtime_ledger(con, job, since=since, until=until)
    repaired = gaps.filter(pl.col("incident").is_not_null())
    return {
        "wall_s": wall,
        "failures": int(failures),
        "mtbf_s": wall / failures if failures else None,
        "mttr_s": float(repaired["lost_s"].mean()) if repaired.height else None,
        "ettr": float(e["ettr"][0]) if e.height else None,
    }


def failing_machines(
    con: duckdb.DuckDBPyConnection, *, job: str | None = None, since: float | None = None,
    until: float | None = None, limit: int = 10,
) -> pl.DataFrame:
    """Nodes ranked by incidents that blame them first, then Xids and hardware error counts."""
    where_i, params_i = _window(since, until, "opened_ts")
    where_k, params_k = _window(since, until)
    where_g, params_g = _window(since, until, "minute")
    job_i = " AND job = ?" if job else ""
    job_g = " AND job = ?" if job else ""
    params = [*params_i, *([job] if job else []), *params_k, *params_g, *([job] if job else [])]
    return _q(
        con,
        f"""
        WITH i AS (SELECT json_extract_string(suspects, '$[0].node') AS node, count(*) AS incidents,
                          string_agg(DISTINCT kind, ', ') AS kinds
                   FROM incidents_latest WHERE {where_i}{job_i} GROUP BY 1),
        k AS (SELECT node, count(*) AS xids FROM kernel WHERE xid IS NOT NULL AND {where_k} GROUP BY node),
        pg AS (SELECT node, gpu, max(ecc_dbe_max) - min(ecc_dbe_min) AS ecc_dbe,
                      max(nvlink_errors_max) - min(nvlink_errors_min) AS nvlink_errors,
                      max(pcie_replay_max) - min(pcie_replay_min) AS pcie_replays
               FROM gpu_1m_parts WHERE {where_g}{job_g} GROUP BY node, gpu),
        g AS (SELECT node, sum(ecc_dbe)::BIGINT AS ecc_dbe, sum(nvlink_errors)::BIGINT AS nvlink_errors,
                     sum(pcie_replays)::BIGINT AS pcie_replays FROM pg GROUP BY node)
        SELECT i.node, i.incidents, i.kinds, coalesce(k.xids, 0) AS xids, coalesce(g.ecc_dbe, 0) AS ecc_dbe,
               coalesce(g.nvlink_errors, 0) AS nvlink_errors, coalesce(g.pcie_replays, 0) AS pcie_replays
        FROM i LEFT JOIN k USING (node) LEFT JOIN g USING (node)
        WHERE i.node IS NOT NULL ORDER BY i.incidents DESC, xids DESC, i.node LIMIT ?
        """,
        [*params, limit],
    )


def rma_candidates(
    con: duckdb.DuckDBPyConnection, *, job: str | None = None, since: float | None = None,
    until: float | None = None, repeated_dbe: int = 2,
) -> pl.DataFrame:
    """GPUs to send back: a row-remap failure, or repeated double-bit ECC errors.

    Counters are cumulative, so a GPU's errors over the window are its largest
    minus its smallest reading; ``repeated`` means at least ``repeated_dbe`` of them.
    """
    where_m, params_m = _window(since, until, "minute")
    where_t, params_t = _window(since, until)
    if job:
        where_m += " AND job = ?"
        where_t += " AND job = ?"
        params_m.append(job)
        params_t.append(job)
    # remap failure is a flag the rollup does not keep: read only flagged raw rows
    return _q(
        con,
        f"""
        WITH d AS (SELECT node, gpu, (max(ecc_dbe_max) - min(ecc_dbe_min))::BIGINT AS ecc_dbe,
                          min(minute) FILTER (WHERE ecc_dbe_max > 0) AS first_dbe
                   FROM gpu_1m_parts WHERE {where_m} GROUP BY node, gpu),
        r AS (SELECT node, gpu, min(ts) AS first_remap FROM gpu WHERE {where_t} AND remap_failure GROUP BY node, gpu)
        SELECT node, gpu, r.first_remap IS NOT NULL AS remap_failure, coalesce(d.ecc_dbe, 0) AS ecc_dbe,
               CASE WHEN r.first_remap IS NOT NULL THEN 'row-remap failure'
                    ELSE 'repeated double-bit ECC errors' END AS reason,
               make_timestamp(CAST(least(coalesce(r.first_remap, 1e12), coalesce(d.first_dbe, 1e12)) * 1e6 AS BIGINT))
                 AS first_seen
        FROM r FULL OUTER JOIN d USING (node, gpu)
        WHERE r.first_remap IS NOT NULL OR d.ecc_dbe >= ?
        ORDER BY remap_failure DESC, ecc_dbe DESC, node, gpu
        """,
        [*params_m, *params_t, repeated_dbe],
    )


def headline(inc: dict[str, Any]) -> dict[str, str]:
    """What a person must read first: the culprit (node, GPU), the reason, the action taken."""
    top = max(inc.get("suspects", []), key=lambda s: float(s.get("score") or 0.0), default={})
    where = top.get("node") or "no culprit"
    if top.get("gpu") is not None:
        where += f" GPU {top['gpu']}"
    return {
        "culprit": where,
        "node": top.get("node") or "",
        "reason": top.get("reason") or inc.get("summary") or inc.get("title", ""),
        "what": f"{inc.get('kind')} ({inc.get('category')}), {inc.get('severity')}, confidence {float(inc.get('confidence') or 0):.0%}",
    }


def incident_choices(con: duckdb.DuckDBPyConnection) -> dict[str, str]:
    """Incident id -> a one-line label (severity, culprit, title), most severe and newest first."""
    frame = incidents(con)
    return {
        r["id"]: f"[{r['severity']}] {r['culprit'] or '-'} · {r['title']} ({r['status']})"
        for r in frame.iter_rows(named=True)
    }


def labels(con: duckdb.DuckDBPyConnection, *, incident_id: str | None = None) -> pl.DataFrame:
    """Labels people gave, newest first (every version; the first per incident is in force)."""
    where, params = ("incident_id = ?", [incident_id]) if incident_id else ("TRUE", [])
    return _q(
        con,
        f"""SELECT make_timestamp(CAST(ts * 1e6 AS BIGINT)) AS time, incident_id, job, verdict, diagnosed_kind,
                   kind, category, nodes, author, note
            FROM labels WHERE {where} ORDER BY ts DESC""",
        params,
    )
