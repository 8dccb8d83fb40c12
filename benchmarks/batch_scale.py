"""Post-mortem cost as the job grows: `faultlens diagnose DIR` on simulated jobs of 64 to 8,192 GPUs.

Each size is a batch directory written by the simulator (datasets/scenario.py: 8 GPUs a node,
ten minutes of 1 Hz NVML samples, per-node kernel logs, the ranks' NCCL logs and step
timings, one Xid 79) and diagnosed by `faultlens diagnose DIR --out OUT` as a child process,
as a user runs it. Per size: wall seconds of the child, its peak RSS (ru_maxrss of the child
from wait4, not this script's), input MB, records, and whether it evicted the culprit. The
machine is shared: the 1-minute load average before and after each run is printed beside
the figures (a loaded 2-core machine stretches the seconds, not the memory).

    python benchmarks/batch_scale.py --smoke    # 16 GPUs, seconds
    python benchmarks/batch_scale.py --quick    # 16 and 64 GPUs, under a minute
    python benchmarks/batch_scale.py            # 64, 512, 2,048 and 8,192 GPUs (8,192 writes ~2.7 GB)
    python benchmarks/batch_scale.py --sizes 2048 --keep /tmp/scale   # reuse written directories
    python benchmarks/batch_scale.py --sizes 2048 --profile /tmp/p2048.prof

Last line: JSON {"bench": "batch_scale", "sizes": [{"gpus", "seconds", "peak_rss_mb", "load_before",
"load_after", "cpu_seconds", ...}], "seconds_per_gpu_growth": ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from faultlens.datasets.scenario import scenario_for  # noqa: E402
from faultlens.datasets.scenario_files import write_batch_dir  # noqa: E402

GPUS_PER_NODE = 8


def _write(gpus: int, root: Path, duration_s: float) -> Path:
    d = root / f"job-{gpus}"
    if (d / "job.json").exists():
        return d
    sc = scenario_for("gpu_lost", nodes=max(1, gpus // GPUS_PER_NODE), gpus_per_node=GPUS_PER_NODE,
                      duration_s=duration_s, seed=36, name=f"scale-{gpus}")
    write_batch_dir(sc, d)
    return d


def _size_mb(d: Path) -> float:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file()) / 1e6


def _diagnose(d: Path, out: Path, profile: str | None) -> tuple[float, float, float, int, str]:
    """Run `faultlens diagnose` as a child; (wall s, its CPU s (user + sys), its peak RSS MB, return code,
    stdout tail). CPU seconds move much less than wall seconds with the machine's load."""
    cmd = [sys.executable]
    if profile:
        cmd += ["-m", "cProfile", "-o", profile]
    cmd += ["-m", "faultlens.cli", "diagnose", str(d), "--out", str(out)]
    env = {**os.environ, "FAULTLENS_BOOTSTRAP": ""}
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        log.seek(0)
        tail = log.read()[-600:]
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024.0, proc.returncode, tail


def _evicted(out: Path) -> list[str]:
    path = out / "actions.jsonl"
    if not path.exists():
        return []
    acts = [json.loads(x).get("data", {}) for x in path.read_text().splitlines() if x.strip()]
    return sorted({n for a in acts if a.get("type") == "evict_nodes" for n in a.get("nodes") or ()})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="16 GPUs, 2 minutes of samples")
    ap.add_argument("--quick", action="store_true", help="16 and 64 GPUs")
    ap.add_argument("--sizes", default="", help="comma-separated GPU counts (multiples of 8)")
    ap.add_argument("--duration-s", type=float, default=600.0, help="seconds of 1 Hz samples (default 600)")
    ap.add_argument("--keep", help="write (and reuse) the batch directories here instead of a temporary folder")
    ap.add_argument("--profile", help="write a cProfile of the largest size's diagnose here")
    args = ap.parse_args()
    if args.sizes:
        sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    else:
        sizes = [16] if args.smoke else [16, 64] if args.quick else [64, 512, 2048, 8192]
    duration = 120.0 if args.smoke else args.duration_s
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="batch-scale-"))
    root.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    try:
        print(f"{'GPUs':>6} {'nodes':>6} {'input MB':>9} {'write s':>8} {'diagnose s':>11} {'CPU s':>7} {'peak RSS MB':>12} "
              f"{'load before/after':>18}  evicted")
        for gpus in sizes:
            t0 = time.perf_counter()
            d = _write(gpus, root, duration)
            written = time.perf_counter() - t0
            out = root / f"out-{gpus}"
            shutil.rmtree(out, ignore_errors=True)
            before = os.getloadavg()[0]
            wall, cpu, rss, rc, tail = _diagnose(d, out, args.profile if gpus == max(sizes) else None)
            after = os.getloadavg()[0]
            ev = _evicted(out)
            row = {"gpus": gpus, "nodes": gpus // GPUS_PER_NODE, "input_mb": round(_size_mb(d), 1),
                   "seconds": round(wall, 2), "cpu_seconds": round(cpu, 2), "peak_rss_mb": round(rss, 1), "load_before": round(before, 2),
                   "load_after": round(after, 2), "rc": rc, "evicted": ev}
            rows.append(row)
            print(f"{gpus:>6} {row['nodes']:>6} {row['input_mb']:>9} {written:>8.1f} {wall:>11.2f} {cpu:>7.1f} {rss:>12.1f} "
                  f"{before:>8.2f}/{after:<8.2f}  {','.join(ev) or '-'}")
            if rc != 0:
                print(tail, file=sys.stderr)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    growth = None
    if len(rows) >= 2 and rows[0]["seconds"] > 0:
        a, b = rows[0], rows[-1]
        growth = round((b["seconds"] / a["seconds"]) / (b["gpus"] / a["gpus"]), 3)  # 1.0: linear; < 1: start-up dominates
    print(json.dumps({"bench": "batch_scale", "sizes": rows, "seconds_per_gpu_growth": growth,
                      "max_seconds": max((r["seconds"] for r in rows), default=None),
                      "max_peak_rss_mb": max((r["peak_rss_mb"] for r in rows), default=None),
                      "failed": sum(1 for r in rows if r["rc"] != 0)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
