"""``faultlens report``: a root-cause report of one job from the lake (HTML or Markdown)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from faultlens.config import Config
from faultlens.errors import ConfigError
from faultlens.ui import views
from faultlens.ui.report import _ts, parse_time, render_report

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

    lake = Path(args.lake or config.lake.path)
    if not lake.is_dir():
        raise ConfigError(f"lake directory {lake} does not exist")
    if not views.is_lake(lake):
        raise ConfigError(f"{lake} is not a lake: no table directory (incidents/, steps/, gpu/, ...) in it")
    fmt = args.fmt or ("md" if args.out and args.out.endswith(".md") else "html")
    since_until = []
    for flag, value in (("--since", args.since), ("--until", args.until)):
        try:
            since_until.append(parse_time(value))
        except ValueError:
            raise ConfigError(f"{flag} {value!r} is not a time: give ISO 8601 (2025-03-01T00:00) or unix seconds",
                              ) from None
    since, until = since_until
    if since is not None and until is not None and since >= until:
        raise ConfigError(f"--since {args.since} is not before --until {args.until}: the range is empty")
    con = views.connect(lake)
    try:
        span = views.job_span(con, args.job)
    finally:
        con.close()
    if span is None:
        raise ConfigError(f"job {args.job!r} is not in the lake {lake}")
    if (until is not None and until <= span[0]) or (since is not None and since >= span[1]):
        raise ConfigError(f"job {args.job!r} has nothing in [{_ts(since)}, {_ts(until)}): its data spans "
                          f"{_ts(span[0])} to {_ts(span[1])}")
    text = render_report(lake, args.job, since, until, fmt=fmt)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"wrote {args.out} ({len(text) // 1024} KiB)", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
