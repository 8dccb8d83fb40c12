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

from faultlens.datasets.campaign import CAUSES, POLICIES, Cost, cost_rows
from faultlens.datasets.campaign_hard import HARD, describe
from faultlens.datasets.campaign_outcomes import OUTCOMES, classify, sample_noise
from faultlens.datasets.campaign_render import Decision
from faultlens.datasets.campaign_run import CampaignRun, crossover

COLOURS = {"none": "#d62728", "restart": "#ff7f0e", "group_evict": "#9467bd", "faultlens": "#1f77b4",
           "oracle": "#2ca02c"}


def _h(seconds: float) -> str:
    return f"{seconds / 3600:.1f}"


def per_kind_accuracy(run: CampaignRun) -> dict[str, dict[str, Any]]:
    """Per rendered kind: renders, share right with its 95% Wilson interval, and what each outcome was."""
    out = {}
    for kind in sorted(run.outcomes.by_kind):
        p, lo, hi, n = run.outcomes.accuracy(kind)
        out[kind] = {"n": n, "right": round(p, 4), "lo": round(lo, 4), "hi": round(hi, 4),
                     "half_width": round((hi - lo) / 2, 4), "outcomes": run.outcomes.counts(kind)}
    return out


def hard_vs_clean(run: CampaignRun) -> dict[str, dict[str, Any]]:
    """Per hard kind: the share right of its hard renders and of the clean renders of the same (kind, i)."""
    out: dict[str, dict[str, Any]] = {}
    if run.clean is None:
        return out
    for kind in sorted(k for k in run.outcomes.by_kind if k in HARD):
        hard = run.outcomes.by_kind[kind]
        clean = run.clean.by_kind.get(kind, [])[:len(hard)]
        p, lo, hi, n = run.outcomes.accuracy(kind)
        out[kind] = {"n": n, "hard": round(p, 4), "hard_lo": round(lo, 4), "hard_hi": round(hi, 4),
                     "clean": round(sum(d.right for d in clean) / len(clean), 4) if clean else None,
                     "clean_n": len(clean)}
    return out


def hard_mistakes(run: CampaignRun) -> list[dict[str, Any]]:
    """Every hard render not decided right: kind, render, seed, expected, decided, and what the render changed."""
    if not run.outcomes.hard:
        return []
    layout, timeout = run.spec.slice_layout(), run.spec.get("nccl_timeout_s")
    classes = {k.rendered: k.fault_class for k in run.mix.values()}
    out = []
    for d in run.outcomes.mistakes():
        if d.kind not in HARD:
            continue
        _, noise = sample_noise(d.kind, d.bucket)
        out.append({"kind": d.kind, "render": d.bucket, "seed": d.seed, "expected": d.expected_action,
                    "decided": d.action, "outcome": classify(d, run.outcomes.late_after_s), "named": d.named,
                    "culprit_named": d.culprit_named, "healthy_named": d.extra_machines,
                    "hardening": describe(d.kind, layout, d.seed, fault_class=classes.get(d.kind, "fail_stop"),
                                          nccl_timeout_s=timeout, noise=noise)})
    return out


