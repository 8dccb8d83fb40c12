"""Altair chart builders: a frame from ui.views in, a chart out.

Plain functions with no Streamlit import, so tests check the Vega-Lite spec
(``chart.to_dict()``) directly. Views already aggregate to at most
``views.MAX_CHART_ROWS`` rows, the limit Altair embeds without complaint.
Colours say the same thing everywhere: red is the culprit, orange what the
runner evicts, grey the healthy rest.
"""

from __future__ import annotations

import altair as alt
import polars as pl

STATE_COLOURS = {"suspect": "#d62728", "evicted": "#ff7f0e", "healthy": "#d9d9d9"}
SEVERITY_COLOURS = {"critical": "#d62728", "warning": "#ff7f0e", "info": "#1f77b4"}
SOURCE_ORDER = ["kernel", "gpu", "nccl", "steps", "stacks"]


def time_x(frame: pl.DataFrame, field: str = "time", **kw: object) -> alt.X:
    """A time x-axis that reads as times: 24-hour clock, dates where the range spans days,
    seconds (and milliseconds) only where the range is that short.

    Vega's default multi-format labels a sub-second range ``.800 .800 .400``: a fixed
    format per range instead. Times are the lake's UTC, shown as they are (no zone shift).
    """
    values = frame[field].drop_nulls() if field in frame.columns else pl.Series([], dtype=pl.Datetime)
    lo, hi = (values.min(), values.max()) if values.len() else (None, None)
    span = (hi - lo).total_seconds() if lo is not None and hi is not None else 0.0  # type: ignore[operator, union-attr]
    if lo is not None and hi is not None and lo.date() != hi.date():  # type: ignore[union-attr]
        fmt = "%b %d %H:%M"
    elif span < 10:
        fmt = "%H:%M:%S.%L"
    elif span < 3600:  # ticks less than a minute apart: minutes alone would repeat (09:40 09:40)
        fmt = "%H:%M:%S"
    else:
        fmt = "%H:%M"
    kw.setdefault("title", None)
    return alt.X(f"{field}:T", axis=alt.Axis(format=fmt, labelOverlap=True), **kw)  # type: ignore[arg-type]


def severity_bar(counts: dict[str, int]) -> alt.Chart:
    """Open incidents per severity."""
    frame = pl.DataFrame({"severity": list(counts), "incidents": list(counts.values())})
    return (
        alt.Chart(frame, title="Open incidents")
        .mark_bar()
        .encode(
            # whole incidents on the axis (no 0.2 steps), one band per severity of a fixed height
            x=alt.X("incidents:Q", title="open incidents", axis=alt.Axis(tickMinStep=1, format="d"),
                    scale=alt.Scale(domainMin=0, nice=True)),
            y=alt.Y("severity:N", sort=list(SEVERITY_COLOURS), title=None),
            color=alt.Color("severity:N", scale=alt.Scale(domain=list(SEVERITY_COLOURS),
                                                          range=list(SEVERITY_COLOURS.values())), legend=None),
            tooltip=["severity", "incidents"],
        )
        .properties(height=alt.Step(28))
    )


def ettr_bar(frame: pl.DataFrame) -> alt.Chart:
    """Effective training time ratio per job (views.ettr)."""
    return (
        alt.Chart(frame.select("job", "ettr", "productive_s", "wall_s"), title="Effective training time ratio")
        .mark_bar()
        .encode(
            x=alt.X("ettr:Q", scale=alt.Scale(domain=[0, 1]), axis=alt.Axis(format="%"), title="ETTR"),
            y=alt.Y("job:N", title=None),
            color=alt.condition(alt.datum.ettr < 0.9, alt.value("#ff7f0e"), alt.value("#2ca02c")),
            tooltip=["job", alt.Tooltip("ettr:Q", format=".1%"), "productive_s", "wall_s"],
        )
        .properties(height=alt.Step(24))
    )


def evidence_chart(frame: pl.DataFrame) -> alt.Chart:
    """Evidence and context lines on one time axis, a lane per source (views.evidence_timeline)."""
    data = frame.select("time", "source", "node", "evidence", "text").with_columns(
        pl.col("text").str.slice(0, 160),
        pl.col("node").fill_null("(job-wide)"),  # a legend never reads "null"
        pl.when(pl.col("evidence")).then(pl.lit("cited by diagnosis")).otherwise(pl.lit("context")).alias("kind"),
    )
    return (
        alt.Chart(data, title="Evidence timeline")
        .mark_point(filled=True, size=120)
        .encode(
            x=time_x(data),
            y=alt.Y("source:N", sort=SOURCE_ORDER, title=None),
            color=alt.Color("kind:N", scale=alt.Scale(domain=["cited by diagnosis", "context"],
                                                      range=["#d62728", "#7f7f7f"]), title=None),
            shape=alt.Shape("node:N", title="node"),
            tooltip=[alt.Tooltip("time:T", format="%Y-%m-%d %H:%M:%S.%L"), "source", "node", "text"],
        )
        .properties(height=160)
    )


