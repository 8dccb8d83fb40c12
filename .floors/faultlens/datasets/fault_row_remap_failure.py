"""Row-remap failure: a DBE whose row cannot be remapped (Xid 48 then Xid 64), remap_failure set.

Footprint: kernel (Xid 48 and Xid 64 "All reserved rows for bank are
remapped"), gpu (ecc_dbe +1, remapped_rows_unc +1, ``remap_failure=True``),
nccl (the culprit's ECC traceback, others' watchdogs), steps (stop at onset).
"""

from __future__ import annotations

from typing import Any

from faultlens.collectors.nvml_backend import NvmlEvent
from faultlens.datasets import signal_kernel as k
from faultlens.datasets import signal_nccl as nc
from faultlens.datasets.effects import FaultContext
from faultlens.datasets.fault_base import Fault, crash_then_watchdog
from faultlens.datasets.fault_gpu_lost import serial_of


class RowRemapFailure(Fault):
    KIND = "row_remap_failure"
    EXPECTED_ACTION = "evict_nodes"
    FOOTPRINT = "kernel Xid 48 + Xid 64; gpu remap_failure=True, ecc_dbe +1; culprit ECC traceback; other ranks' watchdog"

    def inject(self, ctx: FaultContext) -> dict[str, Any]:
        node, gpu, rank = ctx.pick_gpu(self.node, self.gpu)
        t = ctx.onset(self.onset_s)
        c, proc = ctx.cluster, ctx.procs[rank]
        pci, uuid = c.gpu_pci(gpu), c.gpu_uuid(node, gpu)
        addr = int(ctx.rng.integers(0x100000000, 0x2000000000))
        recs = k.gpu_header(pci, uuid, serial_of(uuid)) + [
            [k.xid(pci, 48, f"An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at physAddr 0x{addr:x} partition {int(ctx.rng.integers(0, 8))}, subpartition {int(ctx.rng.integers(0, 2))}.")],
            [k.xid(pci, 64, f"Row Remapper Error: (0x{addr:016x}) - All reserved rows for bank are remapped")],
            [k.xid(pci, 94, "Contained: SM (0x1). RST: No, D-RST: No")],
        ]
        for i, rec in enumerate(recs):
            ctx.kernel(node, t + 0.008 * i, rec)
        ctx.gpu_ramp(node, gpu, "ecc_dbe", 1, t, t + 1)
        ctx.gpu_ramp(node, gpu, "ecc_dbe_agg", 1, t, t + 1)
        ctx.gpu_ramp(node, gpu, "remapped_rows_unc", 1, t, t + 1)
        ctx.gpu_set(node, gpu, "remap_failure", True, t)
        ctx.nvml_event(node, NvmlEvent(ts=t, gpu=gpu, kind="xid", xid=64, pci_bus=c.gpu_pci_full(gpu),
                                       detail="Row Remapper Error"))
        ctx.stop_training(t)
        crash = t + 0.5 + float(ctx.rng.uniform(0, 0.5))
        ctx.nccl_lines(rank, crash, nc.cuda_error_lines(proc, "uncorrectable ECC error encountered"))
        crash_then_watchdog(ctx, node, rank, crash, 1)
        return self.truth(ctx, onset_ts=t, end_ts=None, gpus=[(node, gpu)], ranks=[rank])
