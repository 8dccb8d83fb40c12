"""The batch root-cause report of one job and time range: HTML (self-contained) or Markdown.

Every figure comes from ui.views, the same queries the explorer runs. The HTML
embeds its charts as inline SVG drawn here (no JavaScript, no stylesheet or font
fetched from anywhere), so the file opens offline, in a ticket or a mail
attachment. The Markdown form carries the same tables for chat and tickets.
"""

from __future__ import annotations

import datetime as dt
import html
from pathlib import Path
from typing import Any

import polars as pl

from faultlens.ui import views
from faultlens.ui.text import md_code, md_escape

SECTIONS = (
    ("summary", "Summary"),
    ("root-causes", "Root cause per incident"),
    ("downtime", "Downtime ledger"),
    ("xids", "Xid histogram"),
    ("machines", "Top failing machines"),
    ("rma", "RMA candidates"),
)


def _ts(value: float | None) -> str:
    if value is None:
        return "-"
    return dt.datetime.fromtimestamp(float(value), dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


def _dur(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = float(seconds)
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} d"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


def parse_time(value: str | float | None) -> float | None:
    """ISO 8601 (naive = UTC) or unix seconds -> unix seconds."""
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(value)
    except ValueError:
        pass
    when = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def collect(lake_path: str | Path, job: str, since: float | None = None, until: float | None = None) -> dict[str, Any]:
    """Every figure of the report, as plain data (the renderers only format it)."""
    con = views.connect(lake_path)
    try:
        nodes = views.job_nodes(con, job) or None
        ledger, gaps = views.downtime_ledger(con, job, since=since, until=until)
        lost_by_incident = {
            r["incident"]: r["lost_s"] for r in gaps.group_by("incident").agg(pl.col("lost_s").sum()).iter_rows(named=True)
        }
        label_rows = views.labels(con)
        latest_label: dict[str, dict[str, Any]] = {}
        for r in label_rows.iter_rows(named=True):  # newest first
            latest_label.setdefault(r["incident_id"], r)
        incidents = []
        for row in views.incidents(con, job=job, since=since, until=until).sort("opened_ts").iter_rows(named=True):
            inc = views.incident(con, row["id"]) or {}
            acts = views.actions(con, incident_id=row["id"])
            incidents.append({
                "id": row["id"], "opened_ts": row["opened_ts"], "severity": row["severity"], "status": row["status"],
                "kind": row["kind"], "category": row["category"], "title": row["title"],
                "confidence": row["confidence"], "headline": views.headline(inc),
                "evidence": [str(e.get("text", "")) for e in inc.get("evidence", [])[:3]],
                "actions": [f"{a['type']} {a['nodes']}".strip() + f" ({a['status']})" for a in acts.iter_rows(named=True)],
                "lost_s": lost_by_incident.get(row["id"]), "label": latest_label.get(row["id"]),
            })
        return {
            "job": job, "since": since, "until": until, "generated": dt.datetime.now(dt.UTC).timestamp(),
            "reliability": views.reliability(con, job, since=since, until=until),
            "incidents": incidents, "ledger": ledger, "gaps": gaps,
            "xids": views.xid_histogram(con, nodes=nodes, since=since, until=until),
            "machines": views.failing_machines(con, job=job, since=since, until=until),
            "rma": views.rma_candidates(con, job=job, since=since, until=until),
            "causes": cause_ledger(con, job, ledger, gaps),
        }
    finally:
        con.close()


def render_report(
    lake_path: str | Path, job: str, since: str | float | None = None, until: str | float | None = None,
    fmt: str = "html",
) -> str:
    """The report of ``job`` over [since, until) as HTML or Markdown text."""
    if fmt not in ("html", "md"):
        raise ValueError(f"fmt must be 'html' or 'md', not {fmt!r}")
    data = collect(lake_path, job, parse_time(since), parse_time(until))
    return render_html(data) if fmt == "html" else render_markdown(data)


# --------------------------------------------------------------------------- SVG


def svg_bars(labels: list[str], values: list[float], *, title: str, unit: str = "", colour: str = "#d62728") -> str:
    """A horizontal bar chart as inline SVG (no script, no external reference)."""
    if not values:
        return f'<p class="empty">{html.escape(title)}: nothing in this range.</p>'
    bar_h, gap, label_w, chart_w = 18, 6, 190, 420
    top = 24
    height = top + len(values) * (bar_h + gap) + 4
    peak = max(max(values), 1e-9)
    parts = [
        f'<svg role="img" width="{label_w + chart_w + 90}" height="{height}" '
        f'viewBox="0 0 {label_w + chart_w + 90} {height}" font-family="sans-serif" font-size="12">',
        f'<title>{html.escape(title)}</title>',
        f'<text x="0" y="14" font-weight="bold">{html.escape(title)}</text>',
    ]
    for i, (label, value) in enumerate(zip(labels, values, strict=True)):
        y = top + i * (bar_h + gap)
        w = max(1.0, chart_w * float(value) / peak)
        parts += [
            f'<text x="{label_w - 6}" y="{y + 13}" text-anchor="end">{html.escape(str(label))}</text>',
            f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="{colour}"/>',
            f'<text x="{label_w + w + 4:.1f}" y="{y + 13}">{html.escape(_num(value))}{html.escape(unit)}</text>',
        ]
    parts.append("</svg>")
    return "".join(parts)


def _num(value: float) -> str:
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.2f}"


