"""GPU fell off the bus: Xid 79, the NVRM "fallen off the bus" record, a lost GPU, then watchdogs.

Footprint: kernel (Xid 79 + the multi-line NVRM record on the culprit node),
gpu (the GPU's samples turn ``lost=True``; NVML events xid 79 and gpu_lost),
nccl (the culprit rank's CUDA error; every rank on other nodes hits the
ProcessGroupNCCL watchdog one timeout later), steps (stop at onset).
"""

from __future__ import annotations

from typing import Any

from faultlens.collectors.nvml_backend import NvmlEvent
from faultlens.datasets import signal_kernel as k
from faultlens.datasets import signal_nccl as nc
from faultlens.datasets.cluster import GPU_PCI_DEVICE_ID
from faultlens.datasets.effects import FaultContext
from faultlens.datasets.fault_base import Fault, crash_then_watchdog


class GpuLost(Fault):
    KIND = "gpu_lost"
    EXPECTED_ACTION = "evict_nodes"
    FOOTPRINT = "kernel Xid 79 + fallen-off-the-bus record; gpu lost=True; culprit CUDA error; other ranks' watchdog after the timeout"

    def inject(self, ctx: FaultContext) -> dict[str, Any]:
        node, gpu, rank = ctx.pick_gpu(self.node, self.gpu)
        t = ctx.onset(self.onset_s)
        c, proc = ctx.cluster, ctx.procs[rank]
        pci, uuid = c.gpu_pci(gpu), c.gpu_uuid(node, gpu)
        for i, rec in enumerate(k.gpu_header(pci, uuid, serial_of(uuid))):
            ctx.kernel(node, t + 0.00001 * i, rec)
        ctx.kernel(node, t + 0.00003, [k.xid(pci, 79, "GPU has fallen off the bus.", pid=proc.pid)])
        ctx.kernel(node, t + 0.0001, [f"NVRM: GPU {pci}.0: GPU has fallen off the bus."])
        ctx.kernel(node, t + 0.13, k.fell_off_bus(f"{pci}.0", GPU_PCI_DEVICE_ID))
        ctx.gpu_set(node, gpu, "lost", True, t)
        ctx.nvml_event(node, NvmlEvent(ts=t, gpu=gpu, kind="xid", xid=79, pci_bus=c.gpu_pci_full(gpu),
                                       detail="GPU has fallen off the bus"))
        ctx.nvml_event(node, NvmlEvent(ts=t + 1.0, gpu=gpu, kind="gpu_lost", pci_bus=c.gpu_pci_full(gpu)))
        ctx.stop_training(t)
        crash = t + 1.5 + float(ctx.rng.uniform(0, 1.5))
        ctx.nccl_lines(rank, crash, nc.cuda_terminate(proc, "unknown error"))
        crash_then_watchdog(ctx, node, rank, crash, -6)
        return self.truth(ctx, onset_ts=t, end_ts=None, gpus=[(node, gpu)], ranks=[rank])


def serial_of(uuid: str) -> str:
    return "16529230" + str(int(uuid[4:12], 16) % 100000).zfill(5)
