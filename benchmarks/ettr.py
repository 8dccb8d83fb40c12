"""The headline: the training time faultlens gives back (ETTR), against what teams do today (issue 25).

One long job meets failures drawn from datasets/failure_mix.toml; the same draw is
handled by five policies (none, restart, group_evict, faultlens, oracle) with the
costs of datasets/campaign_costs.toml. faultlens's decisions come from rendering
each failure's signals on a slice of the job and diagnosing them with the real
engine (one sample per kind and seed bucket, cached); in the full run a sample
also goes through the embedded broker to the online service.

    python benchmarks/ettr.py            # 9,600 GPUs, 70B dense, 90 days, 5 seeds, 3 buckets, bus check
    python benchmarks/ettr.py --quick    # same job, 3 seeds, 1 bucket, no bus check (< 2 min)
    python benchmarks/ettr.py --smoke    # 1,024 GPUs, 8B, 14 days, 4 kinds (seconds)

Prints the cost table, the ETTR table (mean, spread, hours lost by cause), the
decisions, Meta RSC's analytic estimate, then one JSON line (``ettr`` per policy,
``gap_to_oracle``). ``--out DIR`` writes ettr.png and ettr.html there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from faultlens.datasets.campaign import CampaignSpec, load_costs, load_mix, run_campaign
from faultlens.datasets.campaign_report import (
    cost_table_text,
    summary,
    text_tables,
    write_html,
    write_png,
)

SMOKE_KINDS = ("gpu_lost", "thermal_throttle", "user_exception", "ib_flap_transient")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--gpus", type=int, default=None)
    ap.add_argument("--layout", default=None)
    ap.add_argument("--days", type=float, default=None)
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--buckets", type=int, default=None)
    ap.add_argument("--bus", type=int, default=None, help="rendered failures to send through the bus")
    ap.add_argument("--out", default=None, help="write ettr.png and ettr.html here")
    args = ap.parse_args()
    if args.smoke:
        spec = CampaignSpec(gpus=args.gpus or 1024, layout=args.layout or "8b-dense", days=args.days or 14.0)
        seeds, buckets, bus, kinds = args.seeds or 2, args.buckets or 1, args.bus or 0, SMOKE_KINDS
    else:
        spec = CampaignSpec(gpus=args.gpus or 9600, layout=args.layout or "70b-dense", days=args.days or 90.0)
        seeds = args.seeds or (3 if args.quick else 5)
        buckets = args.buckets or (1 if args.quick else 3)
        bus = args.bus if args.bus is not None else (0 if args.quick else 4)
        kinds = None
    costs = load_costs()
    mix = load_mix(kinds=kinds)
    print(cost_table_text(costs), "\n")
    t0 = time.perf_counter()
    run = run_campaign(spec, seeds=list(range(seeds)), buckets=buckets, mix=mix, costs=costs, bus_samples=bus,
                       progress=lambda m: print(f"  {m}", file=sys.stderr, flush=True))
    elapsed = time.perf_counter() - t0
    print(text_tables(run, costs))
    if args.out:
        png = write_png(run, f"{args.out}/ettr.png")
        page = write_html(run, f"{args.out}/ettr.html", costs)
        print(f"\nwrote {png or '(no PNG: Pillow not installed)'} and {page}")
    out = summary(run)
    out.update({"quick": args.quick, "smoke": args.smoke, "seconds": round(elapsed, 1)})
    print(f"\n{elapsed:.1f} s")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