# --------------------------------------------------------------------------- HTML

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{margin-bottom:0}.sub{color:#666;margin-top:.2em}
table{border-collapse:collapse;margin:.5em 0 1.2em;font-size:14px}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f4f4f4}.kpi{display:inline-block;margin:0 2em 1em 0}.kpi b{display:block;font-size:1.6em}
.incident{border-left:5px solid #d62728;padding:.3em 1em;margin:1em 0;background:#fafafa}
.incident.warning{border-color:#ff7f0e}.incident.info{border-color:#1f77b4}
code{font-size:12px;white-space:pre-wrap;word-break:break-all}.empty{color:#666}
"""


def _table(frame: pl.DataFrame, columns: list[str] | None = None) -> str:
    if frame.is_empty():
        return '<p class="empty">None in this range.</p>'
    columns = columns or frame.columns
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    rows = []
    for r in frame.select(columns).iter_rows():
        cells = "".join(f"<td>{html.escape(_cell(v))}</td>" for v in r)
        rows.append(f"<tr>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return _num(value)
    if isinstance(value, dt.datetime):
        return value.strftime("%Y-%m-%d %H:%M")
    return str(value)


def _ledger_frame(data: dict[str, Any]) -> pl.DataFrame:
    return data["ledger"].with_columns(
        pl.col("lost_s").map_elements(_dur, return_dtype=pl.String).alias("time lost"),
        (pl.col("share") * 100).round(1).alias("% of wall-clock"),
    ).select("cause", "time lost", "incidents", "% of wall-clock")


def render_html(data: dict[str, Any]) -> str:
    rel = data["reliability"]
    window = f"{_ts(data['since'])} – {_ts(data['until'])}" if data["since"] or data["until"] else "whole job"
    out = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>faultlens report: {html.escape(data['job'])}</title><style>{_CSS}</style></head><body>",
        f"<h1>Root-cause report: job {html.escape(data['job'])}</h1>",
        f"<p class='sub'>{html.escape(window)} · generated {_ts(data['generated'])} by faultlens</p>",
        "<h2 id='summary'>Summary</h2><div>",
    ]
    kpis = [
        ("ETTR", f"{rel['ettr']:.1%}" if rel["ettr"] is not None else "-"),
        ("wall-clock", _dur(rel["wall_s"])),
        ("failures", str(rel["failures"])),
        ("MTBF", _dur(rel["mtbf_s"])),
        ("MTTR", _dur(rel["mttr_s"])),
        ("incidents", str(len(data["incidents"]))),
    ]
    out += [f"<div class='kpi'>{html.escape(k)}<b>{html.escape(v)}</b></div>" for k, v in kpis]
    out.append("</div><p>ETTR: productive step time / wall-clock. MTBF: wall-clock / failures (critical incidents "
               "acted on; one culprit's within an hour count once; a tolerated flap is no failure). "
               "MTTR: mean gap in step progress attributed to an incident.</p>")
    out.append("<h2 id='root-causes'>Root cause per incident</h2>")
    if not data["incidents"]:
        out.append("<p class='empty'>No incident in this range.</p>")
    for inc in data["incidents"]:
        head = inc["headline"]
        label = inc["label"]
        cause = (f"{label['kind']} ({label['verdict']} by {label['author'] or 'someone'})" if label
                 else f"{inc['kind']} (diagnosed, {inc['confidence']:.0%})")
        ev = "".join(f"<li><code>{html.escape(t)}</code></li>" for t in inc["evidence"])
        out.append(
            f"<div class='incident {html.escape(inc['severity'])}'>"
            f"<h3>{html.escape(inc['title'])}</h3>"
            f"<p><b>Culprit:</b> {html.escape(head['culprit'])} · <b>why:</b> {html.escape(head['reason'])}</p>"
            f"<p><b>Root cause:</b> {html.escape(cause)} · {html.escape(inc['category'])} · "
            f"{html.escape(inc['severity'])} · opened {_ts(inc['opened_ts'])} · status {html.escape(inc['status'])} · "
            f"time lost {_dur(inc['lost_s'])}</p>"
            f"<p><b>Actions:</b> {html.escape('; '.join(inc['actions']) or 'none')}</p>"
            f"<p><b>Evidence:</b></p><ul>{ev}</ul><p class='sub'>{html.escape(inc['id'])}</p></div>"
        )
    ledger = data["ledger"]
    out.append("<h2 id='downtime'>Downtime ledger</h2>")
    out.append(svg_bars(ledger["cause"].to_list(), [v / 3600 for v in ledger["lost_s"].to_list()],
                        title="Hours lost per cause", unit=" h"))
    out.append(_table(_ledger_frame(data)))
    out.append(_causes_html(data))
    xids = data["xids"]
    out.append("<h2 id='xids'>Xid histogram</h2>")
    out.append(svg_bars([f"Xid {x}" for x in xids["xid"].to_list()], [float(v) for v in xids["events"].to_list()],
                        title="Xid events per code", colour="#1f77b4"))
    out.append(_table(xids))
    out.append("<h2 id='machines'>Top failing machines</h2>")
    out.append(_table(data["machines"]))
    out.append("<h2 id='rma'>RMA candidates</h2>")
    out.append("<p>GPUs with a row-remap failure, or at least two double-bit ECC errors in the range.</p>")
    out.append(_table(data["rma"]))
    out.append("</body></html>")
    return "\n".join(out)


# --------------------------------------------------------------------------- cause ledger (issue 25)

CAUSE_ORDER = ("detection", "localisation", "restart", "recurrence", "degraded", "unattributed")


def cause_ledger(con: Any, job: str, ledger: pl.DataFrame, gaps: pl.DataFrame) -> dict[str, float]:
    """The lake's unproductive time split by the causes of ``faultlens simulate campaign``.

    Per progress gap blamed on an incident: detection = from the gap's start to the incident's
    opening; localisation = from then to the incident's first action; restart = the rest of the
    gap (recomputed steps are not visible in a lake without step numbers: they stay in "restart"
    when the steps re-run, else count as productive). A later gap blamed on the same incident is
    "recurrence"; gaps blamed on nothing are "unattributed"; "slow steps and overhead" outside
    gaps is "degraded".
    """
    out = dict.fromkeys(CAUSE_ORDER, 0.0)
    acts = views.actions(con, job=job)
    first_action = {r["incident_id"]: r["ts"] for r in acts.group_by("incident_id").agg(pl.col("ts").min())
                    .iter_rows(named=True)}
    opened = {r["id"]: r["opened_ts"] for r in views.incidents(con, job=job).iter_rows(named=True)}
    seen: set[str] = set()
    for g in gaps.sort("start_ts").iter_rows(named=True):
        start, end, inc = float(g["start_ts"]), float(g["end_ts"]), g["incident"]
        if inc is None:
            out["unattributed"] += end - start
            continue
        if inc in seen:
            out["recurrence"] += end - start
            continue
        seen.add(inc)
        t_open = min(max(float(opened.get(inc, start)), start), end)
        t_act = min(max(float(first_action.get(inc, t_open) or t_open), t_open), end)
        out["detection"] += t_open - start
        out["localisation"] += t_act - t_open
        out["restart"] += end - t_act
    rest = ledger.filter(pl.col("cause") == "slow steps and overhead")["lost_s"]
    out["degraded"] = float(rest.sum()) if rest.len() else 0.0
    return out


def _causes_html(data: dict[str, Any]) -> str:
    causes = data.get("causes") or {}
    rows = "".join(f"<tr><td>{html.escape(c)}</td><td>{html.escape(_dur(v))}</td></tr>" for c, v in causes.items())
    return ("<h3>Unproductive time by cause</h3><table><tr><th>cause</th><th>time lost</th></tr>" + rows +
            "</table><p>Same causes as <code>faultlens simulate campaign</code>: detection (gap start to the "
            "incident), localisation (incident to its first action), restart (the rest of the gap), recurrence "
            "(later gaps of the same incident), degraded (slow steps outside gaps).</p>")


def _causes_md(data: dict[str, Any]) -> str:
    causes = data.get("causes") or {}
    return "### Unproductive time by cause\n\n| cause | time lost |\n|---|---|\n" + "".join(
        f"| {c} | {_dur(v)} |\n" for c, v in causes.items())


# --------------------------------------------------------------------------- Markdown


def _md_table(frame: pl.DataFrame) -> str:
    if frame.is_empty():
        return "_None in this range._\n"
    lines = ["| " + " | ".join(md_escape(c) for c in frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    for r in frame.iter_rows():
        lines.append("| " + " | ".join(md_escape(_cell(v)) for v in r) + " |")
    return "\n".join(lines) + "\n"


def render_markdown(data: dict[str, Any]) -> str:
    """The report as Markdown: every string from the lake (log text, names, ids) escaped or in a code span."""
    rel = data["reliability"]
    out = [
        f"# Root-cause report: job {md_code(data['job'])}",
        "",
        f"_{_ts(data['since'])} – {_ts(data['until'])}_" if data["since"] or data["until"] else "_whole job_",
        "",
        "## Summary",
        "",
        f"- **ETTR** {rel['ettr']:.1%}" if rel["ettr"] is not None else "- **ETTR** -",
        f"- **wall-clock** {_dur(rel['wall_s'])}, **failures** {rel['failures']}, "
        f"**MTBF** {_dur(rel['mtbf_s'])}, **MTTR** {_dur(rel['mttr_s'])}",
        "",
        "## Root cause per incident",
        "",
    ]
    if not data["incidents"]:
        out.append("_No incident in this range._")
    for inc in data["incidents"]:
        head = inc["headline"]
        label = inc["label"]
        cause = f"{label['kind']} ({label['verdict']})" if label else f"{inc['kind']} (diagnosed, {inc['confidence']:.0%})"
        out += [
            f"### [{md_escape(inc['severity'])}] {md_escape(inc['title'])}",
            f"- **Culprit:** {md_escape(head['culprit'])} — {md_escape(head['reason'])}",
            f"- **Root cause:** {md_escape(cause)}; opened {_ts(inc['opened_ts'])}; time lost {_dur(inc['lost_s'])}",
            f"- **Actions:** {md_escape('; '.join(inc['actions']) or 'none')}",
            *(f"- {md_code(t)}" for t in inc["evidence"]),
            f"- incident {md_code(inc['id'])}",
            "",
        ]
    out += ["## Downtime ledger", "", _md_table(_ledger_frame(data)), _causes_md(data), "## Xid histogram", "", _md_table(data["xids"]),
            "## Top failing machines", "", _md_table(data["machines"]), "## RMA candidates", "", _md_table(data["rma"])]
    return "\n".join(out)


# --------------------------------------------------------------------------- batch diagnosis


def render_batch_report(path: Path, incidents: list[Any], actions: list[Any], detectors: list[Any], n_records: int,
                        read_s: float, diag_s: float, *, clocks: dict[str, Any] | None = None,
                        errors: list[str] | None = None) -> str:
    """report.md of ``faultlens diagnose DIR``: what was read, the actions, then each incident with
    its suspects, evidence and muted symptoms (the records diagnosis produced, not a recomputation)."""
    lines = [f"# faultlens diagnosis of {md_code(path)}", "",
             f"{n_records:,} records read in {read_s:.1f} s, diagnosed in {diag_s:.1f} s. "
             f"Detectors: {md_escape(', '.join(getattr(d, 'name', '?') for d in detectors) or 'none')}."]
    if errors:
        lines.append(f"{len(errors)} input line(s) could not be read, e.g. {md_code(errors[0][:200])}.")
    estimated = {n: c for n, c in (clocks or {}).items() if c.estimated}
    if estimated:
        how = sorted({c.boot_from or "untimed lines" for c in estimated.values()})
        lines.append(f"Log times estimated on {len(estimated)} node(s) ({md_escape(', '.join(how))}): "
                     f"{sum(c.estimated for c in estimated.values()):,} record(s) marked `ts_estimated`.")
    lines += ["", "## Actions", ""]
    if not actions:
        lines.append("No action: nothing needed the runner.")
    for a in actions:
        lines.append(f"- **{md_escape(a.type)}** {md_escape(', '.join(a.nodes) or '(job)')} (confidence {a.confidence:.2f}"
                     f"{', dry run' if a.dry_run else ''}): {md_escape(a.reason)}")
    lines += ["", "## Incidents", ""]
    for i in incidents:
        lines.append(f"### {md_escape(i.title)} [{md_escape(i.status)}]")
        lines.append(f"kind {md_code(i.kind)}, category {md_code(i.category)}, confidence {i.confidence:.2f}. "
                     f"{md_escape(i.summary)}")
        for s in i.suspects[:5]:
            lines.append(f"- suspect **{md_escape(s['node'])}** score {s['score']:.2f}: {md_escape(s.get('reason', '')[:200])}")
        for e in i.evidence[:5]:
            text = str(e.get("text") or "")[:160].splitlines()
            lines.append(f"  - {md_code(e.get('source'))} {md_escape(e.get('node') or '')} {md_code(text[0]) if text else ''}")
        if i.muted:
            counts: dict[str, int] = {}
            for m in i.muted:
                k = str(m.get("kind") or str(m.get("item", "")).split(":", 1)[0])
                counts[k] = counts.get(k, 0) + int(m.get("count", 1))
            by_kind = ", ".join(f"{k} {n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))
            lines.append(f"- muted {sum(counts.values())} symptom(s) ({md_escape(by_kind)}), e.g. {md_code(i.muted[0]['item'][:120])} "
                         f"(rule {md_code(i.muted[0]['by_rule'])})")
        lines.append("")
    return "\n".join(lines) + "\n"
