"""A campaign's results as a printed table, a JSON summary, a PNG chart and a self-contained HTML page.

The chart is BR 8.1.3's sliding one-hour ETTR, one line per policy (first seed).
The PNG is drawn with Pillow (installed with the [ui] extra); without it the
HTML (inline SVG, no JavaScript) still carries the chart.
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

import numpy as np

from faultlens.datasets.campaign import CAUSES, POLICIES, CampaignRun, Cost, cost_rows

COLOURS = {"none": "#d62728", "restart": "#ff7f0e", "group_evict": "#9467bd", "faultlens": "#1f77b4",
           "oracle": "#2ca02c"}


def _h(seconds: float) -> str:
    return f"{seconds / 3600:.1f}"


def summary(run: CampaignRun) -> dict[str, Any]:
    """The JSON line: ETTR per policy (mean over seeds), its spread, the gap to the oracle, the ledger."""
    ettr = {p: round(run.ettr(p)[0], 5) for p in POLICIES}
    oracle = ettr["oracle"]
    right = [d.right for d in run.decisions.values()]
    return {
        "bench": "ettr", "gpus": run.spec.gpus, "layout": run.spec.layout, "days": run.spec.days,
        "seeds": len(run.seeds), "failures_mean": round(float(np.mean(run.failures_per_seed)), 1),
        "ettr": ettr,
        "ettr_std": {p: round(run.ettr(p)[1], 5) for p in POLICIES},
        "gap_to_oracle": {p: round(oracle - ettr[p], 5) for p in POLICIES},
        "faultlens_gain_over": {p: round(ettr["faultlens"] - ettr[p], 5) for p in POLICIES if p != "faultlens"},
        "lost_h": {p: {c: round(v / 3600, 2) for c, v in run.lost_mean(p).items()} for p in POLICIES},
        "rsc_analytic_ettr": round(run.analytic["rsc_ettr"], 5),
        "decisions": len(right), "decisions_right": sum(right),
        "bus_checked": len(run.bus), "bus_agree": sum(b.action == o.action and b.named == o.named for b, o in run.bus),
    }


def text_tables(run: CampaignRun, costs: dict[str, dict[str, Cost]] | None = None) -> str:
    """The printed report: ETTR per policy, hours lost by cause, faultlens's decisions, the bus check."""
    s = run.spec
    lines = [f"campaign: {s.gpus:,} GPUs ({s.nodes:,} machines x {s.gpus_per_node}), {s.layout}, {s.days:g} days, "
             f"checkpoint every {s.get('checkpoint_interval_s'):.0f} s, {s.get('warm_standbys'):.0f} warm standbys; "
             f"seeds {run.seeds}; failures per seed {run.failures_per_seed}", ""]
    head = f"{'policy':<12} {'ETTR mean':>9} {'std':>7} {'min':>7} {'max':>7} " + " ".join(
        f"{c[:12]:>12}" for c in CAUSES) + f" {'unfixed':>7} {'out':>5} {'waits':>5}"
    lines += ["ETTR and unproductive hours by cause (mean over seeds)", head, "-" * len(head)]
    for p in POLICIES:
        mean, std, lo, hi = run.ettr(p)
        lost = run.lost_mean(p)
        rs = run.results[p]
        lines.append(f"{p:<12} {mean:>9.4f} {std:>7.4f} {lo:>7.4f} {hi:>7.4f} " + " ".join(
            f"{_h(lost[c]):>12}" for c in CAUSES) + f" {np.mean([r.wrong for r in rs]):>7.1f} "
            f"{np.mean([r.machines_out for r in rs]):>5.0f} {np.mean([r.standby_waits for r in rs]):>5.1f}")
    a = run.analytic
    lines += ["", f"Meta RSC analytic estimate, same job (1 - (u0 + ckpt/2)/MTTF, u0 = {a['restart_overhead_s']:.0f} s): "
              f"{a['rsc_ettr']:.4f} (with a {costs['job']['checkpoint_write_s'].value if costs else '?'} s checkpoint "
              f"write: {a['rsc_ettr_with_write']:.4f}); simulated oracle {run.ettr('oracle')[0]:.4f}, "
              f"none {run.ettr('none')[0]:.4f}", "",
              "faultlens decisions (one rendered + diagnosed sample per kind and seed bucket)",
              f"{'kind':<20} {'#':>2} {'expected':<16} {'decided':<18} {'right':<5} {'detect s':>8} {'decide s':>8} "
              f"{'named':>5} {'extra':>5} {'speed':>5} {'plan':>5} {'records':>8} {'sec':>5}  (plan: the adaptation's "
              f"throughput / fault-free, re-planned on the whole job; speed: measured without action)"]
    for (kind, bucket), d in sorted(run.decisions.items()):
        lines.append(f"{kind:<20} {bucket:>2} {d.expected_action:<16} {d.action:<18} {'yes' if d.right else 'NO':<5} "
                     f"{'-' if d.detect_s is None else f'{d.detect_s:.0f}':>8} {d.decide_s:>8.0f} {d.named:>5} "
                     f"{d.extra_machines:>5} {d.slow_speed:>5.2f} "
                     f"{'-' if d.adapt_ratio is None else f'{d.adapt_ratio:.3f}':>5} {d.records:>8,} "
                     f"{d.render_s + d.diagnose_s:>5.1f}")
    if run.bus:
        lines += ["", "bus check: the same records through the embedded broker to the online DiagnosisService"]
        for b, o in run.bus:
            same = b.action == o.action and b.named == o.named
            lines.append(f"  {b.kind:<20} batch {b.action:<18} bus {o.action:<18} named {b.named}/{o.named} "
                         f"detect {b.detect_s if b.detect_s is None else round(b.detect_s)}/"
                         f"{o.detect_s if o.detect_s is None else round(o.detect_s)} s  {'agree' if same else 'DIFFER'}")
    return "\n".join(lines)


