"""Every query the explorer and the report run about jobs and incidents, as plain functions.

Each view takes a DuckDB connection opened on the lake (``connect``, from
ui/lake.py) and returns a polars frame (or a small dict). Pages and the report
only call these and render what comes back, so every number a person sees is
computed here, once, and tested without Streamlit. The fleet-wide views (overview,
machine page, report figures) live in ui/fleet.py and are re-exported here, so
pages import one module.

What an incident page shows is what diagnosis recorded with the incident: its
suspects, evidence and summary; stack groups use diagnosis's own fingerprint
(``faultlens.diagnosis.stacks.fingerprint``) and mark the outliers the incident's
stack evidence names; step-time predictions use the predictor's own model and
features (``faultlens.models.predictor``). Nothing is re-diagnosed here.
"""

from __future__ import annotations

import math
from typing import Any, cast

import duckdb
import polars as pl

from faultlens.diagnosis.stacks import fingerprint
from faultlens.models.predictor import WORKLOAD_FEATURES, StepTimePredictor, compute_time
from faultlens.schema import StepTiming, json_columns
from faultlens.stream.topology import Topology
from faultlens.ui.fleet import (  # noqa: F401 - re-exported: pages and the report import views only
    HEATMAP_METRICS,
    SEVERITY_ORDER,
    actions,
    actions_summary,
    data_end,
    downtime_ledger,
    ettr,
    failing_machines,
    fleet_health,
    gpu_heatmap,
    incidents,
    jobs,
    kernel_events,
    machines,
    node_incidents,
    open_incidents_by_severity,
    reliability,
    rma_candidates,
    xid_histogram,
)
from faultlens.ui.lake import (
    MAX_CHART_ROWS,
    connect,  # noqa: F401 - re-exported
    is_lake,  # noqa: F401 - re-exported
)
from faultlens.ui.lake import fetch_rows as _rows
from faultlens.ui.lake import json_or as _json
from faultlens.ui.lake import query as _q

EVIDENCE_MARGIN_S = 900.0  # raw lines shown this long before/after an incident


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
    schema = pl.Schema({"ts": pl.Float64, "source": pl.String, "node": pl.String, "rank": pl.Int64,
                        "text": pl.String, "evidence": pl.Boolean})
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


def evidence_table(timeline: pl.DataFrame) -> pl.DataFrame:
    """The timeline as the incident page lists it: what diagnosis cited first (by time), context below."""
    return timeline.sort(["evidence", "ts"], descending=[True, False])


def muted(inc: dict[str, Any]) -> pl.DataFrame:
    """What the incident muted as its symptoms, and the inhibit rule that muted each."""
    rows = [{"item": str(m.get("item", "")), "by_rule": str(m.get("by_rule", "")), "count": int(m.get("count", 1))}
            for m in inc.get("muted", [])]
    return pl.DataFrame(rows, schema={"item": pl.String, "by_rule": pl.String, "count": pl.Int64})


SUPPRESSION_SCHEMA = {"reason": pl.String, "count": pl.Int64, "last_ts": pl.Float64, "listed": pl.Int64}
SUPPRESSED_SCHEMA = {"ts": pl.Float64, "reason": pl.String, "type": pl.String, "nodes": pl.String, "text": pl.String,
                     "retried": pl.Boolean}


def suppression_counts(inc: dict[str, Any]) -> pl.DataFrame:
    """Every reason the guard held an action of this incident back: how often (all counted) and when
    last (of the newest ``guard.suppressions_kept`` listed), most frequent first."""
    listed = [s for s in inc.get("suppressed") or [] if isinstance(s, dict)]
    counts = inc.get("suppressed_counts") or {}
    counts = counts if isinstance(counts, dict) else {}
    rows = []
    for reason in sorted(set(counts) | {str(s.get("reason", "")) for s in listed}):
        mine = [float(s.get("ts") or 0.0) for s in listed if str(s.get("reason", "")) == reason]
        rows.append({"reason": reason, "count": int(counts.get(reason, len(mine))), "last_ts": max(mine, default=None),
                     "listed": len(mine)})
    return pl.DataFrame(rows, schema=SUPPRESSION_SCHEMA).sort(["count", "reason"], descending=[True, False])


