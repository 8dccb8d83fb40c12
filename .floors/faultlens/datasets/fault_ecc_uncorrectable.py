"""Uncorrectable ECC error: Xid 48 (DBE) with Xid 63 and Xid 94/95, the DBE counter, a crash.

Footprint: kernel (Xid 48, 63 and 94 or 95 on the culprit node), gpu
(ecc_dbe and ecc_dbe_agg +1, remap_pending, remapped_rows_unc +1; NVML events
xid 48 and ecc_dbe), nccl (the culprit rank's "uncorrectable ECC error"
traceback; other nodes' watchdogs one timeout later), steps (stop at onset).
"""

from __future__ import annotations

from typing import Any

from faultlens.collectors.nvml_backend import NvmlEvent
from faultlens.datasets import signal_kernel as k
from faultlens.datasets import signal_nccl as nc
from faultlens.datasets.effects import FaultContext
from faultlens.datasets.fault_base import Fault, crash_then_watchdog
from faultlens.datasets.fault_gpu_lost import serial_of


def dbe_records(ctx: FaultContext, node: str, gpu: int, t: float, pid: int, contained: bool) -> float:
    """The NVRM sequence of a double-bit error (as in real-logs k048); returns the time of the last line."""
    c = ctx.cluster
    pci, uuid = c.gpu_pci(gpu), c.gpu_uuid(node, gpu)
    addr = int(ctx.rng.integers(0x100000000, 0x2000000000))
    recs = k.gpu_header(pci, uuid, serial_of(uuid)) + [
        [k.xid(pci, 48, f"An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at physAddr 0x{addr:x} partition {int(ctx.rng.integers(0, 8))}, subpartition {int(ctx.rng.integers(0, 2))}.")],
        [k.xid(pci, 63, f"Row Remapper: New row (0x{addr:016x}) marked for remapping, reset gpu to activate.")],
    ]
    if contained:
        recs.append([k.xid(pci, 94, "Contained: SM (0x1). RST: No, D-RST: No")])
        recs += [[k.xid(pci, 94, f"Ch {ch:08x}", pid=pid, name="python3")] for ch in range(8, 12)]
    else:
        recs.append([k.xid(pci, 95, "Uncontained: FBHUB. RST: Yes, D-RST: No")])
    ts = t
    for rec in recs:
        ctx.kernel(node, ts, rec)
        ts += 0.0085
    ctx.gpu_ramp(node, gpu, "ecc_dbe", 1, t, t + 1)
    ctx.gpu_ramp(node, gpu, "ecc_dbe_agg", 1, t, t + 1)
    ctx.gpu_ramp(node, gpu, "remapped_rows_unc", 1, t, t + 1)
    ctx.gpu_set(node, gpu, "remap_pending", True, t)
    ctx.nvml_event(node, NvmlEvent(ts=t, gpu=gpu, kind="ecc_dbe", pci_bus=c.gpu_pci_full(gpu)))
    ctx.nvml_event(node, NvmlEvent(ts=t, gpu=gpu, kind="xid", xid=48, pci_bus=c.gpu_pci_full(gpu),
                                   detail="Double Bit ECC Error"))
    return ts


class EccUncorrectable(Fault):
    KIND = "ecc_uncorrectable"
    EXPECTED_ACTION = "evict_nodes"
    FOOTPRINT = "kernel Xid 48 + 63 + 94/95; gpu ecc_dbe +1 and remap pending; culprit CUDA ECC traceback; other ranks' watchdog"

    def inject(self, ctx: FaultContext) -> dict[str, Any]:
        node, gpu, rank = ctx.pick_gpu(self.node, self.gpu)
        t = ctx.onset(self.onset_s)
        proc = ctx.procs[rank]
        contained = bool(self.params.get("contained", ctx.rng.random() < 0.5))
        dbe_records(ctx, node, gpu, t, proc.pid, contained)
        ctx.stop_training(t)
        crash = t + 0.4 + float(ctx.rng.uniform(0, 0.6))
        ctx.nccl_lines(rank, crash, nc.cuda_error_lines(proc, "uncorrectable ECC error encountered"))
        crash_then_watchdog(ctx, node, rank, crash, 1)
        return self.truth(ctx, onset_ts=t, end_ts=None, gpus=[(node, gpu)], ranks=[rank])
