"""``faultlens simulate``: write simulated training runs with injected faults and ground truth.

Subcommands: ``scenario`` (one batch directory with truth.json), ``suite``
(many scenarios plus index.json), ``campaign`` (a long job's ETTR under five
failure-handling policies, faultlens's decisions from the real engine:
``faultlens.datasets.campaign``) and ``live`` (stream into Kafka in accelerated
time through the real agent code, one agent per virtual node:
``faultlens.datasets.live.LiveCluster``).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from faultlens.argtypes import non_negative_float, positive_float, positive_int
from faultlens.datasets.campaign import CampaignSpec, load_costs, load_mix
from faultlens.datasets.campaign_report import (
    cost_table_text,
    summary,
    text_tables,
    write_html,
    write_png,
)
from faultlens.datasets.campaign_run import error_sweep, run_campaign
from faultlens.datasets.cluster import ClusterSpec
from faultlens.datasets.faults import SCENARIO_KINDS
from faultlens.datasets.live import DEMO_FAULTS, LiveCluster, demo_fleet, demo_segments
from faultlens.datasets.scenario import DEFAULT_START_TS, FaultSpec, Scenario, ScenarioSpec
from faultlens.datasets.scenario_files import write_batch_dir
from faultlens.datasets.suite import long_run_spec, write_suite
from faultlens.errors import ConfigError
from faultlens.stream.bus import ensure_topics

HELP = "simulated training cluster with fault injection and ground truth (batch directories, suites)"
EXAMPLE = ("faultlens simulate scenario --fault gpu_lost --nodes 4 --duration 600 --seed 1 --out runs/gpu_lost\n"
           "  faultlens simulate suite --n 200 --seed 7 --out runs/suite\n"
           "  faultlens simulate campaign --gpus 9600 --layout 70b-dense --days 90 --out runs/campaign\n"
           "  faultlens simulate live --nodes 16 --speed 20 --workdir demo-run/sim")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="sim_command", metavar="SUBCOMMAND")

    sc = sub.add_parser("scenario", help="one scenario -> batch directory + truth.json",
                        description="Write one simulated run as a batch directory (docs/design.md, Batch directory) with truth.json.",
                        epilog="example:\n  faultlens simulate scenario --fault thermal_throttle --nodes 8 --out runs/t1",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    sc.add_argument("--fault", default="healthy", choices=SCENARIO_KINDS, help="fault kind to inject")
    sc.add_argument("--nodes", type=positive_int, default=4)
    sc.add_argument("--gpus-per-node", type=positive_int, default=8)
    sc.add_argument("--tp", type=positive_int, default=None, help="tensor-parallel size (default: GPUs per node)")
    sc.add_argument("--pp", type=positive_int, default=None, help="pipeline-parallel size (default: 4, 2 or 1)")
    sc.add_argument("--cp", type=positive_int, default=1)
    sc.add_argument("--order", default="tp-cp-dp-pp")
    sc.add_argument("--microbatches", type=positive_int, default=8, help="micro-batches per replica and iteration")
    sc.add_argument("--duration", type=positive_float, default=600.0, help="simulated seconds")
    sc.add_argument("--start-ts", type=float, default=None, help="epoch seconds of the start")
    sc.add_argument("--seed", type=int, default=0)
    sc.add_argument("--onset", type=non_negative_float, default=None, help="fault onset, seconds after the start")
    sc.add_argument("--node", default=None, help="culprit node (default: drawn from the seed)")
    sc.add_argument("--gpu", type=int, default=None, help="culprit GPU index")
    sc.add_argument("--watchdog-timeout", type=positive_float, default=None, help="ProcessGroupNCCL timeout in seconds")
    sc.add_argument("--kernel-format", choices=["dmesg", "iso", "syslog"], default=None)
    sc.add_argument("--long-run", action="store_true", help="faults as Poisson arrivals at the papers' rates")
    sc.add_argument("--acceleration", type=positive_float, default=1.0, help="multiply long-run fault rates")
    sc.add_argument("--out", required=True, help="output directory")

    su = sub.add_parser("suite", help="many scenarios with varied clusters -> one directory each + index.json",
                        description="Write a seeded suite of scenarios (every kind, 2-32 nodes) with index.json.",
                        epilog="example:\n  faultlens simulate suite --n 200 --seed 7 --out runs/suite",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    su.add_argument("--n", type=positive_int, default=200)
    su.add_argument("--seed", type=int, default=0)
    su.add_argument("--min-nodes", type=positive_int, default=2)
    su.add_argument("--max-nodes", type=positive_int, default=32)
    su.add_argument("--out", required=True)

    ca = sub.add_parser("campaign", help="a long job's ETTR under five failure-handling policies (issues 25, 35)",
                        description="One long training job meets failures from datasets/failure_mix.toml; the same "
                                    "draw is handled by none / restart / group_evict / faultlens / oracle with the "
                                    "costs of datasets/campaign_costs.toml. faultlens is charged per failure by a "
                                    "draw from its kind's measured decisions: renders on a slice of the job, each "
                                    "with its own seed, onset, severity, machine and noise, decided by the real "
                                    "engine until each kind's accuracy is known within +/- 5 points (95%); the "
                                    "measured decisions are cached on disk, keyed by a digest of the code.",
                        epilog="example:\n  faultlens simulate campaign --gpus 9600 --layout 70b-dense --days 90 "
                               "--seeds 3 --out runs/campaign\n"
                               "  faultlens simulate campaign --costs        # print every cost and its source",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ca.add_argument("--gpus", type=int, default=9600)
    ca.add_argument("--gpus-per-node", type=int, default=8)
    ca.add_argument("--layout", default="70b-dense", help="70b-dense (TP8 PP8) | 405b-dense (TP8 PP16) | 8b-dense")
    ca.add_argument("--days", type=float, default=90.0)
    ca.add_argument("--checkpoint-interval", type=float, default=None, help="seconds (default: costs table)")
    ca.add_argument("--warm-standbys", type=int, default=None)
    ca.add_argument("--restart", type=float, default=None, help="in-place restart + checkpoint reload, seconds")
    ca.add_argument("--reschedule", type=float, default=None, help="extra seconds when machines are swapped")
    ca.add_argument("--nccl-timeout", type=float, default=None, help="seconds")
    ca.add_argument("--kinds", default=None, help="comma-separated failure kinds to keep from the mix")
    ca.add_argument("--seeds", type=int, default=3)
    ca.add_argument("--samples", type=int, default=40, help="renders per kind to start from")
    ca.add_argument("--max-samples", type=int, default=200, help="renders per kind at most")
    ca.add_argument("--workers", type=int, default=1, help="processes rendering in parallel")
    ca.add_argument("--no-cache", action="store_true", help="measure every render afresh")
    ca.add_argument("--bus", type=int, default=0,
                    help="kinds to send through the bus too (-1: every single-fault kind; 0: what the bus cache holds)")
    ca.add_argument("--costs", action="store_true", help="print the cost table and exit")
    ca.add_argument("--out", default=None, help="write ettr.png, ettr.html and summary.json here")

    lv = sub.add_parser("live", help="stream scenarios into Kafka in accelerated time through the real agent",
                        description="Play the demo's fault sequence (or one fault) on a virtual cluster: one real "
                                    "agent per node follows the simulated logs and NVML, producing to Kafka.",
                        epilog="example:\n  faultlens simulate live --nodes 16 --speed 20 --workdir demo-run/sim",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    lv.add_argument("--nodes", type=positive_int, default=16)
    lv.add_argument("--speed", type=positive_float, default=20.0, help="simulated seconds per real second")
    lv.add_argument("--segment", type=positive_float, default=300.0, help="simulated seconds per fault segment")
    lv.add_argument("--onset", type=non_negative_float, default=90.0, help="fault onset, seconds into each segment")
    lv.add_argument("--fault", action="append", default=[], choices=SCENARIO_KINDS,
                    help="fault kinds to play in order (repeatable; default: the demo sequence)")
    lv.add_argument("--seed", type=int, default=7)
    lv.add_argument("--workdir", required=True, help="where the virtual nodes' log files and spools go")


def _scenario(args: argparse.Namespace) -> int:

    try:
        cluster = ClusterSpec.for_nodes(args.nodes, args.gpus_per_node, tp=args.tp, pp=args.pp, cp=args.cp,
                                        order=args.order, microbatches=args.microbatches)
    except (ValueError, StopIteration) as exc:
        raise ConfigError(f"bad cluster layout: {exc}", key="--nodes/--tp/--pp/--cp") from None
    start = DEFAULT_START_TS if args.start_ts is None else args.start_ts
    if args.long_run:
        spec = long_run_spec(args.seed, cluster, args.duration, acceleration=args.acceleration)
        spec = ScenarioSpec(**{**spec.__dict__, "start_ts": start})
    else:
        faults = () if args.fault == "healthy" else (
            FaultSpec(kind=args.fault, id="f1", onset_s=args.onset, node=args.node, gpu=args.gpu),)
        spec = ScenarioSpec(name=f"{args.fault}-s{args.seed}", seed=args.seed, cluster=cluster,
                            duration_s=args.duration, start_ts=start, faults=faults)
    spec = ScenarioSpec(**{**spec.__dict__, "watchdog_timeout_s": args.watchdog_timeout,
                           "kernel_format": args.kernel_format})
    t0 = time.perf_counter()
    sc = Scenario(spec)
    out = write_batch_dir(sc, args.out)
    truth = sc.truth()
    print(f"wrote {out} in {time.perf_counter() - t0:.1f}s: {cluster.nodes} nodes x {cluster.gpus_per_node} GPUs "
          f"(tp={cluster.tp} pp={cluster.pp} dp={cluster.dp} cp={cluster.cp}), {len(sc.steps.end)} steps")
    for f in truth["faults"]:
        print(f"  {f['id']} {f['kind']} at +{f['onset_ts'] - truth['start_ts']:.0f}s nodes={f['nodes']} "
              f"ranks={f['ranks']} -> {f['expected_action']}")
    return 0


def _suite(args: argparse.Namespace) -> int:
    from rich.progress import Progress


    with Progress() as progress:
        task = progress.add_task("scenarios", total=args.n)

        def tick(i: int, name: str) -> None:
            progress.update(task, advance=1, description=name)

        out = write_suite(args.out, args.n, args.seed, progress=tick, min_nodes=args.min_nodes,
                          max_nodes=args.max_nodes)
    print(f"wrote {args.n} scenarios and {out / 'index.json'}")
    return 0


def _live(args: argparse.Namespace, config: Any) -> int:
    import signal
    import threading

    faults = DEMO_FAULTS if not args.fault else tuple((k, i * 5 + 3, None) for i, k in enumerate(args.fault))
    demo_fleet(args.nodes, len(faults))  # a fleet too small fails before anything starts
    bootstrap = config.bus.bootstrap_servers or None
    if not bootstrap:
        print("faultlens simulate live: no Kafka configured (--bootstrap-servers or FAULTLENS_BOOTSTRAP)")
        return 2
    ensure_topics(config.bus)
    segments = demo_segments(args.nodes, segment_s=args.segment, onset_s=args.onset, seed=args.seed, faults=faults)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def announce(scenario: Any) -> None:
        f = scenario.spec.faults[0]
        print(f"segment {scenario.spec.name}: job {scenario.cluster.job}, {f.kind} on {f.node} "
              f"at +{f.onset_s:.0f}s (simulated)", flush=True)

    LiveCluster(config, bootstrap=bootstrap, workdir=args.workdir, speed=args.speed, on_segment=announce).run(
        segments, stop)
    return 0


def _campaign(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path


    costs = load_costs()
    if args.costs:
        print(cost_table_text(costs))
        return 0
    try:
        mix = load_mix(kinds=args.kinds.split(",") if args.kinds else None)
        spec = CampaignSpec(gpus=args.gpus, gpus_per_node=args.gpus_per_node, layout=args.layout, days=args.days,
                            checkpoint_interval_s=args.checkpoint_interval, warm_standbys=args.warm_standbys,
                            restart_s=args.restart, reschedule_s=args.reschedule, nccl_timeout_s=args.nccl_timeout)
        spec.slice_layout()
    except ValueError as exc:
        raise ConfigError(str(exc), key="--gpus/--layout/--kinds") from None
    run = run_campaign(spec, seeds=list(range(args.seeds)), mix=mix, costs=costs, bus_samples=args.bus,
                       progress=lambda m: print(f"  {m}", flush=True), n_min=args.samples,
                       n_max=max(args.samples, args.max_samples), workers=args.workers, use_cache=not args.no_cache)
    sweep = error_sweep(run)
    print(text_tables(run, costs, sweep))
    out = summary(run, sweep)
    if args.out:
        d = Path(args.out)
        png = write_png(run, d / "ettr.png")
        page = write_html(run, d / "ettr.html", costs)
        (d / "summary.json").write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {png or '(no PNG: Pillow not installed)'}, {page}, {d / 'summary.json'}")
    print(json.dumps(out))
    return 0


def run(args: argparse.Namespace, config: Any) -> int:
    if args.sim_command == "live":
        return _live(args, config)
    if args.sim_command == "scenario":
        return _scenario(args)
    if args.sim_command == "suite":
        return _suite(args)
    if args.sim_command == "campaign":
        return _campaign(args)
    print("faultlens simulate: choose a subcommand: scenario | suite | campaign | live (see --help)")
    return 2
