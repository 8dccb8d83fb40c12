"""Simulator throughput: one hour of a 1,024-GPU job (128 nodes x 8, 1 Hz samples, every step of every rank).

Prints a table and, last, one JSON line:
{"bench": "simulate", "gpu_hour_1024_s": ..., "healthy_step_variability": ...}
``--quick``: 16 nodes x 8 for 15 minutes (the headline key is then extrapolated per GPU-hour).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from faultlens.datasets.cluster import ClusterSpec
from faultlens.datasets.scenario import FaultSpec, Scenario, ScenarioSpec
from faultlens.datasets.scenario_files import write_batch_dir


def _size(d: Path) -> tuple[int, int]:
    files = [p for p in d.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="8 nodes x 8 for 2 minutes (seconds): does it still run")
    ap.add_argument("--keep", help="write here and keep the directory")
    args = ap.parse_args()
    nodes, duration = (8, 120.0) if args.smoke else (16, 900.0) if args.quick else (128, 3600.0)
    cluster = ClusterSpec(nodes=nodes, gpus_per_node=8, tp=8, pp=8, dp=nodes // 8, microbatches=16,
                          num_layers=80, job="bench")
    spec = ScenarioSpec(name="bench", seed=1, cluster=cluster, duration_s=duration,
                        faults=(FaultSpec(kind="thermal_throttle", id="f1"),))
    out = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="faultlens-sim-"))
    try:
        t0 = time.perf_counter()
        sc = Scenario(spec)
        steps = len(sc.steps.end)
        t_steps = time.perf_counter() - t0
        write_batch_dir(sc, out)
        total = time.perf_counter() - t0
        n_files, n_bytes = _size(out)
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    gpus = nodes * 8
    samples = gpus * int(duration)
    step_lines = steps * gpus

    healthy = Scenario(ScenarioSpec(name="healthy", seed=2, cluster=cluster, duration_s=duration))
    d = healthy.steps.duration
    windows = [d[i:i + 100] for i in range(0, max(1, len(d) - 99), 100)]
    variability = float(np.mean([w.max() / w.min() for w in windows if len(w) == 100]) if len(d) >= 100
                        else d.max() / d.min())
    per_gpu_hour = total * (1024 / gpus) * (3600.0 / duration)

    rows = [("cluster", f"{nodes} nodes x 8 GPUs (tp=8 pp=8 dp={nodes // 8})"), ("simulated", f"{duration:.0f} s"),
            ("steps", f"{steps} ({step_lines:,} step lines)"), ("GPU samples", f"{samples:,}"),
            ("step timeline", f"{t_steps:.2f} s"), ("total (generate + write)", f"{total:.2f} s"),
            ("files / bytes", f"{n_files:,} / {n_bytes / 1e6:,.1f} MB"),
            ("GPU samples per s", f"{samples / total:,.0f}"),
            ("1,024-GPU hour (s)", f"{per_gpu_hour:.1f}" + (" (extrapolated)" if args.quick or args.smoke else "")),
            ("healthy step max/min over 100 steps", f"{variability:.3f}")]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    print(json.dumps({"bench": "simulate", "gpu_hour_1024_s": round(per_gpu_hour, 2),
                      "healthy_step_variability": round(variability, 3), "bytes": n_bytes,
                      "gpu_samples_per_s": round(samples / total), "quick": args.quick}))


if __name__ == "__main__":
    main()
