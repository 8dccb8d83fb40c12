"""Benchmark: `faultlens explain` throughput on a large kernel log, and label agreement.

Builds a kernel log of the requested size from real line shapes (mostly ordinary
kernel noise, a few percent Xid/NVRM/mlx5/AER lines, some call traces), runs
the explain pipeline with --json output to /dev/null, and scores explain's
verdicts against the labels of the real-log fixtures (tests/fixtures/real_logs).

    python benchmarks/explain.py [--quick] [--mb 100]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REAL_LOGS = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "real_logs"
NOISE = [
    "audit: type=1400 audit({t}:2): apparmor=\"STATUS\" operation=\"profile_replace\" profile=\"unconfined\" name=\"snap.lxd\" pid={p}",
    "IPv4: martian source 10.0.3.{p} from 10.0.0.1, on dev eth0",
    "EXT4-fs (md127p3): re-mounted 0f3cd65a-338b-4574-bba3-ecef214e1917 r/w. Quota mode: none.",
    "workqueue: ib_cache_event_task [ib_core] hogged CPU for >10000us 4 times, consider switching to WQ_UNBOUND",
    "perf: interrupt took too long (2503 > 2500), lowering kernel.perf_event_max_sample_rate to 79750",
    "docker0: port 1(veth{p}) entered forwarding state",
]
SIGNAL = [
    "NVRM: Xid (PCI:0000:3b:00): 79, pid={p}, name=python, GPU has fallen off the bus.",
    "NVRM: Xid (PCI:0000:19:00): 94, pid={p}, name=python3.10, Ch 00000008",
    "NVRM: Xid (PCI:0000:db:00): 31, pid={p}, Ch 00000008, intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_10 faulted @ 0x7fd7_90743000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
    "mlx5_core 0000:5c:00.0: mlx5_pcie_event:299:(pid {p}): Detected insufficient power on the PCIe slot (27W).",
    "mlx5_core 0000:ab:00.0 mlx5_5: Port: 1 Link DOWN",
    "pcieport 0000:00:03.1: AER: Corrected error received: 0000:3b:00.0",
    "INFO: task python:{p} blocked for more than 122 seconds.",
]


def build(path: str, size_bytes: int, seed: int = 7) -> int:
    rnd = random.Random(seed)
    t = 1000.0
    n = 0
    with open(path, "w") as f:
        written = 0
        while written < size_bytes:
            t += rnd.random() * 0.01
            r = rnd.random()
            if r < 0.03:
                line = f"[{t:12.6f}] " + rnd.choice(SIGNAL).format(p=rnd.randint(100, 99999), t=t)
            elif r < 0.04:
                line = f"[{t:12.6f}] Call Trace:\n[{t:12.6f}]  __schedule+0x2cb/0x750\n[{t:12.6f}]  schedule+0x4e/0xc0"
                n += 2
            else:
                line = f"[{t:12.6f}] " + rnd.choice(NOISE).format(p=rnd.randint(100, 99999), t=int(t))
            f.write(line + "\n")
            written += len(line) + 1
            n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10 MB instead of 100 MB")
    ap.add_argument("--smoke", action="store_true", help="half a MB (seconds): does it still run")
    ap.add_argument("--mb", type=float, default=None)
    args = ap.parse_args()
    mb = args.mb or (0.5 if args.smoke else 10.0 if args.quick else 100.0)
    from faultlens.commands import explain as cmd
    from faultlens.diagnosis.explain import score_real_logs

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kern.log")
        lines = build(path, int(mb * 1024 * 1024))
        ns = argparse.Namespace(files=[path], json=True, format="auto", only_findings=False, year=2024)
        devnull = open(os.devnull, "wb")  # noqa: SIM115
        real_stdout = sys.stdout
        sys.stdout = io.TextIOWrapper(devnull)
        t0 = time.perf_counter()
        try:
            cmd.run(ns, None)
        finally:
            sys.stdout.flush()
            sys.stdout = real_stdout
        elapsed = time.perf_counter() - t0
    score = score_real_logs(str(REAL_LOGS)) if REAL_LOGS.is_dir() else None
    print(f"{'figure':<36} {'value':>14}")
    print(f"{'kernel log size (MB)':<36} {mb:>14.1f}")
    print(f"{'lines':<36} {lines:>14,}")
    print(f"{'explain --json wall time (s)':<36} {elapsed:>14.2f}")
    print(f"{'lines per second':<36} {lines / elapsed:>14,.0f}")
    if score:
        print(f"{'real-logs samples matched':<36} {score['matched']:>10}/{score['samples']:<3}")
        print(f"{'real-logs lines unrecognised':<36} {score['unrecognised_lines']:>14}")
        for r in score["rows"]:
            if not r["ok"]:
                print(f"  miss {r['id']}: {'; '.join(r['problems'])}")
    out = {"bench": "explain", "mb": mb, "seconds": round(elapsed, 2), "lines_per_s": round(lines / elapsed),
           "mb_per_s": round(mb / elapsed, 1)}
    if score:
        out.update(label_agreement=round(score["rate"], 4), real_lines=score["lines"], real_unrecognised=score["unrecognised_lines"])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