def suppressions(inc: dict[str, Any]) -> pl.DataFrame:
    """The listed suppressions of this incident, newest first: what was held back, why, and whether the
    refused eviction was claimed again after a person's reset."""
    rows = [{"ts": float(s.get("ts") or 0.0), "reason": str(s.get("reason", "")), "type": str(s.get("type", "")),
             "nodes": ", ".join(map(str, s.get("nodes") or [])), "text": str(s.get("text", "")),
             "retried": bool(s.get("retried", False))}
            for s in inc.get("suppressed") or [] if isinstance(s, dict)]
    return pl.DataFrame(rows, schema=SUPPRESSED_SCHEMA).sort("ts", descending=True)


GUARD_JOB_SCHEMA = {"job": pl.String, "refusals": pl.Int64, "reasons": pl.String, "last_ts": pl.Float64,
                    "waiting": pl.Int64, "retried": pl.Int64}


def guard_state(con: duckdb.DuckDBPyConnection) -> dict[str, Any]:
    """The guard across the fleet as the lake's incidents record it: suppressions by reason, per job
    (refusals, reasons, the newest, open incidents whose eviction was refused and still waits for a
    person, evictions retried after a reset) and evictions in the newest hour. The breakers' live state
    is on the guard log (``faultlens guard status``); a job whose newest refusal is a cap or an open
    breaker most likely still has one open."""
    rows = _rows(con, "SELECT job, status, suppressed, suppressed_counts FROM incidents_latest "
                      "WHERE suppressed_counts IS NOT NULL AND suppressed_counts NOT IN ('', '{}', 'null')")
    by_reason: dict[str, int] = {}
    by_job: dict[str, dict[str, Any]] = {}
    for job, status, listed_raw, counts_raw in rows:
        counts, listed = _json(counts_raw, {}), _json(listed_raw, [])
        if not isinstance(counts, dict) or not counts:
            continue
        listed = [s for s in listed if isinstance(s, dict)] if isinstance(listed, list) else []
        j = by_job.setdefault(str(job), {"job": str(job), "refusals": 0, "reasons": set(), "last_ts": None,
                                       "waiting": 0, "retried": 0})
        for reason, n in counts.items():
            by_reason[str(reason)] = by_reason.get(str(reason), 0) + int(n)
            j["refusals"] += int(n)
            j["reasons"].add(str(reason))
        newest = max((float(s.get("ts") or 0.0) for s in listed), default=None)
        if newest is not None:
            j["last_ts"] = max(j["last_ts"] or newest, newest)
        evictions = [s for s in listed if s.get("type") == "evict_nodes" and s.get("reason") != "duplicate"]
        j["retried"] += sum(bool(s.get("retried")) for s in evictions)
        j["waiting"] += status == "open" and any(not s.get("retried") for s in evictions)
    frame = pl.DataFrame([{**j, "reasons": ", ".join(sorted(j["reasons"]))} for j in by_job.values()],
                         schema=GUARD_JOB_SCHEMA).sort(["waiting", "refusals"], descending=True)
    end = _rows(con, "SELECT max(ts) FROM actions_status")[0][0]
    evicted: set[str] = set()
    for (nodes,) in _rows(con, "SELECT nodes FROM actions_status WHERE type = 'evict_nodes' AND ts > ?",
                          [float(end or 0.0) - 3600.0]) if end else []:
        listed = _json(nodes, []) if isinstance(nodes, str) else nodes
        evicted.update(map(str, listed or []))
    return {"by_reason": dict(sorted(by_reason.items(), key=lambda kv: (-kv[1], kv[0]))), "jobs": frame,
            "evicted_last_hour": len(evicted), "waiting": int(frame["waiting"].sum()) if frame.height else 0}


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


def recorded_outliers(inc: dict[str, Any]) -> set[int]:
    """Ranks the incident's own stack aggregation called outliers (its ``stacks:aggregate`` evidence)."""
    out: set[int] = set()
    for e in inc.get("evidence", []):
        if e.get("rule") == "stacks:aggregate":
            out.update(int(r) for r in (e.get("figures") or {}).get("outliers", []))
    return out


