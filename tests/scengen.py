"""Seeded fault scenarios as records + truth, for classifier tests and benchmarks.

A stand-in for the simulator (datasets/) while it is being written, with the
same fault kinds and truth.json shape: each scenario is one job of ``nodes`` x 8
GPUs running for ``duration_s``, healthy until ``onset_s``, then one fault with
the signals the project brief lists for it (Xid lines, NVML counters, NCCL
errors, step stalls or slowdowns). It emits records directly (no log files), so
it tests the models, not the parsers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from faultlens.schema import GpuSample, GpuState, KernelEvent, NcclEvent, StepTiming
from faultlens.stream.topology import Topology

KINDS = ("healthy", "gpu_lost", "ecc_uncorrectable", "row_remap_failure", "nvlink_error", "ib_link_persistent",
         "ib_flap_transient", "pcie_degradation", "thermal_throttle", "host_oom", "hung_task", "user_exception",
         "nan_loss", "hang_stuck_rank", "slow_storage", "seq_surge")
JOB_WIDE = {"user_exception", "nan_loss", "slow_storage", "seq_surge"}
EXPECTED_ACTION = {"gpu_lost": "evict_nodes", "ecc_uncorrectable": "evict_nodes", "row_remap_failure": "evict_nodes",
                   "nvlink_error": "evict_nodes", "ib_link_persistent": "evict_nodes", "ib_flap_transient": "none",
                   "pcie_degradation": "evict_nodes", "thermal_throttle": "evict_nodes", "host_oom": "restart_job",
                   "hung_task": "run_diagnostics", "user_exception": "rollback_code", "nan_loss": "run_diagnostics",
                   "hang_stuck_rank": "evict_nodes", "slow_storage": "notify", "seq_surge": "none"}
COEF = (0.35, 2.0e-5, 2.2e-9, 0.0005)
T0 = 1_700_000_000.0


@dataclass
class Scenario:
    records: list[Any]
    topology: Topology
    truth: dict[str, Any]


def _pack(rng: np.random.Generator, tokens: int, context: int, mean_len: float) -> tuple[int, int, int]:
    mu = np.log(mean_len) - 0.5
    lens = np.clip(rng.lognormal(mu, 1.0, size=int(3 * tokens / mean_len) + 16), 16, context).astype(np.int64)
    cum = np.cumsum(lens)
    k = int(np.searchsorted(cum, tokens))
    lens = lens[: k + 1].copy()
    lens[-1] -= int(cum[k] - tokens)
    lens = lens[lens > 0]
    return len(lens), int(lens.sum()), int((lens * lens).sum())


def _kline(ts: float, node: str, kind: str, raw: str, **kw: Any) -> KernelEvent:
    return KernelEvent(ts=ts, node=node, kind=kind, raw=raw, message=raw, **kw)


def _nline(ts: float, node: str, kind: str, raw: str, rank: int | None = None, **kw: Any) -> NcclEvent:
    return NcclEvent(ts=ts, node=node, kind=kind, raw=raw, message=raw, rank=rank, **kw)


def scenario(kind: str, *, nodes: int = 8, seed: int = 0, duration_s: float = 1200.0,
             onset_s: float = 500.0, gpu_interval_s: float = 5.0) -> Scenario:
    """One job, one fault of ``kind`` (or none), as records sorted by time."""
    rng = np.random.default_rng(seed)
    pp = 2
    topo = Topology.packed(tp=8, pp=pp, dp=nodes * 8 // (8 * pp), job=f"job-{kind}-{seed}")
    names = topo.nodes
    culprit = names[int(rng.integers(len(names)))] if kind not in JOB_WIDE and kind != "healthy" else None
    gpu = int(rng.integers(8))
    onset = T0 + onset_s
    end = T0 + duration_s
    recs: list[Any] = []
    slowdown = float(rng.uniform(0.12, 0.4)) if kind in ("thermal_throttle", "pcie_degradation") else None
    stop_ts = {  # job stalls (every rank stops reporting steps) at this time
        "gpu_lost": onset, "ecc_uncorrectable": onset + 3, "row_remap_failure": onset + 3, "nvlink_error": onset + 5,
        "ib_link_persistent": onset + 20, "host_oom": onset, "hung_task": onset, "user_exception": onset + 1,
        "hang_stuck_rank": onset}.get(kind, end + 1)
    hang = kind in ("gpu_lost", "host_oom", "hung_task", "hang_stuck_rank", "ib_link_persistent", "nvlink_error")
    bus = f"0000:{0x18 + 0x10 * gpu:02x}:00"

    # ---- steps
    world = topo.world_size
    coords = [topo.coords(r) for r in range(world)]
    stage = np.array([1.0 + 0.08 * c["pp"] for c in coords])
    slow = np.array([topo.node_of(r) == culprit for r in range(world)])
    a, b, c, d = COEF
    ts, step = T0, 0
    while ts < min(end, stop_ts):
        mean_len = 4900.0 if kind == "seq_surge" and ts >= onset else 700.0
        work = [_pack(rng, 65_536, 8192, mean_len) for _ in range(topo.dp)]
        w = np.array([work[co["dp"]] for co in coords], dtype=float)
        comp = (a + b * w[:, 1] + c * w[:, 2] + d * w[:, 0]) * stage * rng.lognormal(0, 0.015, world)
        if slowdown is not None and ts >= onset:
            comp[slow] *= 1 + slowdown
        extra = float(rng.uniform(0.6, 1.2)) if kind == "slow_storage" and ts >= onset else 0.0
        dur = float(comp.max()) + 0.25 * rng.lognormal(0, 0.03) + extra
        ts += dur
        nan = kind == "nan_loss" and ts >= onset
        loss = float("nan") if nan else 2.0 + rng.normal(0, 0.01)
        for r in range(world):
            co = coords[r]
            recs.append(StepTiming(
                ts=ts, job=topo.job, rank=r, node=topo.node_of(r), step=step, duration_s=dur, n_seqs=int(w[r, 0]),
                sum_len=int(w[r, 1]), sum_len_sq=int(w[r, 2]), tokens=int(w[r, 1]), loss=loss,
                fwd_s=float(comp[r]) / 3, bwd_s=float(comp[r]) * 2 / 3, comm_s=dur - extra - float(comp[r]),
                tp=co["tp"], pp=co["pp"], dp=co["dp"], cp=co["cp"]))
        step += 1

    # ---- NVML
    counters = {"dbe": 0, "sbe": 0, "replay": 0, "nvlink": 0, "retired": 0}
    t = T0
    while t < end:
        after = t >= onset
        stalled = t >= stop_ts
        for node in names:
            states = []
            for g in range(8):
                hit = node == culprit and g == gpu and after
                temp = 62.0 + rng.normal(0, 1.0)
                clock = 1980.0 - abs(rng.normal(0, 10.0))
                power = 650.0 + rng.normal(0, 15.0)
                util = min(100.0, 97.0 + rng.normal(0, 1.0))
                throttle, lost, remap_fail = 0, False, False
                if stalled and hang:  # ranks wait in a collective: busy-spinning, little power
                    power = 160.0 + rng.normal(0, 10.0)
                    if kind == "hang_stuck_rank" and node == culprit:
                        power = 640.0 + rng.normal(0, 15.0)  # the stuck rank's kernel still burns
                if stalled and not hang:  # the job crashed: idle GPUs
                    util, power = 0.0, 90.0 + rng.normal(0, 5.0)
                if hit and kind == "thermal_throttle":
                    temp, clock, power, throttle = temp + 22.0, clock - 450.0, power - 120.0, 0x40
                if hit and kind == "pcie_degradation":
                    counters["replay"] += int(rng.integers(20, 200))
                if hit and kind == "nvlink_error":
                    counters["nvlink"] += int(rng.integers(5, 50))
                if hit and kind == "gpu_lost":
                    lost = True
                if hit and kind == "row_remap_failure":
                    remap_fail = True
                if hit and kind == "ecc_uncorrectable" and counters["dbe"] == 0:
                    counters["dbe"], counters["retired"] = 1, 1
                mine = node == culprit and g == gpu
                states.append(GpuState(
                    index=g, uuid=f"GPU-{node}-{g}", pci_bus=f"0000:{0x18 + 0x10 * g:02x}:00.0", util=util,
                    temp_c=temp, power_w=power, sm_clock_mhz=clock, throttle_reasons=throttle,
                    ecc_dbe=counters["dbe"] if mine else 0, retired_pages=counters["retired"] if mine else 0,
                    pcie_replay=counters["replay"] if mine else 0, nvlink_errors=counters["nvlink"] if mine else 0,
                    remap_failure=remap_fail, lost=lost))
            recs.append(GpuSample(ts=t, node=node, gpus=states, job=topo.job))
        t += gpu_interval_s

    # ---- kernel / NCCL lines
    pid = int(rng.integers(2000, 60000))
    others = [n for n in names if n != culprit]
    timeout_ts = onset + 600.0
    if kind == "gpu_lost":
        recs.append(_kline(onset, culprit, "xid", f"NVRM: Xid (PCI:{bus}): 79, pid={pid}, name=python, GPU has fallen off the bus.", xid=79, gpu=gpu))
        recs.append(_kline(onset + 0.1, culprit, "fell_off_bus", f"NVRM: GPU {bus}.0: GPU has fallen off the bus."))
    elif kind == "ecc_uncorrectable":
        x = int(rng.choice([48, 94, 95]))
        recs.append(_kline(onset, culprit, "xid", f"NVRM: Xid (PCI:{bus}): {x}, pid={pid}, name=python, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 7, subpartition 0.", xid=x, gpu=gpu))
    elif kind == "row_remap_failure":
        x = int(rng.choice([63, 64]))
        recs.append(_kline(onset, culprit, "xid", f"NVRM: Xid (PCI:{bus}): {x}, pid={pid}, name=python, Row Remapper Error: failed to remap row.", xid=x, gpu=gpu))
    elif kind == "nvlink_error":
        recs.append(_kline(onset, culprit, "xid", f"NVRM: Xid (PCI:{bus}): 74, pid={pid}, name=python, NVLink: fatal error detected on link 6(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)", xid=74, gpu=gpu))
        recs.append(_nline(onset + 4, culprit, "nccl_warn", f"{culprit}:{pid}:{pid + 7} [{gpu}] NCCL WARN NET/IB : Got completion from peer with error 12"))
    elif kind in ("ib_link_persistent", "ib_flap_transient"):
        repeats = 4 if kind == "ib_link_persistent" else 1
        for i in range(repeats):
            tt = onset + 120.0 * i
            recs.append(_kline(tt, culprit, "ib_link_down", f"mlx5_core 0000:{0x0c + gpu:02x}:00.0: mlx5_port_module_event:1156:(pid 0): Port module event: module 0, Cable unplugged / Link down"))
            if kind == "ib_flap_transient":
                recs.append(_kline(tt + 4, culprit, "ib_link_up", f"mlx5_core 0000:{0x0c + gpu:02x}:00.0 ibp12s0: Link up"))
        if kind == "ib_link_persistent":
            for i in range(6):
                recs.append(_nline(onset + 20 + i, culprit, "ib_completion_error", f"{culprit}:{pid}:{pid + 3} [{gpu}] NCCL WARN NET/IB : Got completion from peer 10.0.0.{i + 2}<5432> with status=IBV_WC_RETRY_EXC_ERR(12) opcode=0 len=0 vendor err 129 (Send)"))
    elif kind == "pcie_degradation":
        for i in range(3):
            recs.append(_kline(onset + 60.0 * i, culprit, "pcie_aer", f"pcieport 0000:{0x10 + gpu:02x}:01.0: AER: Corrected error received: 0000:{0x18 + 0x10 * gpu:02x}:00.0"))
    elif kind == "host_oom":
        recs.append(_kline(onset, culprit, "oom_kill", f"Out of memory: Killed process {pid} (python) total-vm:812345678kB, anon-rss:523456789kB, file-rss:0kB, shmem-rss:0kB, UID:1000 pgtables:1234567kB oom_score_adj:0"))
    elif kind == "hung_task":
        for i in range(3):
            recs.append(_kline(onset + 120.0 * (i + 1), culprit, "hung_task", f"INFO: task python:{pid} blocked for more than {120 * (i + 1)} seconds."))
    elif kind == "user_exception":
        for r in range(0, world, 8):
            node = topo.node_of(r)
            recs.append(_nline(onset + 1, node, "traceback", f"[rank{r}]: Traceback (most recent call last):", rank=r))
            recs.append(_nline(onset + 1, node, "exception", f"[rank{r}]: RuntimeError: shape '[4, 8192, 32, 128]' is invalid for input of size 1048576", rank=r, exception="RuntimeError"))
    if hang and timeout_ts < end:
        for node in others if kind != "ib_link_persistent" else names:
            r = topo.ranks_on(node)[0]
            recs.append(_nline(timeout_ts, node, "watchdog_timeout", f"[rank{r}]:[E ProcessGroupNCCL.cpp:616] [Rank {r}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=81234, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600012 milliseconds before timing out.", rank=r, op_type="ALLREDUCE", timeout_ms=600000, ran_for_ms=600012))
    recs.sort(key=lambda x: x.ts)
    faults = []
    if kind != "healthy":
        faults.append({
            "id": f"f-{kind}-{seed}", "kind": kind, "nodes": [culprit] if culprit else list(names),
            "gpus": [{"node": culprit, "gpu": gpu}] if culprit else [],
            "ranks": topo.ranks_on(culprit) if culprit else [], "onset_ts": onset,
            "end_ts": onset + 10.0 if kind == "ib_flap_transient" else None,
            "expected_action": EXPECTED_ACTION[kind], "slowdown": slowdown})
    truth = {"scenario": kind, "seed": seed, "job": topo.job, "start_ts": T0, "duration_s": duration_s,
             "nodes": nodes, "gpus_per_node": 8, "faults": faults}
    return Scenario(records=recs, topology=topo, truth=truth)


def suite(*, seed: int, sizes: tuple[int, ...] = (8,), per_kind: int = 2) -> list[Scenario]:
    """``per_kind`` scenarios of every kind, cluster sizes cycling through ``sizes``."""
    out = []
    i = 0
    for kind in KINDS:
        for _ in range(per_kind):
            out.append(scenario(kind, nodes=sizes[i % len(sizes)], seed=seed * 1000 + i))
            i += 1
    return out