def summary(run: CampaignRun, sweep: list[tuple[float, float]] | None = None) -> dict[str, Any]:
    """The JSON line: ETTR per policy (mean over seeds), renders, per-kind accuracy, mistakes, crossover."""
    ettr = {p: round(run.ettr(p)[0], 5) for p in POLICIES}
    oracle = ettr["oracle"]
    failures = float(np.mean(run.failures_per_seed))
    fl = run.results["faultlens"]
    out: dict[str, Any] = {
        "bench": "ettr", "gpus": run.spec.gpus, "layout": run.spec.layout, "days": run.spec.days,
        "seeds": len(run.seeds), "failures": round(failures, 1),
        "renders": run.outcomes.renders, "renders_new": run.outcomes.rendered, "renders_cached": run.outcomes.cached,
        "failures_per_render": round(failures / max(1, run.outcomes.renders), 3),
        "ettr": ettr,
        "ettr_std": {p: round(run.ettr(p)[1], 5) for p in POLICIES},
        "gap_to_oracle": {p: round(oracle - ettr[p], 5) for p in POLICIES},
        "faultlens_gain_over": {p: round(ettr["faultlens"] - ettr[p], 5) for p in POLICIES if p != "faultlens"},
        "per_kind_accuracy": per_kind_accuracy(run),
        "faultlens_charged_outcomes": {o: round(float(np.mean([r.outcomes.get(o, 0) for r in fl])), 1)
                                       for o in (*OUTCOMES, "made_wrong")},
        "charged_mistakes": {p: {"unfixed_attempts": round(float(np.mean([r.wrong for r in run.results[p]])), 1),
                                 "healthy_machines_out": round(float(np.mean([r.healthy_out for r in run.results[p]])),
                                                               1)} for p in POLICIES},
        "lost_h": {p: {c: round(v / 3600, 2) for c, v in run.lost_mean(p).items()} for p in POLICIES},
        "rsc_analytic_ettr": round(run.analytic["rsc_ettr"], 5),
        "bus_checked": len(run.bus), "bus_agree": sum(b.action == o.action and b.named == o.named for b, o in run.bus),
        # per kind: the online path's delay beyond the batch decision (charged at least the floor)
        "online_extra_s": dict(sorted(run.online_extra_s.items())),
        "online_charged_s": {k: round(run.context().online_latency(k), 3) for k in sorted(run.outcomes.by_kind)},
    }
    out["hard"] = run.outcomes.hard
    if run.outcomes.hard:
        out["hard_vs_clean"] = hard_vs_clean(run)
        out["hard_mistakes"] = hard_mistakes(run)
    if sweep:
        out["sweep"] = [[r, round(e, 5)] for r, e in sweep]
        by = {p: crossover(sweep, ettr[p]) for p in ("group_evict", "none", "restart")}
        out["crossover_by_baseline"] = {p: None if v is None else round(v, 4) for p, v in by.items()}
        out["crossover"] = out["crossover_by_baseline"]["group_evict"]
    return out


