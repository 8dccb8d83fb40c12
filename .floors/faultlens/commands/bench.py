"""``faultlens bench``: run the scripts in benchmarks/ and collect their headline figures."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from faultlens.argtypes import positive_float
from faultlens.config import Config
from faultlens.errors import ConfigError

HELP = "Run benchmarks/*.py (each prints a table and, last, one JSON line) and summarise them."
EXAMPLE = "faultlens bench --quick --only ingest,diagnosis --out bench.jsonl"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="the smaller version of each benchmark (under a minute each)")
    p.add_argument("--smoke", action="store_true", help="each benchmark's seconds-long check that it still runs")
    p.add_argument("--only", default="", help="comma-separated benchmark names (file stems)")
    p.add_argument("--dir", default=None, help="benchmarks folder (default: ./benchmarks or the source tree's)")
    p.add_argument("--out", default=None, help="append each benchmark's JSON line to this file")
    p.add_argument("--timeout-s", type=positive_float, default=1800.0, help="per-benchmark time limit")


def _bench_dir(arg: str | None) -> Path:
    for cand in ([Path(arg)] if arg else [Path("benchmarks"), Path(__file__).resolve().parents[2] / "benchmarks"]):
        if cand.is_dir():
            return cand
    raise ConfigError("benchmarks folder not found; pass --dir", key="--dir")


def run(args: argparse.Namespace, config: Config) -> int:
    from rich.console import Console
    from rich.table import Table

    folder = _bench_dir(args.dir)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    scripts = sorted(p for p in folder.glob("*.py") if not p.name.startswith("_") and (not only or p.stem in only))
    unknown = only - {p.stem for p in scripts}
    if unknown:
        known = ", ".join(sorted(p.stem for p in folder.glob("*.py") if not p.name.startswith("_")))
        raise ConfigError(f"--only {', '.join(sorted(unknown))}: no such benchmark in {folder} (there are: {known})")
    console = Console()
    table = Table("benchmark", "seconds", "headline figures")
    failed = 0
    for script in scripts:
        mode = ["--smoke"] if args.smoke else ["--quick"] if args.quick else []
        console.print(f"[bold]running[/] {script.name} {' '.join(mode)}")
        start = time.monotonic()
        cmd = [sys.executable, str(script), *mode]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            table.add_row(script.stem, f"{args.timeout_s:.0f}", "[red]timed out[/]")
            failed += 1
            continue
        took = time.monotonic() - start
        sys.stdout.write(proc.stdout)
        lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
        try:
            figures = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
        except json.JSONDecodeError:
            figures = None
        if figures is None:
            failed += 1
            table.add_row(script.stem, f"{took:.1f}", f"[red]failed (exit {proc.returncode})[/] {proc.stderr[-300:]}")
            continue
        table.add_row(script.stem, f"{took:.1f}", json.dumps(figures))
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps(figures) + "\n")
    console.print(table)
    return 1 if failed else 0
