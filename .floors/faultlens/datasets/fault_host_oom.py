"""Host out of memory: the kernel's OOM killer kills one training process.

Footprint: kernel (``invoked oom-killer`` / ``oom-kill:constraint=...`` /
``Out of memory: Killed process PID (python3)`` on the culprit node), nccl
(torchrun's ``failed (exitcode: -9) local_rank: N`` in launcher.log; other
nodes' watchdogs one timeout later), gpu (the killed rank's GPU goes idle,
memory freed), steps (stop). A restart on the same nodes usually works.
"""

from __future__ import annotations

from typing import Any

from faultlens.datasets import signal_kernel as k
from faultlens.datasets.effects import FaultContext
from faultlens.datasets.fault_base import Fault, crash_then_watchdog


class HostOom(Fault):
    KIND = "host_oom"
    EXPECTED_ACTION = "restart_job"
    FOOTPRINT = "kernel OOM-killer record killing a rank; launcher exitcode -9; other ranks' watchdog"

    def inject(self, ctx: FaultContext) -> dict[str, Any]:
        node, gpu, rank = ctx.pick_gpu(self.node, self.gpu)
        t = ctx.onset(self.onset_s)
        pid = ctx.procs[rank].pid
        rss = int(ctx.rng.integers(180_000_000, 260_000_000))
        memcg = f"/kubepods.slice/kubepods-pod{int(ctx.rng.integers(100_000_000, 1_000_000_000)):x}.slice"
        for i, rec in enumerate(k.oom_kill(pid, "python3", rss, memcg)):
            ctx.kernel(node, t + 0.0004 * i, rec)
        crash_then_watchdog(ctx, node, rank, t + 0.01, -9)
        return self.truth(ctx, onset_ts=t, end_ts=None, nodes=[node], ranks=[rank])