def text_tables(run: CampaignRun, costs: dict[str, dict[str, Cost]] | None = None,
                sweep: list[tuple[float, float]] | None = None) -> str:
    """The printed report: ETTR per policy, hours lost by cause, faultlens's measured decisions, the sweep."""
    s = run.spec
    lines = [f"campaign: {s.gpus:,} GPUs ({s.nodes:,} machines x {s.gpus_per_node}), {s.layout}, {s.days:g} days, "
             f"checkpoint every {s.get('checkpoint_interval_s'):.0f} s, {s.get('warm_standbys'):.0f} warm standbys; "
             f"seeds {run.seeds}; failures per seed {run.failures_per_seed}", ""]
    head = f"{'policy':<12} {'ETTR mean':>9} {'std':>7} {'min':>7} {'max':>7} " + " ".join(
        f"{c[:11]:>11}" for c in CAUSES) + f" {'unfixed':>7} {'out':>5} {'healthy':>7} {'waits':>5}"
    lines += ["ETTR and unproductive hours by cause (mean over seeds)", head, "-" * len(head)]
    for p in POLICIES:
        mean, std, lo, hi = run.ettr(p)
        lost = run.lost_mean(p)
        rs = run.results[p]
        lines.append(f"{p:<12} {mean:>9.4f} {std:>7.4f} {lo:>7.4f} {hi:>7.4f} " + " ".join(
            f"{_h(lost[c]):>11}" for c in CAUSES) + f" {np.mean([r.wrong for r in rs]):>7.1f} "
            f"{np.mean([r.machines_out for r in rs]):>5.0f} {np.mean([r.healthy_out for r in rs]):>7.1f} "
            f"{np.mean([r.standby_waits for r in rs]):>5.1f}")
    a = run.analytic
    o = run.outcomes
    lines += ["", f"Meta RSC analytic estimate, same job (1 - (u0 + ckpt/2)/MTTF - w/ckpt, u0 = "
              f"{a['restart_overhead_s']:.0f} s): {a['rsc_ettr']:.4f}; simulated oracle {run.ettr('oracle')[0]:.4f}", "",
              f"faultlens's measured decisions: {o.renders} renders ({o.rendered} new, {o.cached} from the cache "
              f"{o.digest}), each with its own seed, onset, severity, machine and noise, decided by diagnose_records",
              f"{'rendered kind':<20} {'n':>4} {'right':>6} {'95% interval':>15} " +
              " ".join(f"{c:>13}" for c in OUTCOMES)]
    for kind, row in per_kind_accuracy(run).items():
        interval = f"[{row['lo']:.3f}, {row['hi']:.3f}]"
        lines.append(f"{kind:<20} {row['n']:>4} {row['right']:>6.3f} {interval:>15} "
                     + " ".join(f"{row['outcomes'][c]:>13}" for c in OUTCOMES))
    wrong = o.mistakes()
    if wrong:
        lines += ["", "measured mistakes (charged whenever a failure draws them)"]
        for d in wrong[:20]:
            lines.append(f"  {d.kind:<20} render {d.bucket:>3} seed {d.seed:>10}: expected {d.expected_action}, decided "
                         f"{d.action}, named {d.named} (culprit {'in' if d.culprit_named else 'NOT in'}, "
                         f"{d.extra_machines} healthy)")
        if len(wrong) > 20:
            lines.append(f"  ... and {len(wrong) - 20} more")
    if o.hard:
        lines += ["", "hard renders (campaign_hard: hangs with partial evidence, cascades) against the clean renders "
                  "of the same (kind, i); other kinds: their clean or compound render",
                  f"{'hard kind':<20} {'n':>4} {'clean':>6} {'hard':>6} {'hard 95% interval':>18}"]
        for kind, row in hard_vs_clean(run).items():
            clean = "-" if row["clean"] is None else f"{row['clean']:.3f}"
            lines.append(f"{kind:<20} {row['n']:>4} {clean:>6} {row['hard']:>6.3f} "
                         f"{'[' + format(row['hard_lo'], '.3f') + ', ' + format(row['hard_hi'], '.3f') + ']':>18}")
        for m in hard_mistakes(run):
            lines.append(f"  wrong: {m['kind']} render {m['render']} seed {m['seed']}: expected {m['expected']}, decided "
                         f"{m['decided']} ({m['outcome']}, named {m['named']}, culprit "
                         f"{'in' if m['culprit_named'] else 'NOT in'}, {m['healthy_named']} healthy); {m['hardening']}")
    if sweep:
        lines += ["", "error-rate sweep: faultlens's ETTR with this share of its decisions made wrong on top of "
                  "its measured mistakes"]
        lines += [f"  {r:>5.0%}  {e:.4f}" for r, e in sweep]
        for p in ("group_evict", "none", "restart"):
            x = crossover(sweep, run.ettr(p)[0])
            lines.append(f"  meets {p} ({run.ettr(p)[0]:.4f}) at "
                         f"{'beyond the sweep' if x is None else f'{x:.1%}'}")
    if run.bus:
        lines += ["", "bus check: the same records through the embedded broker to the online DiagnosisService "
                  "(detect+decide from the onset, batch/bus; what faultlens is charged for the online path)"]
        ctx = run.context()
        for b, on in run.bus:
            same = b.action == on.action and b.named == on.named
            lines.append(f"  {b.kind:<20} batch {b.action:<18} bus {on.action:<18} named {b.named}/{on.named} "
                         f"{_delay(b)}/{_delay(on)} s  charged +{ctx.online_latency(b.kind):.1f} s  "
                         f"{'agree' if same else 'DIFFER'}")
    return "\n".join(lines)


def _delay(d: Decision) -> str:
    return "-" if d.detect_s is None else f"{d.detect_s + d.decide_s:.0f}"


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
