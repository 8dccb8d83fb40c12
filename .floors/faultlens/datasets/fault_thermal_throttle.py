"""Thermal throttling: one GPU heats up, its SM clock drops with the thermal throttle bits set (fail-slow).

Footprint: gpu (temp_c climbs to ~88-92 C, sm_clock_mhz falls to
slowdown x 1980, throttle_reasons has SW thermal 0x20 and HW thermal 0x40,
power drops), steps (the culprit rank's fwd/bwd grow by 1/slowdown, the other
ranks wait: comm grows), stacks (culprit computing, others in the
all-reduce). No kernel line, no NCCL error: only the data shows it.
"""

from __future__ import annotations

from typing import Any

from faultlens.datasets.effects import FaultContext
from faultlens.datasets.fault_base import Fault

THROTTLE_SW_THERMAL = 0x20
THROTTLE_HW_THERMAL = 0x40
BASE_SM_CLOCK_MHZ = 1980.0


def slow_rank_stacks(ctx: FaultContext, rank: int, t: float) -> None:
    """A fail-slow dump: the slow rank still computing while its peers wait in the all-reduce."""
    dump = t + min(120.0, 0.3 * (ctx.end_ts - t))
    ctx.dump_stacks(dump, {rank: "compute"}, "allreduce")


class ThermalThrottle(Fault):
    KIND = "thermal_throttle"
    EXPECTED_ACTION = "evict_nodes"
    FOOTPRINT = "gpu temp up, sm clock down, throttle bits 0x60; one rank slower (steps fwd/bwd up, others' comm up)"

    def inject(self, ctx: FaultContext) -> dict[str, Any]:
        node, gpu, rank = ctx.pick_gpu(self.node, self.gpu)
        t = ctx.onset(self.onset_s, 0.2, 0.4)
        slowdown = float(self.params.get("slowdown", round(float(ctx.rng.uniform(0.55, 0.8)), 3)))
        heat = max(ctx.train_start_ts, t - 45.0)
        ctx.gpu_set(node, gpu, "temp_c", ("ramp", 90.0 + float(ctx.rng.uniform(-2, 2)), heat, t), heat)
        ctx.gpu_set(node, gpu, "sm_clock_mhz", round(BASE_SM_CLOCK_MHZ * slowdown / 15) * 15, t)
        ctx.gpu_set(node, gpu, "throttle_reasons", THROTTLE_SW_THERMAL | THROTTLE_HW_THERMAL, t)
        ctx.gpu_set(node, gpu, "power_w", ("scale", 0.75), t)
        ctx.slow_rank(rank, slowdown, t)
        slow_rank_stacks(ctx, rank, t)
        return self.truth(ctx, onset_ts=t, end_ts=None, gpus=[(node, gpu)], ranks=[rank], slowdown=slowdown)
