"""``faultlens agent``: the node agent (NVML, kernel log, NCCL logs, step timings, stack dumps -> Kafka)."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import threading
from typing import Any

from faultlens.argtypes import positive_float
from faultlens.collectors.agent import Agent
from faultlens.collectors.check import check_node, render
from faultlens.stream.bus.embedded_broker import EmbeddedBroker

HELP = ("Run the node agent: sample NVML, follow the kernel log (/dev/kmsg, journalctl or a file), NCCL and "
        "step logs, answer dump_stacks commands with py-spy, and produce everything to Kafka through a bounded "
        "on-disk spool that survives broker outages. Health per source goes to the log and to /metrics.")
EXAMPLE = ("faultlens agent --bootstrap-servers kafka:9092 --kernel-log kmsg "
           "--nccl-glob '/var/log/train/*/nccl*.log' --steps-glob '/var/log/train/*/steps*.jsonl' "
           "--spool-dir /var/lib/faultlens/spool\n  faultlens agent --check      # what this node's agent would see, then exit")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node", help="this node's name (default: [agent] node, else the host name)")
    parser.add_argument("--job", help="job id stamped on GPU samples and framework step lines")
    parser.add_argument("--kernel-log", metavar="PATH|kmsg|journal|auto",
                        help="kernel log to follow (default: [agent] kernel_follow)")
    parser.add_argument("--nccl-glob", metavar="GLOB", help="NCCL / torch.distributed log files to follow")
    parser.add_argument("--steps-glob", metavar="GLOB", help="StepReporter JSON lines or framework step logs to follow")
    parser.add_argument("--error-files-glob", metavar="GLOB",
                        help="torchrun error files (TORCHELASTIC_ERROR_FILE under its --log-dir, e.g. '/var/log/train/**/error.json')")
    parser.add_argument("--flight-recorder-glob", metavar="GLOB",
                        help="Flight Recorder dumps the ranks write themselves (e.g. '/tmp/nccl_trace_rank_*'), shipped as they appear")
    parser.add_argument("--job-file", metavar="PATH", help="the job's topology (job.json) to publish on the jobs topic")
    parser.add_argument("--no-nvml", action="store_true", help="do not run the NVML source")
    parser.add_argument("--spool-dir", metavar="DIR", help="on-disk spool for broker outages (default: [agent] spool_dir)")
    parser.add_argument("--metrics-port", type=int, help="serve /metrics on this port (0: off)")
    parser.add_argument("--duration-s", type=positive_float, default=None, help="stop after this many seconds (tests, benchmarks)")
    parser.add_argument("--check", action="store_true",
                        help="probe this node (NVML counters and events, kernel log, py-spy), print what the agent "
                             "would see and exit: 1 when a source is there but broken")


def run(args: argparse.Namespace, config: Any) -> int:
    import logging


    # kafka-python logs every failed reconnect; the agent reports the bus state itself (health, /metrics)
    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("kafka").setLevel(logging.CRITICAL)

    changes: dict[str, Any] = {}
    for arg, key in (("spool_dir", "spool_dir"), ("metrics_port", "metrics_port"), ("job", "job"), ("node", "node"),
                     ("job_file", "job_file"), ("error_files_glob", "error_files_glob"),
                     ("flight_recorder_glob", "flight_recorder_glob")):
        if getattr(args, arg, None) is not None:
            changes[key] = getattr(args, arg)
    sources = config.agent.sources
    if args.no_nvml:
        sources = tuple(s for s in sources if s != "nvml")
    changes["sources"] = sources
    config = dataclasses.replace(config, agent=dataclasses.replace(config.agent, **changes))
    if args.check:

        findings = check_node(args.kernel_log or config.agent.kernel_follow, nvml="nvml" in sources)
        print(render(findings))
        return 0 if all(f.ok for f in findings) else 1
    bootstrap = config.bus.bootstrap_servers or None
    broker = None
    if not bootstrap:

        broker = EmbeddedBroker().start()
        bootstrap = broker.bootstrap
        print(f"faultlens agent: no bootstrap servers configured; embedded broker at {bootstrap}")
    agent = Agent(config, bootstrap=bootstrap, kernel_source=args.kernel_log, nccl_glob=args.nccl_glob,
                  steps_glob=args.steps_glob)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.duration_s:
        timer = threading.Timer(args.duration_s, stop.set)
        timer.daemon = True
        timer.start()
    try:
        agent.run(stop)
    finally:
        if broker is not None:
            broker.stop()
    return 0
