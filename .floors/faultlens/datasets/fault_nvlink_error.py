"""NVLink errors: CRC/replay/recovery counters climbing, then a fatal Xid 74 and a crash.

Footprint: gpu (nvlink_crc_errors, nvlink_replay_errors, nvlink_recovery_errors
and nvlink_errors rising from a minute or two before onset), kernel (Xid 74
"NVLink: fatal error detected on link N"), nccl (the culprit's "uncorrectable
NVLink error" traceback, others' watchdogs), steps (stop at onset).
"""

from __future__ import annotations

from typing import Any

from faultlens.collectors.nvml_backend import NvmlEvent
from faultlens.datasets import signal_kernel as k
from faultlens.datasets import signal_nccl as nc
from faultlens.datasets.effects import FaultContext
from faultlens.datasets.fault_base import Fault, crash_then_watchdog


class NvlinkError(Fault):
    KIND = "nvlink_error"
    EXPECTED_ACTION = "evict_nodes"
    FOOTPRINT = "gpu NVLink CRC/replay/recovery counters rising; kernel Xid 74; culprit NVLink CUDA error; other ranks' watchdog"

    def inject(self, ctx: FaultContext) -> dict[str, Any]:
        node, gpu, rank = ctx.pick_gpu(self.node, self.gpu)
        t = ctx.onset(self.onset_s, 0.25, 0.35)
        c, proc = ctx.cluster, ctx.procs[rank]
        lead = float(self.params.get("precursor_s", ctx.rng.uniform(60, 120)))
        t0 = max(ctx.train_start_ts, t - lead)
        crc = int(ctx.rng.integers(200, 2000))
        ctx.gpu_ramp(node, gpu, "nvlink_crc_errors", crc, t0, ctx.end_ts)
        ctx.gpu_ramp(node, gpu, "nvlink_replay_errors", crc // 4, t0, ctx.end_ts)
        ctx.gpu_ramp(node, gpu, "nvlink_recovery_errors", 3, t0, t + 1)
        ctx.gpu_ramp(node, gpu, "nvlink_errors", crc + crc // 4 + 3, t0, ctx.end_ts)
        link = int(ctx.rng.integers(0, 18))
        regs = ["0x0"] * 7
        regs[int(ctx.rng.integers(2, 6))] = "0x10000"
        pci = c.gpu_pci(gpu)
        ctx.kernel(node, t, [k.xid(pci, 74, f"NVLink: fatal error detected on link {link}({', '.join(regs)})", pid=proc.pid)])
        ctx.kernel(node, t + 0.002, [k.xid(pci, 74, f"NVLink: fatal error detected on link {link}({', '.join(regs)})")])
        ctx.nvml_event(node, NvmlEvent(ts=t, gpu=gpu, kind="xid", xid=74, pci_bus=c.gpu_pci_full(gpu), detail="NVLink Error"))
        ctx.stop_training(t)
        crash = t + 0.3 + float(ctx.rng.uniform(0, 0.5))
        ctx.nccl_lines(rank, crash, nc.cuda_error_lines(proc, "uncorrectable NVLink error detected during the execution"))
        crash_then_watchdog(ctx, node, rank, crash, 1)
        return self.truth(ctx, onset_ts=t, end_ts=None, gpus=[(node, gpu)], ranks=[rank])
