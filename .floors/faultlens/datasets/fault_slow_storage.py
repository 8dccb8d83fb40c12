"""Slow shared storage: every rank waits on its data loader, so every step is longer.

Footprint: steps (duration up by the same amount on every rank while fwd,
bwd and comm stay as they were: the time is spent waiting for data), kernel
(``nfs: server ... not responding, still trying`` on every node, ``OK`` when
it recovers), stacks (TP rank 0 of every group in the DataLoader, its peers
in broadcast: no single machine stands out). Not a machine fault: notify.
"""

from __future__ import annotations

from typing import Any

from faultlens.datasets import signal_kernel as k
from faultlens.datasets.effects import FaultContext
from faultlens.datasets.fault_base import Fault


class SlowStorage(Fault):
    KIND = "slow_storage"
    EXPECTED_ACTION = "notify"
    FOOTPRINT = "steps: every rank slower with unchanged fwd/bwd/comm; kernel nfs not responding on every node; stacks in the DataLoader"

    def inject(self, ctx: FaultContext) -> dict[str, Any]:
        t = ctx.onset(self.onset_s, 0.2, 0.4)
        length = float(self.params.get("length_s", 0.45 * ctx.duration_s))
        end = min(ctx.end_ts, t + length)
        extra = float(self.params.get("extra", ctx.rng.uniform(0.4, 1.0)))
        ctx.fx.step_delay.append((t, end, extra))
        server = "storage01"
        for node in ctx.cluster.node_names:
            ctx.kernel(node, t + float(ctx.rng.uniform(0, 3)), [k.nfs_not_responding(server)])
            if end < ctx.end_ts:
                ctx.kernel(node, end + float(ctx.rng.uniform(0, 3)), [k.nfs_ok(server)])
        heads = {r: "dataloader_wait" for r in range(ctx.topology.world_size) if ctx.topology.coords(r)["tp"] == 0}
        ctx.dump_stacks(t + min(60.0, 0.3 * (end - t)), heads, "broadcast")
        return self.truth(ctx, onset_ts=t, end_ts=end if end < ctx.end_ts else None, nodes=[], ranks=[],
                          slowdown=round(1.0 / (1.0 + extra), 3))