def cost_table_text(costs: dict[str, dict[str, Cost]]) -> str:
    rows = cost_rows(costs)
    w = max(len(f"{s}.{n}") for s, n, _, _ in rows)
    return "\n".join([f"{'cost':<{w}}  {'value':>8}  source"] +
                     [f"{s + '.' + n:<{w}}  {v:>8}  {src}" for s, n, v, src in rows])


def _series(run: CampaignRun) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return {p: run.results[p][0].sliding_ettr() for p in POLICIES}


def _cumulative(run: CampaignRun, policy: str) -> tuple[np.ndarray, np.ndarray]:
    """Cumulative ETTR (productive so far / wall-clock so far) every hour, first seed."""
    segs = run.results[policy][0].segments
    if not segs:
        return np.zeros(0), np.zeros(0)
    t = np.array([segs[0][0]] + [x[1] for x in segs])
    cum = np.concatenate([[0.0], np.cumsum([(x[1] - x[0]) * x[2] for x in segs])])
    ends = np.arange(3600.0, t[-1] + 1e-9, 3600.0)
    return ends, np.interp(ends, t, cum) / ends


def write_png(run: CampaignRun, path: str | Path, *, width: int = 1400, panel_h: int = 300,
              zoom_days: float = 3.0) -> Path | None:
    """Two panels (first seed): the sliding one-hour ETTR over the first ``zoom_days`` days (BR
    8.1.3's chart; over 90 days the dips are too dense to read), and the cumulative ETTR over the
    whole campaign. None when Pillow is not installed."""
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        return None
    img = Image.new("RGB", (width, 2 * panel_h + 40), "white")
    draw = ImageDraw.Draw(img)
    sliding = {p: run.results[p][0].sliding_ettr() for p in POLICIES}
    cumulative = {p: _cumulative(run, p) for p in POLICIES}
    lows = [float(v.min()) for _, v in cumulative.values() if len(v)]
    cum_lo = max(0.0, math.floor((min(lows) if lows else 0.0) * 20) / 20 - 0.05)
    panels = [(sliding, 0.0, zoom_days * 86400.0, f"sliding one-hour ETTR, days 0-{zoom_days:g} (first seed)"),
              (cumulative, cum_lo, run.spec.duration_s, "cumulative ETTR over the campaign (first seed)")]
    left, right = 60, width - 190
    for n, (series, lo, t_end, title) in enumerate(panels):
        top, bottom = 30 + n * (panel_h + 20), 30 + n * (panel_h + 20) + panel_h - 40

        def xy(t: float, v: float, lo: float = lo, t_end: float = t_end, top: int = top,
               bottom: int = bottom) -> tuple[float, float]:
            return (left + (right - left) * t / t_end, bottom - (bottom - top) * (v - lo) / (1.0 - lo))

        draw.text((left, top - 18), title, fill="black")
        for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
            y = bottom - (bottom - top) * frac
            draw.line([(left, y), (right, y)], fill="#dddddd")
            draw.text((8, y - 6), f"{lo + frac * (1 - lo):.2f}", fill="black")
        days = t_end / 86400.0
        tick = max(1, int(days // 9)) if days >= 9 else 0.5
        d = 0.0
        while d <= days + 1e-9:
            draw.text((left + (right - left) * d / days - 8, bottom + 6), f"d{d:g}", fill="black")
            d += tick
        for i, p in enumerate(POLICIES):
            t, v = series[p]
            keep = t <= t_end
            pts = [xy(float(a), float(b)) for a, b in zip(t[keep], v[keep], strict=True)]
            if len(pts) > 1:
                draw.line(pts, fill=COLOURS[p], width=2 if p == "faultlens" else 1)
            if n == 0:
                draw.line([(right + 15, top + 20 * i + 6), (right + 35, top + 20 * i + 6)], fill=COLOURS[p], width=3)
                draw.text((right + 40, top + 20 * i), f"{p} {run.ettr(p)[0]:.3f}", fill="black")
    draw.text((width - 185, panel_h + 10), "legend: ETTR, mean of seeds", fill="black")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    img.save(out)
    return out


def svg_chart(run: CampaignRun, *, width: int = 1100, height: int = 380) -> str:
    """The same chart as inline SVG (for the HTML page)."""
    left, right, top, bottom = 50, width - 170, 20, height - 30
    series = _series(run)
    t_end = max((float(t[-1]) for t, _ in series.values() if len(t)), default=1.0)
    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' font-size='11'>"]
    for frac in (0.0, 0.5, 1.0):
        y = bottom - (bottom - top) * frac
        parts.append(f"<line x1='{left}' x2='{right}' y1='{y:.0f}' y2='{y:.0f}' stroke='#ddd'/>"
                     f"<text x='5' y='{y + 4:.0f}'>{frac:.1f}</text>")
    for i, p in enumerate(POLICIES):
        t, v = series[p]
        step = max(1, len(t) // 2000)
        pts = " ".join(f"{left + (right - left) * float(a) / t_end:.1f},{bottom - (bottom - top) * float(b):.1f}"
                       for a, b in zip(t[::step], v[::step], strict=True))
        parts.append(f"<polyline fill='none' stroke='{COLOURS[p]}' stroke-width='1' points='{pts}'/>")
        parts.append(f"<text x='{right + 10}' y='{top + 16 * i + 10}' fill='{COLOURS[p]}'>"
                     f"{html.escape(p)} {run.ettr(p)[0]:.3f}</text>")
    parts.append("</svg>")
    return "".join(parts)


def write_html(run: CampaignRun, path: str | Path, costs: dict[str, dict[str, Cost]]) -> Path:
    """One self-contained page: the chart, the tables and the cost sources."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    body = ["<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>faultlens campaign ETTR</title>",
            "<style>body{font-family:sans-serif;margin:2em}pre{font-size:12px}</style></head><body>",
            "<h1>Training time given back: campaign ETTR per policy</h1>",
            "<h2>Sliding one-hour ETTR</h2>", svg_chart(run),
            "<h2>ETTR, unproductive hours by cause, faultlens's decisions</h2>",
            f"<pre>{html.escape(text_tables(run, costs))}</pre>",
            "<h2>Costs and their sources</h2>", f"<pre>{html.escape(cost_table_text(costs))}</pre>",
            "</body></html>"]
    out.write_text("\n".join(body))
    return out