def stack_groups(con: duckdb.DuckDBPyConnection, inc: dict[str, Any]) -> pl.DataFrame:
    """The job's stack dumps around the incident, grouped by diagnosis's own fingerprint; outliers first.

    ``group`` is the fingerprint's innermost frames; ``outlier`` is True for a group
    holding ranks the incident's recorded stack verdict named (when diagnosis
    aggregated stacks), else for the groups smaller than the largest, as diagnosis's
    dominant-group rule reads them. The dominant group is the healthy majority.
    """
    start, end = _incident_window(inc)
    dumps = _q(
        con,
        "SELECT rank, node, text, error FROM stacks WHERE job = ? AND ts BETWEEN ? AND ?",
        [inc["job"], start, end],
    )
    schema = {"group": pl.String, "ranks": pl.String, "nodes": pl.String, "count": pl.Int64, "share": pl.Float64,
              "outlier": pl.Boolean}
    # A node outside the job answers "no training process of this job here" without a rank: not the job's.
    dumps = dumps.filter(pl.col("rank").is_not_null() | pl.col("node").is_in(job_nodes(con, inc["job"])))
    if dumps.is_empty():
        return pl.DataFrame(schema=schema)

    def label(row: dict[str, Any]) -> str:
        if row["error"] is not None:
            return f"(no dump: {row['error']})"
        fp = fingerprint(row["text"] or "")
        return " < ".join(fp.split("\n")[:6]) if fp else "(empty stack dump)"

    dumps = dumps.with_columns(pl.struct("text", "error").map_elements(label, return_dtype=pl.String).alias("group"))
    total = dumps.height
    groups = (
        dumps.group_by("group")
        .agg(
            pl.col("rank").sort().cast(pl.String).str.join(", ").alias("ranks"),
            pl.col("rank").alias("_ranks"),
            pl.col("node").unique().sort().str.join(", ").alias("nodes"),
            pl.len().cast(pl.Int64).alias("count"),
        )
        .with_columns((pl.col("count") / total).alias("share"))
    )
    named = recorded_outliers(inc)
    if named:
        flag = pl.col("_ranks").list.eval(pl.element().is_in(list(named))).list.any()
    else:
        flag = pl.col("count") < pl.col("count").max()
    return groups.with_columns(flag.alias("outlier")).sort(["outlier", "count", "group"], descending=[True, False, False]) \
        .select(list(schema))


def _workload_frame(con: duckdb.DuckDBPyConnection, sql: str, params: list[Any]) -> pl.DataFrame:
    """Steps as the predictor sees them: its workload features and the rank's compute time."""
    frame = _q(con, sql, params)
    if frame.is_empty():
        return frame
    # tokens as models.predictor.workload_row reads them; compute time by its compute_time
    rows = frame.iter_rows(named=True)
    y = [compute_time(cast(StepTiming, _StepView(**r))) for r in rows]
    return frame.with_columns(pl.coalesce(pl.when(pl.col("tokens") > 0).then(pl.col("tokens")), pl.col("sum_len"))
                              .cast(pl.Float64).alias("tokens"),
                              pl.Series("compute_s", y, dtype=pl.Float64))


class _StepView:
    """The fields of a StepTiming that ``compute_time`` reads, from a query row."""

    __slots__ = ("duration_s", "fwd_s", "bwd_s", "comm_s")

    def __init__(self, duration_s: float, fwd_s: float | None, bwd_s: float | None, comm_s: float | None,
                 **_: Any) -> None:
        self.duration_s, self.fwd_s, self.bwd_s, self.comm_s = duration_s, fwd_s, bwd_s, comm_s


_STEP_COLUMNS = "duration_s, fwd_s, bwd_s, comm_s, tokens, sum_len, sum_len_sq, n_seqs"


