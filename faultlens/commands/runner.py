"""``faultlens runner``: execute actions from the actions topic through an adapter."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import threading

from faultlens.argtypes import positive_float
from faultlens.config import Config
from faultlens.diagnosis.runner.adapters import ADAPTERS
from faultlens.diagnosis.runner.runner import ActionRunner
from faultlens.metrics import MetricsServer, ServiceMetrics

HELP = (
    "Consume remediation actions and execute them through an adapter: dry-run (default, logs only), "
    "slurm (scontrol drain + requeue), kubernetes (kubectl cordon + taint) or command (a hook program "
    "receiving the action JSON on stdin). Nothing is executed without --execute, and actions marked "
    "dry_run are never executed. Results go to the action-status topic."
)
EXAMPLE = "faultlens runner --adapter slurm --bootstrap-servers kafka1:9092   # add --execute to really drain"

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:

    keep = argparse.SUPPRESS  # not given: the configuration decides
    p.add_argument("--adapter", choices=sorted(ADAPTERS), default=keep,
                   help="adapter (when not given: runner.adapter, 'dry-run' by default)")
    p.add_argument("--execute", action="store_true", default=keep,
                   help="execute actions whose dry_run is false (when not given: runner.execute, off: log only)")
    p.add_argument("--state-path", default=keep, help="ledger of handled action ids (when not given: runner.state_path)")
    p.add_argument("--metrics-port", type=int, default=keep, help="serve /metrics on 127.0.0.1:PORT (0: off)")
    p.add_argument("--duration-s", type=positive_float, default=None, help="stop after this many seconds (none: until stopped)")

def run(args: argparse.Namespace, config: Config) -> int:

    changes = {k: getattr(args, k) for k in ("adapter", "execute", "state_path", "metrics_port") if hasattr(args, k)}
    config = dataclasses.replace(config, runner=dataclasses.replace(config.runner, **changes))
    metrics = ServiceMetrics("runner")
    runner = ActionRunner(config, metrics=metrics)  # a bad adapter setting fails here, before consuming
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
    server = MetricsServer(metrics.registry, config.runner.metrics_port) if config.runner.metrics_port else None
    if server is not None:
        server.start()
    try:
        handled = runner.run(stop, max_seconds=args.duration_s)
    finally:
        if server is not None:
            server.stop()
    log.info("runner stopped after %d message(s)", handled)
    return 0
