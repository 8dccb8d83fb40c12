"""An application CUDA fault (issue 36): Xid 43 from the training processes and every rank's
"CUDA error: an illegal memory access was encountered"; the machine is fine.

Footprint: kernel (Xid 43 "Ch 00000008" on the GPUs of the ranks that faulted, the form of
akash-network/support#244), nccl (the same CUDA error traceback on every rank, torch's
asynchronous-report hint after it), steps (stop). NVIDIA's catalog: Xid 13/31/43 are
application errors. The fix is the code: roll back, never evict.
"""

from __future__ import annotations

from typing import Any

from faultlens.datasets import signal_kernel as k
from faultlens.datasets import signal_nccl as nc
from faultlens.datasets.effects import FaultContext
from faultlens.datasets.fault_base import Fault

ERRORS = ("RuntimeError: CUDA error: an illegal memory access was encountered",
          "RuntimeError: CUDA error: misaligned address",
          "RuntimeError: CUDA error: an illegal instruction was encountered")
FRAMES = [("/workspace/Megatron-LM/megatron/core/transformer/attention.py", 402, "forward",
           "core_attn_out = self.core_attention(query, key, value, attention_mask)")]


class AppXid(Fault):
    KIND = "app_xid"
    EXPECTED_ACTION = "rollback_code"
    FOOTPRINT = "kernel Xid 43 on the faulting ranks' GPUs; nccl: the same CUDA error traceback on every rank"

    def inject(self, ctx: FaultContext) -> dict[str, Any]:
        t = ctx.onset(self.onset_s, 0.2, 0.6)
        exc = ERRORS[int(self.params.get("error", ctx.rng.integers(0, len(ERRORS))))]
        ctx.stop_training(t)
        for r in range(ctx.topology.world_size):
            p = ctx.procs[r]
            ctx.kernel(p.node, t + 0.001 * r, [k.xid(ctx.cluster.gpu_pci(p.gpu), 43, "Ch 00000008", pid=p.pid)])
            tr = t + 0.3 + float(ctx.rng.uniform(0, 0.05))
            ctx.nccl_lines(r, tr, nc.traceback(ctx.procs[r], nc.TRAIN_FRAMES[:5] + FRAMES, exc,
                                               ["CUDA kernel errors might be asynchronously reported at some other API "
                                                "call, so the stacktrace below might be incorrect."]))
            ctx.exit_ranks([r], tr + 0.2, 1)
        return self.truth(ctx, onset_ts=t, end_ts=None, nodes=[], ranks=[])
