"""``faultlens diagnose``: batch (a directory) or online (the bus), through the same engine."""

from __future__ import annotations

import argparse
import gc
import signal
import time
from pathlib import Path
from typing import Any

import orjson

from faultlens.argtypes import positive_float
from faultlens.collectors.batch import read_batch_dir
from faultlens.config import Config
from faultlens.diagnosis.batch import diagnose_records
from faultlens.diagnosis.engine import default_detectors
from faultlens.diagnosis.nodehealth import NodeHealth
from faultlens.diagnosis.online import DiagnosisService
from faultlens.errors import ConfigError
from faultlens.metrics import MetricsServer, ServiceMetrics
from faultlens.schema import cloudevent
from faultlens.stream.bus.embedded_broker import EmbeddedBroker
from faultlens.ui.report import render_batch_report

HELP = "diagnose a batch input directory (incidents.jsonl, actions.jsonl, report.md) or run online from Kafka"
EXAMPLE = "faultlens diagnose ./run-dir --out ./diag      # batch\n  faultlens diagnose                            # online"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", nargs="?", help="batch input directory (docs/design.md, Batch directory); omit to run online")
    parser.add_argument("--out", help="output directory for the batch outputs (default: DIR/diagnosis)")
    parser.add_argument("--detectors", default="auto",
                        help="comma-separated detectors from models/ (failslow, peer), 'none', or 'auto' (all installed)")
    parser.add_argument("--node-health", metavar="FILE",
                        help="DuckDB file of node health memory (online default: [diagnosis] catalog_path)")
    parser.add_argument("--max-seconds", type=positive_float, help="online: stop after this long")


def make_detectors(spec: str) -> list[Any]:

    if spec in ("", "none"):
        return []
    available = default_detectors()
    if spec == "auto":
        return available
    wanted = {s.strip() for s in spec.split(",") if s.strip()}
    chosen = [d for d in available if d.name in wanted]
    missing = wanted - {d.name for d in chosen}
    if missing:
        raise ConfigError(f"unknown or uninstalled detectors: {', '.join(sorted(missing))}", key="--detectors")
    return chosen


def run(args: argparse.Namespace, config: Config) -> int:
    detectors = make_detectors(args.detectors)
    if args.dir:
        return _batch(Path(args.dir), Path(args.out) if args.out else Path(args.dir) / "diagnosis", config, detectors,
                      args.node_health)

    health = NodeHealth(args.node_health or config.diagnosis.catalog_path)
    metrics = server = None
    if config.diagnosis.metrics_port:

        metrics = ServiceMetrics("diagnosis")
        server = MetricsServer(metrics.registry, config.diagnosis.metrics_port, host=config.diagnosis.metrics_host)
        print(f"metrics on http://{config.diagnosis.metrics_host}:{server.start()}/metrics")
    def serve(service: DiagnosisService) -> None:
        # SIGTERM (a supervisor, kubelet) and SIGINT finish the round in hand, flush incidents,
        # actions and checkpoints and commit, as the end of --max-seconds does; then exit 0.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: service._stop.set())
        service.serve(max_seconds=args.max_seconds)

    try:
        if config.bus.bootstrap_servers:
            serve(DiagnosisService(config, detectors=detectors, node_health=health, metrics=metrics))
            return 0
        with EmbeddedBroker() as broker:
            print(f"no bootstrap servers configured: embedded broker at {broker.bootstrap}")
            serve(DiagnosisService(config, bootstrap=broker.bootstrap, detectors=detectors, node_health=health,
                                   metrics=metrics))
        return 0
    finally:
        health.close()
        if server is not None:
            server.stop()


def read_dir(path: Path, progress: Any = None) -> tuple[Any, list[Any]]:
    """(job topology, time-ordered records) of a batch directory, via collectors.batch.

    ``progress(phase, done, total)`` is passed to the reader.
    """
    data = _read_batch(path, progress)
    return data.job, list(data.records())


