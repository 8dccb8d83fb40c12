"""One IB link flap that recovers: a single Link DOWN / ACTIVE, one slow step, nothing else.

Footprint: kernel (one ``Port: 1 Link DOWN`` then ``Link ACTIVE`` a few
seconds later on one node), steps (one step longer by the outage). NCCL
retries through it: no WARN, no watchdog. The expected action is none:
network alerts are tolerated until repeated.
"""

from __future__ import annotations

from typing import Any

from faultlens.datasets import signal_kernel as k
from faultlens.datasets.effects import FaultContext
from faultlens.datasets.fault_base import Fault


class IbFlapTransient(Fault):
    KIND = "ib_flap_transient"
    EXPECTED_ACTION = "none"
    FOOTPRINT = "kernel one mlx5 Link DOWN then ACTIVE; one slow step; no NCCL error"

    def inject(self, ctx: FaultContext) -> dict[str, Any]:
        node, gpu, rank = ctx.pick_gpu(self.node, self.gpu)
        t = ctx.onset(self.onset_s, 0.2, 0.7)
        c = ctx.cluster
        outage = float(self.params.get("outage_s", ctx.rng.uniform(1.5, 5.0)))
        ctx.kernel(node, t, [k.ib_link(c.nic_pci(gpu), c.nic_name(gpu), "DOWN")])
        ctx.kernel(node, t + outage - 0.5, [k.ib_link(c.nic_pci(gpu), c.nic_name(gpu), "INIT")])
        ctx.kernel(node, t + outage, [k.ib_link(c.nic_pci(gpu), c.nic_name(gpu), "ACTIVE")])
        ctx.fx.hiccups.append((t, outage))
        return self.truth(ctx, onset_ts=t, end_ts=t + outage, nodes=[node], ranks=[])
