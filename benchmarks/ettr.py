"""The headline: the training time faultlens gives back (ETTR), against what teams do today (issues 25, 35).

One long job meets failures drawn from datasets/failure_mix.toml (Llama 3's
interruptions per kind); the same draw is handled by five policies (none = an
on-call human, restart with node health checks, ByteRobust-style group eviction,
faultlens, oracle) with the costs of datasets/campaign_costs.toml. faultlens is
charged per failure by a draw from its kind's measured decisions: per rendered
kind, renders each with its own seed, onset, severity, machine and noise, decided
by diagnose_records, until the kind's accuracy has a 95% interval within +/- 5
points. The measured decisions are cached on disk, keyed by a digest of the code
that renders and decides (``--no-cache`` measures afresh: ~30-60 min on 2 cores).

    python benchmarks/ettr.py            # 9,600 GPUs, 70B dense, 90 days, 5 seeds, every kind to +/- 5, every kind on the bus
    python benchmarks/ettr.py --quick    # same job, 3 seeds, the cache as it is (4 renders of an uncached kind)
    python benchmarks/ettr.py --smoke    # 1,024 GPUs, 8B, 14 days, 4 kinds, 6 renders each (no cache)
    python benchmarks/ettr.py --quick --sensitivity   # also move every assumed figure over its range
    python benchmarks/ettr.py --quick --cached-only   # what the cache holds, however few renders
    python benchmarks/ettr.py --quick --hard   # hangs and cascades decided from hard renders (6 each)

Prints the cost table, the ETTR table (mean, spread, hours lost by cause), the
per-kind accuracy with its interval, the measured mistakes, the error-rate
sweep and where faultlens meets each baseline, then one JSON line (``ettr`` per
policy, ``renders``, ``failures``, ``per_kind_accuracy``, ``crossover``,
``gap_to_oracle``). ``--hard``: the hang and machine-fault kinds are decided
from their hard renders (datasets/campaign_hard.py: hangs with partial
evidence, cascades; compound faults as always), with the clean decisions of
the same renders beside them and every wrong hard decision listed; the JSON
then has ``"hard": true``, ``hard_vs_clean`` and ``hard_mistakes``. ``--out DIR`` writes ettr.png and ettr.html there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from faultlens.datasets.campaign import CampaignSpec, load_costs, load_mix
from faultlens.datasets.campaign_report import (
    cost_table_text,
    summary,
    text_tables,
    write_html,
    write_png,
)
from faultlens.datasets.campaign_run import error_sweep, run_campaign, sensitivity

SMOKE_KINDS = ("gpu_lost", "thermal_throttle", "user_exception", "ib_flap_transient")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--gpus", type=int, default=None)
    ap.add_argument("--layout", default=None)
    ap.add_argument("--days", type=float, default=None)
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--samples", type=int, default=None, help="renders per kind to start from (default 40)")
    ap.add_argument("--max-samples", type=int, default=None, help="renders per kind at most (default 200)")
    ap.add_argument("--half-width", type=float, default=0.05, help="target 95%% interval half-width per kind")
    ap.add_argument("--workers", type=int, default=1, help="processes rendering in parallel")
    ap.add_argument("--no-cache", action="store_true", help="measure every render afresh")
    ap.add_argument("--cached-only", action="store_true",
                    help="take what the cache holds per kind as it is (intervals as wide as that makes them)")
    ap.add_argument("--sensitivity", action="store_true", help="move every assumed figure over its range")
    ap.add_argument("--bus", type=int, default=None,
                    help="kinds to send through the bus (default: every single-fault kind; --quick: what the cache holds)")
    ap.add_argument("--hard", action="store_true",
                    help="decide hangs and machine faults from their hard renders (partial evidence, cascades)")
    ap.add_argument("--out", default=None, help="write ettr.png and ettr.html here")
    args = ap.parse_args()
    if args.smoke:
        spec = CampaignSpec(gpus=args.gpus or 1024, layout=args.layout or "8b-dense", days=args.days or 14.0)
        seeds, bus, kinds = args.seeds or 2, args.bus or 0, SMOKE_KINDS
        n_min, n_max, half, use_cache = args.samples or 6, args.max_samples or args.samples or 6, 1.0, False
    else:
        spec = CampaignSpec(gpus=args.gpus or 9600, layout=args.layout or "70b-dense", days=args.days or 90.0)
        seeds = args.seeds or (3 if args.quick else 5)
        bus = args.bus if args.bus is not None else (0 if args.quick else -1)
        kinds = None
        n_min, n_max, half, use_cache = args.samples or 40, args.max_samples or 200, args.half_width, not args.no_cache
        if args.quick and not args.samples:  # what the cache holds; 4 renders of a kind it has none of
            args.cached_only, n_min = True, 4
        if args.quick and args.hard and not args.samples:  # a few hard renders per hard kind
            n_min = 6
    costs = load_costs()
    mix = load_mix(kinds=kinds)
    print(cost_table_text(costs), "\n")
    t0 = time.perf_counter()
    log = lambda m: print(f"  {m}", file=sys.stderr, flush=True)  # noqa: E731
    run = run_campaign(spec, seeds=list(range(seeds)), mix=mix, costs=costs, bus_samples=bus, progress=log,
                       n_min=n_min, n_max=n_max, half_width=half, workers=args.workers, use_cache=use_cache,
                       cached_only=args.cached_only, overlap=not args.smoke, hard=args.hard)
    sweep = error_sweep(run)
    print(text_tables(run, costs, sweep))
    out = summary(run, sweep)
    if args.sensitivity:
        rows = sensitivity(run, progress=log)
        print("\nsensitivity: each assumed figure at the ends of its range (ETTR faultlens / group_evict)")
        for r in rows:
            lo, hi = r["low"], r["high"]
            print(f"  {r['figure']:<44} {r['value']:>9g} [{r['range'][0]:g}, {r['range'][1]:g}]  "
                  f"low {lo['faultlens']:.4f} / {lo['group_evict']:.4f}   high {hi['faultlens']:.4f} / "
                  f"{hi['group_evict']:.4f}")
        out["sensitivity"] = {r["figure"]: {"low": r["low"], "high": r["high"]} for r in rows}
        out["faultlens_ahead_everywhere"] = all(
            row[end]["faultlens"] > max(v for p, v in row[end].items() if p != "faultlens")
            for row in rows for end in ("low", "high"))
    elapsed = time.perf_counter() - t0
    if args.out:
        png = write_png(run, f"{args.out}/ettr.png")
        page = write_html(run, f"{args.out}/ettr.html", costs)
        print(f"\nwrote {png or '(no PNG: Pillow not installed)'} and {page}")
    out.update({"quick": args.quick, "smoke": args.smoke, "seconds": round(elapsed, 1)})
    print(f"\n{elapsed:.1f} s")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