def topology_chart(frame: pl.DataFrame) -> alt.LayerChart:
    """Ranks as a grid: tp x dp across, pp down; suspects red, evicted orange (views.topology_grid)."""
    base = alt.Chart(frame, title="Job topology (tp x dp across, pipeline stage down)").encode(
        x=alt.X("column:O", title="data-parallel replica x tensor-parallel rank", axis=alt.Axis(labels=False, ticks=False)),
        y=alt.Y("pp:O", title="pipeline stage"),
    )
    cells = base.mark_rect(stroke="white", strokeWidth=1).encode(
        color=alt.Color("state:N", scale=alt.Scale(domain=list(STATE_COLOURS), range=list(STATE_COLOURS.values())),
                        title=None),
        tooltip=["rank", "node", "gpu", "tp", "pp", "dp", "cp", "state"],
    )
    columns: list[int] = frame["column"].to_list()
    width = max(columns) + 1 if columns else 1
    labels = base.mark_text(fontSize=9 if width <= 64 else 0).encode(text="rank:Q")
    return (cells + labels).properties(height=alt.Step(28), width=alt.Step(max(6, min(28, 900 // width))))


def step_time_chart(frame: pl.DataFrame) -> alt.VConcatChart:
    """Observed (slowest rank) vs predicted step time, and the residual below (views.step_prediction)."""
    long = frame.unpivot(index=["time", "step"], on=["observed_s", "predicted_s"], variable_name="series",
                         value_name="seconds")
    lines = (
        alt.Chart(long, title="Step time: observed vs predicted from the workload")
        .mark_line(point=False)
        .encode(
            x=time_x(long),
            y=alt.Y("seconds:Q", title="step time (s)"),
            color=alt.Color("series:N", scale=alt.Scale(domain=["observed_s", "predicted_s"],
                                                        range=["#d62728", "#1f77b4"]), title=None),
            tooltip=["step", "series", alt.Tooltip("seconds:Q", format=".3f")],
        )
        .properties(height=180)
    )
    residual = (
        alt.Chart(frame.select("time", "step", "residual_s"))
        .mark_bar()
        .encode(
            x=time_x(frame),
            y=alt.Y("residual_s:Q", title="residual (s)"),
            color=alt.condition(alt.datum.residual_s > 0, alt.value("#d62728"), alt.value("#1f77b4")),
            tooltip=["step", alt.Tooltip("residual_s:Q", format=".3f")],
        )
        .properties(height=90)
    )
    return alt.vconcat(lines, residual)


def gpu_heatmap_chart(frame: pl.DataFrame, *, title: str) -> alt.Chart:
    """GPU x time heatmap of one counter (views.gpu_heatmap); a counter that stayed 0 is uniformly pale."""
    peak = frame["value"].max() if frame.height else None
    domain = [0, 1] if not peak else alt.Undefined
    return (
        alt.Chart(frame, title=title)
        .mark_rect()
        .encode(
            x=time_x(frame),
            x2="end:T",
            y=alt.Y("gpu:O", title="GPU"),
            color=alt.Color("value:Q", scale=alt.Scale(scheme="inferno", reverse=True, domain=domain), title=None),
            tooltip=[alt.Tooltip("time:T", format="%Y-%m-%d %H:%M"), "gpu", alt.Tooltip("value:Q", format=".1f")],
        )
        .properties(height=alt.Step(14))
    )


def downtime_chart(ledger: pl.DataFrame) -> alt.Chart:
    """Time lost per cause (views.downtime_ledger)."""
    data = ledger.with_columns((pl.col("lost_s") / 3600).alias("lost_h"))
    return (
        alt.Chart(data, title="Time lost per cause")
        .mark_bar()
        .encode(
            x=alt.X("lost_h:Q", title="hours lost"),
            y=alt.Y("cause:N", sort="-x", title=None),
            tooltip=["cause", alt.Tooltip("lost_h:Q", format=".2f"), "incidents"],
        )
    )


def xid_chart(frame: pl.DataFrame) -> alt.Chart:
    """Xid events per code (views.xid_histogram)."""
    return (
        alt.Chart(frame, title="Xid events")
        .mark_bar()
        .encode(
            x=alt.X("xid:O", title="Xid"),
            y=alt.Y("events:Q", title="events"),
            tooltip=["xid", "events", "nodes"],
        )
    )
