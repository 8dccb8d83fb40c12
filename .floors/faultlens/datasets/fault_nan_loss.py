"""NaN loss with no culprit: the grad norm spikes, then loss and grad norm turn NaN on every rank.

Footprint: steps only (``grad_norm`` several times its usual value for a few
steps, then ``loss`` and ``grad_norm`` NaN from onset on every rank). No
kernel, NCCL or GPU signal: stop-time checks decide.
"""

from __future__ import annotations

from typing import Any

from faultlens.datasets.effects import FaultContext
from faultlens.datasets.fault_base import Fault


class NanLoss(Fault):
    KIND = "nan_loss"
    EXPECTED_ACTION = "run_diagnostics"
    FOOTPRINT = "steps: grad_norm spike then NaN loss/grad_norm on every rank; nothing else"

    def inject(self, ctx: FaultContext) -> dict[str, Any]:
        t = ctx.onset(self.onset_s, 0.3, 0.6)
        ctx.fx.nan_from = t
        return self.truth(ctx, onset_ts=t, end_ts=None, nodes=[], ranks=[])
