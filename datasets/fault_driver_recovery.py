"""The driver states the recovery (issue 36): a GSP timeout (Xid 119) then Xid 154 "Node Reboot
Required", NVML's GPU recovery action field turning 2; the GPU stays in the samples.

Footprint: kernel (Xid 119 then Xid 154 on the culprit node, real wording: NVIDIA's Xid catalog),
gpu (``recovery_action`` = 2 on the culprit GPU from the fault on), nccl (the culprit rank's CUDA
error; every rank elsewhere hits the watchdog one timeout later), steps (stop at onset). Only the
driver's word says the machine must go: faultlens follows it (evict_nodes).
"""

from __future__ import annotations

from typing import Any

from faultlens.datasets import signal_kernel as k
from faultlens.datasets import signal_nccl as nc
from faultlens.datasets.effects import FaultContext
from faultlens.datasets.fault_base import Fault, crash_then_watchdog

GSP_TIMEOUT = ("Timeout after 6s of waiting for RPC response from GPU{gpu} GSP! Expected function 76 "
               "(GSP_RM_CONTROL) (0x20803039 0x8).")
REBOOT = "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)"


class DriverRecovery(Fault):
    KIND = "driver_recovery"
    EXPECTED_ACTION = "evict_nodes"
    FOOTPRINT = "kernel Xid 119 + Xid 154 Node Reboot Required; gpu recovery_action=2; culprit CUDA error; watchdogs"

    def inject(self, ctx: FaultContext) -> dict[str, Any]:
        node, gpu, rank = ctx.pick_gpu(self.node, self.gpu)
        t = ctx.onset(self.onset_s)
        proc, pci = ctx.procs[rank], ctx.cluster.gpu_pci(gpu)
        ctx.kernel(node, t, [k.xid(pci, 119, GSP_TIMEOUT.format(gpu=gpu), pid=proc.pid)])
        ctx.kernel(node, t + 0.4, [f"NVRM: Xid (PCI:{pci}): 154, {REBOOT}"])
        ctx.gpu_set(node, gpu, "recovery_action", 2, t + 0.5)
        ctx.stop_training(t)
        crash = t + 2.0 + float(ctx.rng.uniform(0, 1.5))
        ctx.nccl_lines(rank, crash, nc.cuda_terminate(proc, "unknown error"))
        crash_then_watchdog(ctx, node, rank, crash, -6)
        return self.truth(ctx, onset_ts=t, end_ts=None, gpus=[(node, gpu)], ranks=[rank])
