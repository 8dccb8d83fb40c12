"""A hung task on one node: a rank blocked in an uninterruptible read, the job stalls.

Footprint: kernel (``INFO: task python3:PID blocked for more than 120
seconds.`` with its call trace on the culprit node, 120 s after the stall),
stacks (the culprit in a dataset read, its TP peers in broadcast, the rest in
collectives), gpu (culprit idle, the others spinning in NCCL), nccl (the
waiting ranks' watchdogs after the timeout; the stuck rank's never fires),
steps (stop). The stacks root the hang on the node its kernel names: evicted
(policy.toml ``[route.hung_task] rooted_action``).
"""

from __future__ import annotations

from typing import Any

from faultlens.datasets import signal_kernel as k
from faultlens.datasets.effects import FaultContext
from faultlens.datasets.fault_base import Fault
from faultlens.datasets.fault_hang_stuck_rank import hang_around


class HungTask(Fault):
    KIND = "hung_task"
    EXPECTED_ACTION = "evict_nodes"
    FOOTPRINT = "kernel hung-task record on the node; stuck rank's stack in a read; others wait; watchdog on the waiters"

    def inject(self, ctx: FaultContext) -> dict[str, Any]:
        node, gpu, rank = ctx.pick_gpu(self.node, self.gpu)
        t = ctx.onset(self.onset_s, 0.1, 0.25)
        p = ctx.procs[rank]
        at = t + 120.0 + float(ctx.rng.uniform(0, 8))
        for i, line in enumerate(k.hung_task("python3", p.pid, p.pid - 40 - p.gpu, 120, "5.15.0-122-generic #132-Ubuntu")):
            ctx.kernel(node, at + 0.000004 * i, [line])
        hang_around(ctx, rank, t, "stuck_io")
        return self.truth(ctx, onset_ts=t, end_ts=None, nodes=[node], ranks=[rank])