# Above this much NVML input (nodes/*/gpu.jsonl) the samples are streamed, not held: reading each node's file
# again as the records merge costs ~30% more CPU (512 GPUs: 6.9 s instead of 5.2 s) and halves the peak RSS
# (186 instead of 394 MB), so a small job keeps the faster path and a big one fits in memory.
STREAM_GPU_BYTES = 64 * 1024 * 1024


def _gpu_bytes(path: Path) -> int:
    total = 0
    for f in path.glob("nodes/*/gpu.jsonl"):
        try:
            total += f.stat().st_size
        except OSError:
            continue
    return total


def _read_batch(path: Path, progress: Any = None, *, stream_gpu: bool = False) -> Any:
    return read_batch_dir(path, progress=progress, stream_gpu=stream_gpu)


def unparsed_section(data: Any, few: int = 10) -> str:
    """The report's "Unparsed input" section: how many lines/files gave no record, why, the first few."""
    log = getattr(data, "unparsed", None)
    if log is None or not log.count:
        return ""
    return "\n## Unparsed input\n\n" + "\n".join(log.summary(few)) + "\n"


def _batch(path: Path, out: Path, config: Config, detectors: list[Any], health_path: str | None) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


    console = Console(stderr=True)
    if not path.is_dir():
        raise ConfigError(f"{path} is not a directory")
    columns = (TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        t0 = time.perf_counter()
        reading = bar.add_task("reading", total=None)

        def read_progress(phase: str, done: int, total: int) -> None:
            bar.update(reading, completed=done, total=total, description=f"reading {phase}")

        data = _read_batch(path, read_progress, stream_gpu=_gpu_bytes(path) > STREAM_GPU_BYTES)
        n_records = len(data)
        if not n_records:  # nothing to diagnose is an error, not an empty report
            why = f" (e.g. {data.errors[0]})" if data.errors else ""
            raise ConfigError(f"{path}: no input records: expected job.json, nodes/<node>/ logs or steps/*.jsonl "
                              f"(docs/design.md, Batch directory){why}")
        gc.freeze()  # the records read so far live to the end: later collections need not rescan them
        t1 = time.perf_counter()
        health = NodeHealth(health_path) if health_path else None
        diagnosing = bar.add_task("diagnosing", total=n_records)
        # streamed: the NVML samples are read again as they merge, never all held (benchmarks/batch_scale.py);
        # the cyclic collector is off meanwhile: each streamed sample is garbage at once (reference counting frees
        # it) and the collector would only rescan the engine's state again and again
        collecting = gc.isenabled()
        gc.disable()
        try:
            incidents, actions = diagnose_records(data.job, data.records(stacks=False), config, detectors=detectors,
                                                  node_health=health, stacks=data.stacks,
                                                  progress=lambda n: bar.update(diagnosing, completed=n))
        finally:
            if collecting:
                gc.enable()
        bar.update(diagnosing, completed=n_records)
        t2 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    (out / "incidents.jsonl").write_bytes(b"".join(orjson.dumps(cloudevent(i)) + b"\n" for i in incidents))
    (out / "actions.jsonl").write_bytes(b"".join(orjson.dumps(cloudevent(a)) + b"\n" for a in actions))
    report = render_batch_report(path, incidents, actions, detectors, n_records, t1 - t0, t2 - t1,
                                 clocks=data.clocks, errors=data.errors)
    (out / "report.md").write_text(report + unparsed_section(data))
    console.print(f"{n_records:,} records, {len(incidents)} incident(s), {len(actions)} action(s) "
                  f"-> {out} (read {t1 - t0:.1f} s, diagnosed {t2 - t1:.1f} s, total {t2 - t0:.1f} s)")
    log = getattr(data, "unparsed", None)
    if log is not None and log.count:
        console.print(f"  {log.count:,} unparsed input line(s)/file(s) (listed in report.md), e.g.",
                      markup=False, highlight=False)
        for u in log.first[:3]:
            console.print(f"    {str(u)[:200]}", markup=False, highlight=False)
    elif data.errors:
        console.print(f"  {len(data.errors)} bad input line(s), e.g. {data.errors[0]}", markup=False, highlight=False)
    for a in actions:
        console.print(f"  {a.type:16} {', '.join(a.nodes) or '-':24} {a.reason[:120]}")
    return 0
