"""A stretch of long sequences: steps get much slower, but their workload says why. Not a fault.

Footprint: steps only (duration up on every rank *with* sum_len_sq up in the
same lines). A workload-aware detector stays quiet; a naive one alarms.
"""

from __future__ import annotations

from typing import Any

from faultlens.datasets.effects import FaultContext
from faultlens.datasets.fault_base import Fault


class SeqSurge(Fault):
    KIND = "seq_surge"
    EXPECTED_ACTION = "none"
    FOOTPRINT = "steps: durations up with sum_len_sq up in the same lines; nothing else"

    def inject(self, ctx: FaultContext) -> dict[str, Any]:
        t = ctx.onset(self.onset_s, 0.3, 0.5)
        length = float(self.params.get("length_s", 0.25 * ctx.duration_s))
        mean_len = float(self.params.get("mean_len", ctx.rng.uniform(2500, 3500)))
        end = min(ctx.end_ts, t + length)
        ctx.fx.surges.append((t, end, mean_len))
        return self.truth(ctx, onset_ts=t, end_ts=end, nodes=[], ranks=[])
