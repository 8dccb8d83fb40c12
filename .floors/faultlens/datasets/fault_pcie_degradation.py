"""A degraded PCIe link: replay counter climbing, corrected AER errors, one slower rank (fail-slow).

Footprint: gpu (pcie_replay rising steadily on the culprit GPU), kernel
(periodic ``AER: Corrected error received`` / ``PCIe Bus Error:
severity=Corrected`` records for the GPU's bus), steps (the culprit rank's
fwd/bwd grow by 1/slowdown, every other rank's comm grows: the iteration
slows), stacks (culprit computing, others waiting in the all-reduce).
"""

from __future__ import annotations

from typing import Any

from faultlens.datasets import signal_kernel as k
from faultlens.datasets.cluster import GPU_PCI_DEVICE_ID
from faultlens.datasets.effects import FaultContext
from faultlens.datasets.fault_base import Fault
from faultlens.datasets.fault_thermal_throttle import slow_rank_stacks


class PcieDegradation(Fault):
    KIND = "pcie_degradation"
    EXPECTED_ACTION = "evict_nodes"
    FOOTPRINT = "gpu pcie_replay rising; kernel corrected AER records; one rank slower (steps fwd/bwd up, others' comm up)"

    def inject(self, ctx: FaultContext) -> dict[str, Any]:
        node, gpu, rank = ctx.pick_gpu(self.node, self.gpu)
        t = ctx.onset(self.onset_s, 0.2, 0.4)
        slowdown = float(self.params.get("slowdown", round(float(ctx.rng.uniform(0.6, 0.8)), 3)))
        ctx.slow_rank(rank, slowdown, t)
        rate = float(ctx.rng.uniform(20, 60))  # replays per minute
        ctx.gpu_ramp(node, gpu, "pcie_replay", rate * (ctx.end_ts - t) / 60.0, t, ctx.end_ts)
        dev = f"{ctx.cluster.gpu_pci(gpu)}.0"
        root = f"0000:{int(dev[5:7], 16) - 2:02x}:01.0"
        ts = t + float(ctx.rng.uniform(1, 10))
        while ts < ctx.end_ts:
            kind = "BadDLLP" if ctx.rng.random() < 0.7 else "BadTLP"
            for i, rec in enumerate(k.aer_corrected(root, dev, GPU_PCI_DEVICE_ID, kind)):
                ctx.kernel(node, ts + 0.00002 * i, rec)
            ts += float(ctx.rng.uniform(20, 70))
        slow_rank_stacks(ctx, rank, t)
        return self.truth(ctx, onset_ts=t, end_ts=None, gpus=[(node, gpu)], ranks=[rank], slowdown=slowdown)
