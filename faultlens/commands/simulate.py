"""``faultlens simulate``: write simulated training runs with injected faults and ground truth.

Subcommands: ``scenario`` (one batch directory with truth.json) and ``suite``
(many scenarios plus index.json). Live streaming into Kafka is driven by the
lead's code on top of ``faultlens.datasets.scenario.LiveWriter`` /
``Scenario.events`` and ``datasets.nvml_sim.SimulatedNvml`` (hook:
``LIVE_HOOK`` below names the entry point a ``live`` subcommand will call).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

HELP = "simulated training cluster with fault injection and ground truth (batch directories, suites)"
EXAMPLE = ("faultlens simulate scenario --fault gpu_lost --nodes 4 --duration 600 --seed 1 --out runs/gpu_lost\n"
           "  faultlens simulate suite --n 200 --seed 7 --out runs/suite")
LIVE_HOOK = "faultlens.datasets.scenario:LiveWriter"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="sim_command", metavar="SUBCOMMAND")
    from faultlens.datasets.faults import SCENARIO_KINDS

    sc = sub.add_parser("scenario", help="one scenario -> batch directory + truth.json",
                        description="Write one simulated run as DESIGN.md's batch directory with truth.json.",
                        epilog="example:\n  faultlens simulate scenario --fault thermal_throttle --nodes 8 --out runs/t1",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    sc.add_argument("--fault", default="healthy", choices=SCENARIO_KINDS, help="fault kind to inject")
    sc.add_argument("--nodes", type=int, default=4)
    sc.add_argument("--gpus-per-node", type=int, default=8)
    sc.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: GPUs per node)")
    sc.add_argument("--pp", type=int, default=None, help="pipeline-parallel size (default: 4, 2 or 1)")
    sc.add_argument("--cp", type=int, default=1)
    sc.add_argument("--order", default="tp-cp-dp-pp")
    sc.add_argument("--microbatches", type=int, default=8, help="micro-batches per replica and iteration")
    sc.add_argument("--duration", type=float, default=600.0, help="simulated seconds")
    sc.add_argument("--start-ts", type=float, default=None, help="epoch seconds of the start")
    sc.add_argument("--seed", type=int, default=0)
    sc.add_argument("--onset", type=float, default=None, help="fault onset, seconds after the start")
    sc.add_argument("--node", default=None, help="culprit node (default: drawn from the seed)")
    sc.add_argument("--gpu", type=int, default=None, help="culprit GPU index")
    sc.add_argument("--watchdog-timeout", type=float, default=None, help="ProcessGroupNCCL timeout in seconds")
    sc.add_argument("--kernel-format", choices=["dmesg", "iso", "syslog"], default=None)
    sc.add_argument("--long-run", action="store_true", help="faults as Poisson arrivals at the papers' rates")
    sc.add_argument("--acceleration", type=float, default=1.0, help="multiply long-run fault rates")
    sc.add_argument("--out", required=True, help="output directory")

    su = sub.add_parser("suite", help="many scenarios with varied clusters -> one directory each + index.json",
                        description="Write a seeded suite of scenarios (every kind, 2-32 nodes) with index.json.",
                        epilog="example:\n  faultlens simulate suite --n 200 --seed 7 --out runs/suite",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    su.add_argument("--n", type=int, default=200)
    su.add_argument("--seed", type=int, default=0)
    su.add_argument("--min-nodes", type=int, default=2)
    su.add_argument("--max-nodes", type=int, default=32)
    su.add_argument("--out", required=True)


def _scenario(args: argparse.Namespace) -> int:
    from faultlens.datasets.cluster import ClusterSpec
    from faultlens.datasets.scenario import (
        DEFAULT_START_TS,
        FaultSpec,
        Scenario,
        ScenarioSpec,
        write_batch_dir,
    )
    from faultlens.datasets.suite import long_run_spec

    try:
        cluster = ClusterSpec.for_nodes(args.nodes, args.gpus_per_node, tp=args.tp, pp=args.pp, cp=args.cp,
                                        order=args.order, microbatches=args.microbatches)
    except (ValueError, StopIteration) as exc:
        from faultlens.errors import ConfigError

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

    from faultlens.datasets.suite import write_suite

    with Progress() as progress:
        task = progress.add_task("scenarios", total=args.n)

        def tick(i: int, name: str) -> None:
            progress.update(task, advance=1, description=name)

        out = write_suite(args.out, args.n, args.seed, progress=tick, min_nodes=args.min_nodes,
                          max_nodes=args.max_nodes)
    print(f"wrote {args.n} scenarios and {out / 'index.json'}")
    return 0


def run(args: argparse.Namespace, config: Any) -> int:
    if args.sim_command == "scenario":
        return _scenario(args)
    if args.sim_command == "suite":
        return _suite(args)
    print("faultlens simulate: choose a subcommand: scenario | suite (see --help)")
    return 2