def step_prediction(
    con: duckdb.DuckDBPyConnection, job: str, *, onset_ts: float, before_s: float = 1800.0, after_s: float = 900.0,
    fit_rows: int = 20_000,
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Each step's compute time observed vs predicted from its workload, around ``onset_ts``.

    The prediction is the fail-slow detector's own model (``models.predictor.
    StepTimePredictor``, Huber regression of a rank's compute time on the workload
    features ``WORKLOAD_FEATURES``: tokens, sum of squared lengths, sequence count),
    fitted on a sample of the job's steps before the onset. Long-sequence batches are
    predicted as slow, so only unexplained slowness shows as residual.

    Returns (per step: time, observed (slowest rank), predicted, residual;
    per rank: mean residual and observed/predicted ratio since the onset, highest
    first: the fail-slow suspects).
    """
    start, end = onset_ts - before_s, onset_ts + after_s
    sample = (f"SELECT {_STEP_COLUMNS} FROM steps WHERE job = ? AND ts BETWEEN ? AND ? "
              f"USING SAMPLE reservoir({int(fit_rows)} ROWS) REPEATABLE (7)")
    empty_steps = pl.DataFrame(schema={"time": pl.Datetime("us"), "step": pl.Int64, "observed_s": pl.Float64,
                                       "predicted_s": pl.Float64, "residual_s": pl.Float64})
    empty_ranks = pl.DataFrame(schema={"rank": pl.Int64, "node": pl.String, "steps": pl.Int64,
                                       "residual_s": pl.Float64, "slowdown": pl.Float64})
    model = StepTimePredictor()
    healthy = _workload_frame(con, sample, [job, start, onset_ts])
    if healthy.height < model.min_samples:  # nothing before the onset: fit on the whole window
        healthy = _workload_frame(con, sample, [job, start, end])
    if healthy.height < model.min_samples:
        return empty_steps, empty_ranks
    model.fit(healthy, healthy["compute_s"].to_list())
    assert model.coef_ is not None
    c = [float(v) for v in model.coef_]
    assert WORKLOAD_FEATURES == ("tokens", "sum_len_sq", "n_seqs")  # the order of the coefficients below
    # predict_matrix in SQL (same coefficients, same floor), and compute_time's rule per row
    pred = (f"greatest({c[0]!r} + {c[1]!r} * coalesce(nullif(tokens, 0), sum_len) + {c[2]!r} * sum_len_sq"
            f" + {c[3]!r} * n_seqs, 1e-6)")
    comp = ("CASE WHEN fwd_s IS NOT NULL AND bwd_s IS NOT NULL THEN fwd_s + bwd_s "
            "WHEN comm_s IS NOT NULL THEN greatest(duration_s - comm_s, 1e-6) ELSE duration_s END")
    per_step = _q(
        con,
        f"""
        WITH r AS (SELECT step, ts, rank, node, {comp} AS observed_s, {pred} AS predicted_s
                   FROM steps WHERE job = ? AND ts BETWEEN ? AND ?)
        SELECT step, max(ts) AS ts, max(observed_s) AS observed_s, max(predicted_s) AS predicted_s
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
               avg({comp} - {pred}) AS residual_s, avg({comp}) / nullif(avg({pred}), 0) AS slowdown
        FROM steps WHERE job = ? AND ts BETWEEN ? AND ? GROUP BY rank ORDER BY residual_s DESC LIMIT 10
        """,
        [job, onset_ts, end],
    )
    return per_step, per_rank


def headline(inc: dict[str, Any]) -> dict[str, str]:
    """What a person must read first: the culprit (node, GPU), the reason, the action taken."""
    top: dict[str, Any] = max(inc.get("suspects", []), key=lambda s: float(s.get("score") or 0.0), default={})
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


def job_span(con: duckdb.DuckDBPyConnection, job: str) -> tuple[float, float] | None:
    """(first, last) unix seconds of anything the lake holds of ``job`` (steps, incidents, actions,
    its layout, GPU samples); None when the lake has never heard of it."""
    row = _rows(
        con,
        """SELECT min(t0), max(t1) FROM (
             SELECT min(minute) AS t0, max(minute) + 60 AS t1 FROM steps_1m_parts WHERE job = ?
             UNION ALL SELECT min(opened_ts), max(updated_ts) FROM incidents_latest WHERE job = ?
             UNION ALL SELECT min(ts), max(ts) FROM actions WHERE job = ?
             UNION ALL SELECT min(ts), max(ts) FROM jobs WHERE job = ?
             UNION ALL SELECT min(minute), max(minute) + 60 FROM gpu_1m_parts WHERE job = ?)""",
        [job] * 5,
    )
    first, last = row[0] if row else (None, None)
    return None if first is None else (float(first), float(last))
