"""Diagnosis on batch directories written by hand in other tools' shapes, end to end.

Each scenario of tests/handwritten.py (27: healthy, Xid 79, ECC DBE, persistent and
flapping IB links, host OOM, a user exception, a silent hang with stacks, a job-wide
storage stall, NaN loss with and without a culprit, PCIe and thermal slow GPUs, a pure
fail-slow rank, an 8% straggler, a sequence-length surge, a GPU vanishing from the
samples, NVLink counters, remap failure / pending flags, an SBE storm, a fabric-wide
link storm; issue 23's cascades: watchdogs ten minutes after an Xid 48, a storage stall's
silence, a segfault in libc, an exception on every rank, an informational Xid 63) is written as a batch
directory and run through `faultlens diagnose DIR --out OUT` as a process, as a user
would; its actions are judged against what an operator would accept (never one exact
output). Printed: per scenario the verdict, what was wanted and what came; the share
judged right.

What it does not show: the directories are still written by this project (by hand,
to the contract and to real producers' shapes, not by the simulator), 4 nodes x 8 GPUs,
one fault each. It is a floor for "other tools' shapes", not a measure of the field.

    python benchmarks/handwritten.py            # all scenarios
    python benchmarks/handwritten.py --quick    # the same (each takes ~2 s)
    python benchmarks/handwritten.py --only xid79,hang_silent
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from tests.handwritten import scenarios, write  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="same set (it already runs in well under a minute)")
    ap.add_argument("--smoke", action="store_true", help="the first two scenarios (seconds): does it still run")
    ap.add_argument("--only", default="", help="comma-separated scenario names")
    args = ap.parse_args(argv)
    wanted = {x for x in args.only.split(",") if x}
    specs = [s for s in scenarios() if not wanted or s.name in wanted][: 2 if args.smoke else None]
    console = Console()
    table = Table("scenario", "verdict", "wanted", "got", "s")
    right = 0
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for spec in specs:
            d = write(spec, Path(tmp) / spec.name)
            out = Path(tmp) / f"{spec.name}.out"
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "faultlens.cli", "diagnose", str(d), "--out", str(out),
                                   "--log-level", "ERROR"], capture_output=True, text=True)
            secs = time.perf_counter() - t0
            if proc.returncode != 0:
                ok, why = False, f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
            else:
                actions = [json.loads(x).get("data", {}) for x in (out / "actions.jsonl").read_text().splitlines() if x]
                ok, why = spec.expect.judge(actions)
            right += ok
            table.add_row(spec.name, "[green]right[/]" if ok else "[red]WRONG[/]", spec.expect.text, why[:70], f"{secs:.1f}")
    console.print(table)
    share = right / max(len(specs), 1)
    console.print(f"{right}/{len(specs)} scenarios judged right ({share:.0%}) in {time.perf_counter() - t_all:.0f} s")
    print(json.dumps({"bench": "handwritten", "scenarios": len(specs), "right": right, "share": round(share, 4)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
