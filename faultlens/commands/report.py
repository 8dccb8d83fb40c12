"""``faultlens report``: a root-cause report of one job from the lake (HTML or Markdown)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from faultlens.config import Config
from faultlens.errors import ConfigError

HELP = (
    "Render the root-cause report of a job over a time range from the lake: a summary per incident "
    "(culprit, reason, evidence, actions), the downtime ledger (time lost per cause, ETTR), MTBF/MTTR, the Xid "
    "histogram, top failing machines and RMA candidates. HTML is one self-contained file with inline SVG "
    "charts that opens offline; --format md gives Markdown for chat and tickets."
)
EXAMPLE = "faultlens report --lake ./lake --job j1 --since 2025-03-01T00:00 --until 2025-03-08T00:00 --out report.html"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lake", default=None, help="lake directory (default: lake.path)")
    p.add_argument("--job", required=True, help="job id")
    p.add_argument("--since", default=None, help="start, ISO 8601 (UTC when no zone) or unix seconds")
    p.add_argument("--until", default=None, help="end (exclusive), ISO 8601 or unix seconds")
    p.add_argument("--out", default=None, help="output file (default: stdout)")
    p.add_argument("--format", dest="fmt", choices=["html", "md"], default=None,
                   help="html or md (default: from --out's suffix, else html)")


def run(args: argparse.Namespace, config: Config) -> int:
    from faultlens.ui.report import parse_time, render_report

    lake = Path(args.lake or config.lake.path)
    if not lake.is_dir():
        raise ConfigError(f"lake directory {lake} does not exist", key="lake.path")
    fmt = args.fmt or ("md" if args.out and args.out.endswith(".md") else "html")
    try:
        since, until = parse_time(args.since), parse_time(args.until)
    except ValueError as exc:
        raise ConfigError(f"bad time: {exc}", key="--since/--until") from None
    text = render_report(lake, args.job, since, until, fmt=fmt)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"wrote {args.out} ({len(text) // 1024} KiB)", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
