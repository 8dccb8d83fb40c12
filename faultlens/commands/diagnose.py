"""``faultlens diagnose``: batch (a directory) or online (the bus), through the same engine."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import orjson

from faultlens.config import Config
from faultlens.errors import ConfigError

HELP = "diagnose a batch input directory (incidents.jsonl, actions.jsonl, report.md) or run online from Kafka"
EXAMPLE = "faultlens diagnose ./run-dir --out ./diag      # batch\n  faultlens diagnose                            # online"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", nargs="?", help="batch input directory (DESIGN.md); omit to run online")
    parser.add_argument("--out", help="output directory for the batch outputs (default: DIR/diagnosis)")
    parser.add_argument("--detectors", default="auto",
                        help="comma-separated detectors from models/ (failslow, peer), 'none', or 'auto' (all installed)")
    parser.add_argument("--node-health", metavar="FILE",
                        help="DuckDB file of node health memory (online default: [diagnosis] catalog_path)")
    parser.add_argument("--max-seconds", type=float, help="online: stop after this long")


def make_detectors(spec: str) -> list[Any]:
    from faultlens.diagnosis.engine import default_detectors

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
    from faultlens.diagnosis.nodehealth import NodeHealth
    from faultlens.diagnosis.online import DiagnosisService
    from faultlens.stream.broker import EmbeddedBroker

    health = NodeHealth(args.node_health or config.diagnosis.catalog_path)
    if config.bus.bootstrap_servers:
        DiagnosisService(config, detectors=detectors, node_health=health).serve(max_seconds=args.max_seconds)
        return 0
    with EmbeddedBroker() as broker:
        print(f"no bootstrap servers configured: embedded broker at {broker.bootstrap}")
        DiagnosisService(config, bootstrap=broker.bootstrap, detectors=detectors,
                         node_health=health).serve(max_seconds=args.max_seconds)
    return 0


def read_dir(path: Path) -> tuple[Any, list[Any]]:
    """(job topology, time-ordered records) of a batch directory, via collectors.batch."""
    try:
        from faultlens.collectors.batch import read_batch_dir
    except ImportError as exc:
        raise ConfigError(f"the batch reader (collectors/batch.py) is not installed: {exc}") from None
    data = read_batch_dir(path)
    return data.job, list(data.records())


def _batch(path: Path, out: Path, config: Config, detectors: list[Any], health_path: str | None) -> int:
    from rich.console import Console

    from faultlens.diagnosis.batch import diagnose_records
    from faultlens.diagnosis.nodehealth import NodeHealth
    from faultlens.stream.schema import cloudevent

    console = Console(stderr=True)
    if not path.is_dir():
        raise ConfigError(f"{path} is not a directory")
    t0 = time.perf_counter()
    with console.status(f"reading {path}"):
        job, records = read_dir(path)
    t1 = time.perf_counter()
    health = NodeHealth(health_path) if health_path else None
    with console.status(f"diagnosing {len(records):,} records"):
        incidents, actions = diagnose_records(job, records, config, detectors=detectors, node_health=health)
    t2 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    (out / "incidents.jsonl").write_bytes(b"".join(orjson.dumps(cloudevent(i)) + b"\n" for i in incidents))
    (out / "actions.jsonl").write_bytes(b"".join(orjson.dumps(cloudevent(a)) + b"\n" for a in actions))
    (out / "report.md").write_text(render_report(path, incidents, actions, detectors, len(records), t1 - t0, t2 - t1))
    console.print(f"{len(records):,} records, {len(incidents)} incident(s), {len(actions)} action(s) "
                  f"-> {out} (read {t1 - t0:.1f} s, diagnosed {t2 - t1:.1f} s)")
    for a in actions:
        console.print(f"  {a.type:16} {', '.join(a.nodes) or '-':24} {a.reason[:120]}")
    return 0


def render_report(path: Path, incidents: list[Any], actions: list[Any], detectors: list[Any], n_records: int,
                  read_s: float, diag_s: float) -> str:
    lines = [f"# faultlens diagnosis of `{path}`", "",
             f"{n_records:,} records read in {read_s:.1f} s, diagnosed in {diag_s:.1f} s. "
             f"Detectors: {', '.join(getattr(d, 'name', '?') for d in detectors) or 'none'}.", "", "## Actions", ""]
    if not actions:
        lines.append("No action: nothing needed the runner.")
    for a in actions:
        lines.append(f"- **{a.type}** {', '.join(a.nodes) or '(job)'} (confidence {a.confidence:.2f}"
                     f"{', dry run' if a.dry_run else ''}): {a.reason}")
    lines += ["", "## Incidents", ""]
    for i in incidents:
        lines.append(f"### {i.title} [{i.status}]")
        lines.append(f"kind `{i.kind}`, category `{i.category}`, confidence {i.confidence:.2f}. {i.summary}")
        for s in i.suspects[:5]:
            lines.append(f"- suspect **{s['node']}** score {s['score']:.2f}: {s.get('reason', '')[:200]}")
        for e in i.evidence[:5]:
            lines.append(f"  - `{e.get('source')}` {e.get('node', '')} {e.get('text', '')[:160].splitlines()[0] if e.get('text') else ''}")
        if i.muted:
            lines.append(f"- muted {len(i.muted)} symptom(s), e.g. {i.muted[0]['item'][:120]} (rule {i.muted[0]['by_rule']})")
        lines.append("")
    return "\n".join(lines) + "\n"
