"""What faultlens.torch costs a training step: the training thread's time per step with the
monitor (``with mon.step(...)``, two marks, a loss and grad norm given as tensors, the workload
of a batch's lengths) against the same loop without it, and the background thread's work.

    python benchmarks/torch_hook.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (a few seconds)")
    ap.add_argument("--smoke", action="store_true", help="a few hundred steps (it runs)")
    ap.add_argument("--steps", type=int, default=None)
    args = ap.parse_args()
    n = args.steps or (300 if args.smoke else 5_000 if args.quick else 50_000)
    import torch

    from faultlens.torch import TrainingMonitor

    lengths = torch.randint(16, 512, (16,))
    loss, gn = torch.tensor(2.5), torch.tensor(0.8)

    def bare() -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            pass
        return time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as d:
        mon = TrainingMonitor(job="bench", rank=0, node="n", steps_path=os.path.join(d, "s.jsonl"), stall_s=3600,
                              flight_recorder=False)
        rounds = []
        for _ in range(3):
            t0 = time.perf_counter()
            for i in range(n):
                with mon.step(i, lengths=lengths) as s:
                    s.mark("fwd")
                    s.mark("bwd")
                    s.update(loss=loss, grad_norm=gn)
            rounds.append(time.perf_counter() - t0)
        t0 = time.process_time()
        mon.close()
        size = os.path.getsize(mon.path)
    base = bare()
    per_step_us = (statistics.median(rounds) - base) / n * 1e6
    print(f"{'what':40} {'value':>12}")
    print(f"{'steps per round':40} {n:>12}")
    print(f"{'training-thread cost per step (us)':40} {per_step_us:>12.1f}")
    print(f"{'records written':40} {mon.written:>12}")
    print(f"{'bytes per record':40} {size / max(1, mon.written):>12.0f}")
    print(f"{'dropped / errors':40} {mon.dropped:>5} / {mon.errors:<5}")
    print(f"{'share of a 100 ms step':40} {per_step_us / 1e5:>11.4%}")
    print(json.dumps({"bench": "torch_hook", "torch": torch.__version__, "steps": 3 * n,
                      "per_step_us": round(per_step_us, 1), "share_of_100ms_step": round(per_step_us / 1e5, 6),
                      "dropped": mon.dropped, "errors": mon.errors}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
