"""``faultlens stream``: the stream processor (Kafka topics -> Parquet lake)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Any

from faultlens.argtypes import non_negative_float, positive_float, positive_int
from faultlens.config import Config
from faultlens.metrics import MetricsServer, ServiceMetrics
from faultlens.stream.bus.embedded_broker import EmbeddedBroker
from faultlens.stream.compaction import compact_lake
from faultlens.stream.processor import ProcessorStats, StreamProcessor
from faultlens.stream.retention import apply_retention

HELP = (
    "Consume the faultlens topics as one member of a consumer group and write them to the "
    "Hive-partitioned Parquet lake, exactly once (offsets are committed with the data). "
    "Run several on different machines with the same --group to split the partitions."
)
EXAMPLE = "faultlens stream --bootstrap-servers kafka:9092 --lake ./lake --catalog ./faultlens-catalog.duckdb"

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lake", metavar="DIR", help="lake directory (default [lake] path)")
    parser.add_argument("--catalog", metavar="FILE", help="this processor's DuckDB catalog file (default [lake] catalog_path)")
    parser.add_argument("--group", metavar="ID", help="consumer group id (default [lake] group_id)")
    parser.add_argument("--flush-interval-s", type=positive_float, help="commit at least this often (default [lake] flush_interval_s)")
    parser.add_argument("--flush-rows", type=positive_int, help="commit when this many rows are buffered (default [lake] flush_rows)")
    parser.add_argument("--exit-when-idle-s", type=positive_float, metavar="S", help="flush and exit after S seconds with partitions assigned and nothing left to read on them (a rebalance never counts)")
    parser.add_argument("--no-rollups", action="store_true", help="do not write the gpu_1m / steps_1m partial rollups")
    parser.add_argument("--compact", action="store_true", help="compact small files of closed hours, then exit (no consuming)")
    parser.add_argument("--compact-min-age-s", type=non_negative_float, default=3600.0, help="with --compact: only hours untouched this long")
    parser.add_argument("--retention", action="store_true",
                        help="drop lake hours past [retention] (age, size per table), then exit (no consuming)")


def run(args: argparse.Namespace, config: Config) -> int:
    lake_path = args.lake or config.lake.path
    catalog_path = args.catalog or config.lake.catalog_path
    if args.retention:
        kept = apply_retention(lake_path, config.retention)
        if kept.skipped:
            print(f"retention skipped: the lake's readers held it past {config.retention.lock_wait_s:g} s", file=sys.stderr)
            return 1
        print(f"retention dropped {sum(kept.dropped_hours.values())} table hours ({kept.dropped_bytes / 1e6:.1f} MB); "
              f"kept {sum(kept.kept_bytes.values()) / 1e6:.1f} MB in {len(kept.kept_bytes)} tables")
        if kept.seq is not None and kept.seq.files_in:
            print(f"_seq: {kept.seq.files_in} file(s) folded into one, {kept.seq.keys_dropped} old agent epoch(s) "
                  f"forgotten, {kept.seq.keys_kept} kept")
        return 0
    if args.compact:

        report = compact_lake(lake_path, min_age_s=args.compact_min_age_s)
        print(f"compacted {report.files_in} files into {report.files_out} in {report.partitions} table hours")
        return 0


    broker = None
    bootstrap = config.bus.bootstrap_servers
    if not bootstrap:

        broker = EmbeddedBroker().start()
        bootstrap = broker.bootstrap
        print(f"no bootstrap servers configured: started an embedded broker at {bootstrap} (memory only)", file=sys.stderr)
    metrics = server = None
    if config.lake.metrics_port:

        metrics = ServiceMetrics("stream")
        server = MetricsServer(metrics.registry, config.lake.metrics_port, host=config.lake.metrics_host)
        print(f"metrics on http://{config.lake.metrics_host}:{server.start()}/metrics", file=sys.stderr)
    proc = StreamProcessor(
        config,
        registry=metrics,
        bootstrap=bootstrap,
        lake_path=lake_path,
        catalog_path=catalog_path,
        group_id=args.group,
        flush_interval_s=args.flush_interval_s,
        flush_rows=args.flush_rows,
        rollups=not args.no_rollups,
        fetcher=config.lake.fetcher,
    )

    def _stop(signum: int, _frame: Any) -> None:
        proc.stop()

    signal.signal(signal.SIGTERM, _stop)
    progress = _progress_printer()
    try:
        stats = proc.run(exit_when_idle_s=args.exit_when_idle_s, on_progress=progress)
    except KeyboardInterrupt:
        stats = proc.stats
    finally:
        if server is not None:
            server.stop()
        if broker is not None:
            broker.stop()
    snap = stats.snapshot() if isinstance(stats, ProcessorStats) else {}
    print(f"stream: {sum(snap.get('rows', {}).values()):,} rows committed in {snap.get('commits', 0)} commits; "
          f"dead letters {sum(snap.get('dead_letters', {}).values())}", file=sys.stderr)
    return 0


def _progress_printer() -> Any:
    """A one-line live status on a terminal; a log line every ~10 s otherwise."""
    import time

    last = [0.0]
    console = None
    if sys.stderr.isatty():
        from rich.console import Console

        console = Console(stderr=True)

    def show(stats: Any) -> None:
        snap = stats.snapshot()
        line = (f"rows {sum(snap['rows'].values()):,}  messages {sum(snap['messages'].values()):,}  "
                f"lag {snap['lag']:,}  dead {sum(snap['dead_letters'].values())}  commits {snap['commits']}")
        if console is not None:
            console.print(line, end="\r", highlight=False)
        elif time.monotonic() - last[0] >= 10:
            last[0] = time.monotonic()
            log.info("%s", line)

    return show
