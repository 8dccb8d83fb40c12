"""Fleet-wide views: the overview (jobs, incidents, actions, fleet health, ETTR), the
machine page and the report's figures.

Same rules as ui/views.py: plain functions on a lake connection (``lake.connect``)
returning polars frames; pages and the report only render what comes back.
"""

from __future__ import annotations

import datetime as dt
import math
from pathlib import Path

import duckdb
import numpy as np
import polars as pl

from faultlens.ui.lake import MAX_CHART_ROWS
from faultlens.ui.lake import fetch_rows as _rows
from faultlens.ui.lake import json_or as _json
from faultlens.ui.lake import query as _q
from faultlens.ui.lake import time_window as _window

SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}


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


FAULT_MERGE_S = 3600.0  # critical incidents on one culprit machine this close together: one fault


def reliability(
    con: duckdb.DuckDBPyConnection, job: str, *, since: float | None = None, until: float | None = None,
) -> dict[str, float | int | None]:
    """MTBF and MTTR of a job over the window.

    Failures are the job's critical incidents that something was done about (at least one
    action): a link flap that recovered by itself is tolerated, not a failure. One fault
    counts once: critical incidents naming the same culprit machine within
    ``FAULT_MERGE_S`` of each other (a throttled GPU seen as thermal throttling and as a
    fail-slow machine) are one failure. MTBF = wall-clock / failures; MTTR = mean length of
    the progress gaps attributed to an incident (time from the last step before the failure
    to the first step after recovery).
    """
    e = ettr(con, job=job, since=since, until=until)
    wall = float(e["wall_s"][0]) if e.height else 0.0
    where, params = _window(since, until, "opened_ts")
    acted = _rows(
        con,
        f"""SELECT coalesce(json_extract_string(suspects, '$[0].node'), id), opened_ts FROM incidents_latest
            WHERE job = ? AND severity = 'critical' AND coalesce(json_array_length(actions), 0) > 0 AND {where}
            ORDER BY opened_ts""",
        [job, *params],
    )
    last_seen: dict[str, float] = {}
    failures = 0
    for culprit, opened in acted:
        if culprit not in last_seen or opened - last_seen[culprit] > FAULT_MERGE_S:
            failures += 1
        last_seen[culprit] = opened
    _, gaps = downtime_ledger(con, job, since=since, until=until)
    repaired = gaps.filter(pl.col("incident").is_not_null())
    return {
        "wall_s": wall,
        "failures": int(failures),
        "mtbf_s": wall / failures if failures else None,
        "mttr_s": float(repaired.select(pl.col("lost_s").mean()).item()) if repaired.height else None,
        "ettr": float(e.row(0, named=True)["ettr"]) if e.height else None,
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
