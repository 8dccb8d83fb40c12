"""Red team: every attack of issue 24 against the real services, each counted.

Each attack is one function registered with ``@attack("name")``; it returns a dict of
counts whose keys name what went wrong (forged actions executed, injection effects,
forged log lines, crash loops, secrets in logs, evictions past a cap, ...). Every count
must be zero. Attacks run against real processes or the real classes on the embedded
broker (Tansu), never mocks.

    python benchmarks/redteam.py            # every attack
    python benchmarks/redteam.py --quick    # the same attacks, smaller volumes
    python benchmarks/redteam.py --smoke    # one small case per attack (seconds)
    python benchmarks/redteam.py --only forged_actions,injection

Last line: one JSON object, ``{"bench": "redteam", "<attack>.<count>": n, ..., "total": n}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


@dataclass(frozen=True)
class Scale:
    """How hard each attack pushes: ``smoke`` (seconds), ``quick``, full."""

    name: str
    factor: float  # 1.0 = full volumes

    def n(self, full: int, minimum: int = 1) -> int:
        return max(minimum, int(full * self.factor))


AttackFn = Callable[[Scale], dict[str, int]]
ATTACKS: dict[str, AttackFn] = {}


def attack(name: str) -> Callable[[AttackFn], AttackFn]:
    """Register an attack under ``name`` (its counts print as ``name.count``)."""

    def register(fn: AttackFn) -> AttackFn:
        ATTACKS[name] = fn
        return fn

    return register


# ---------------------------------------------------------------------------
# Signed actions, injection, forged log lines, secrets, the runner's ledger
# (issue 24 items 1, 2, 6, 7)
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# Caps that hold: per-job, fleet, breaker, runner's own limits (issue 24 item 3)
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# Poison messages and checkpoints without pickle (issue 24 items 4, 5)
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# Safe text: reports and explorer (issue 24 item 8)
# ---------------------------------------------------------------------------


@attack("safe_text")
def safe_text(scale: Scale) -> dict[str, int]:
    """Log text that is markup (``<script>``, ``<img onerror>``, Markdown images, backticks) in a
    kernel line, an incident and a node name, in a lake whose path holds a quote: ``faultlens
    report`` (Markdown and HTML) and the explorer in a real headless Chromium must show it as text.
    The same case at every scale (one lake, two reports, four pages)."""
    import tempfile

    from faultlens.cli import main as faultlens
    from tests.browser import explorer
    from tests.hostile_text import EVIL, hostile_lake, html_markup, markdown_markup

    with tempfile.TemporaryDirectory(prefix="redteam-text-") as tmp:
        root = Path(tmp)
        lake = hostile_lake(root)
        counts: dict[str, int] = {}
        md_out, html_out = root / "report.md", root / "report.html"
        failed = sum(faultlens(["report", "--lake", str(lake.path), "--job", lake.job, "--out", str(out)]) != 0
                     for out in (md_out, html_out))
        counts["quoted_lake_path_failures"] = failed
        md = markdown_markup(md_out.read_text() if md_out.exists() else "", spans=lake.texts)
        counts["raw_html_in_report_md"] = md["raw_html"]
        counts["images_in_report_md"] = md["images"]
        counts["broken_evidence_spans_in_report_md"] = md["broken_spans"]
        counts["markup_in_report_html"] = sum(html_markup(html_out.read_text() if html_out.exists() else "").values())
        with explorer(lake.path, root) as ui:
            q = urllib.parse.quote
            ui.visit(f"/incident?id={q(lake.incident_id)}", lambda t: "Culprit: n666" in t and "Evidence" in t)
            ui.visit(f"/machine?node={q(lake.node)}", lambda t: "Kernel events" in t)
            ui.visit("/", lambda t: "Open incidents" in t)
            ui.visit(f"/labels?id={q(lake.incident_id)}", lambda t: "Diagnosis:" in t)
            counts["explorer_remote_images"] = len(ui.remote_images())
            counts["explorer_remote_fetches"] = len(ui.remote_requests())
            # the explorer's own URLs carry the node name in their query string: only other hosts count
            counts["explorer_fetches_of_images_in_log_text"] = sum(EVIL in u for u in ui.remote_requests())
        return counts



# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller volumes")
    ap.add_argument("--smoke", action="store_true", help="one small case per attack (seconds)")
    ap.add_argument("--only", default="", help="comma-separated attack names")
    args = ap.parse_args(argv)
    scale = Scale("smoke", 0.01) if args.smoke else Scale("quick", 0.1) if args.quick else Scale("full", 1.0)
    names = [n for n in args.only.split(",") if n] or list(ATTACKS)
    unknown = [n for n in names if n not in ATTACKS]
    if unknown:
        ap.error(f"unknown attack(s): {', '.join(unknown)}; known: {', '.join(ATTACKS)}")
    figures: dict[str, Any] = {"bench": "redteam", "scale": scale.name}
    total = 0
    print(f"{'attack':<28} {'count':<40} {'value':>8}")
    for name in names:
        started = time.monotonic()
        try:
            counts = ATTACKS[name](scale)
        except Exception:  # an attack that breaks is itself a finding: count it, go on
            traceback.print_exc()
            counts = {"attack_failed": 1}
        for key, value in counts.items():
            print(f"{name:<28} {key:<40} {value:>8}")
            figures[f"{name}.{key}"] = value
            total += int(value)
        print(f"{name:<28} {'(seconds)':<40} {time.monotonic() - started:>8.1f}")
    figures["total"] = total
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
