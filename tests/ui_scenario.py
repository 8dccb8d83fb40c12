"""A small, realistic lake for the explorer's and report's tests.

One job ``j-xid79`` on 4 nodes x 8 GPUs (tp=8, pp=2, dp=2) trains for 40
minutes; then GPU 5 of n003 falls off the bus (Xid 79), the other ranks' NCCL
watchdogs time out 10 minutes later, diagnosis opens an incident naming n003 and
asks to evict it, the dry-run runner answers, and training resumes on n005 at
minute 52 until minute 60. GPU 3 of n002 logs double-bit ECC errors in two
separate minutes (an RMA candidate that never stopped the job). Records are the stream schema's own dataclasses,
written with the stream part's LakeWriter, with the rollups the processor
would add (LAKE/<table>/date=YYYY-MM-DD/hour=HH/*.parquet).
"""

from __future__ import annotations

import datetime as dt
import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from faultlens import schema
from faultlens.schema import (
    Action,
    ActionStatus,
    GpuSample,
    GpuState,
    Incident,
    JobTopology,
    KernelEvent,
    NcclEvent,
    StackDump,
    StepTiming,
    lake_schema,
)
from faultlens.stream.catalog import gpu_rollup_partial, steps_rollup_partial
from faultlens.stream.lake import LakeWriter
from faultlens.stream.topology import Topology

T0 = dt.datetime(2025, 3, 3, 9, 0, tzinfo=dt.UTC).timestamp()
JOB = "j-xid79"
CULPRIT = "n003"
CULPRIT_GPU = 5
CULPRIT_PCI = "0000:9d:00"
INCIDENT_ID = "inc-j-xid79-0001"
ACTION_ID = "act-j-xid79-0001"
FAULT_TS = T0 + 40 * 60
RESUME_TS = T0 + 52 * 60
END_TS = T0 + 60 * 60
DBE_GPU = ("n002", 3)
DBE_TS = (T0 + 20 * 60 + 25, T0 + 30 * 60 + 25)
XID_LINE = (f"[ 2400.118437] NVRM: Xid (PCI:{CULPRIT_PCI}): 79, pid=48213, name=python, "
            "GPU has fallen off the bus.")
BUS_LINE = f"[ 2400.118502] NVRM: GPU {CULPRIT_PCI}.0: GPU has fallen off the bus."


@dataclass(frozen=True)
class ScenarioLake:
    path: Path
    job: str = JOB
    culprit: str = CULPRIT
    incident_id: str = INCIDENT_ID
    action_id: str = ACTION_ID


def write_records(lake: Path, records: list[Any]) -> None:
    """Write records with the stream part's LakeWriter, plus the per-minute rollups
    the stream processor would have written for the gpu and steps rows."""
    writer = LakeWriter(lake)
    by_kind: dict[str, list[Any]] = defaultdict(list)
    for r in records:
        by_kind[type(r).KIND].append(r)
    for kind, recs in by_kind.items():
        paths = writer.write(kind, recs)
        if kind in ("gpu", "steps"):
            table = pa.concat_tables(pq.read_table(p, schema=lake_schema(kind)) for p in paths)
            partial = gpu_rollup_partial(table) if kind == "gpu" else steps_rollup_partial(table)
            writer.write_table(f"{kind}_1m", partial)


def _stack(frames: list[str], pid: int) -> str:
    body = "\n".join(f"    {f}" for f in frames)
    return (f"Process {pid}: /usr/bin/python3 -u pretrain_gpt.py --tensor-model-parallel-size 8\n"
            f"Python v3.10.12 (/usr/bin/python3.10)\n\nThread {pid} (active): \"MainThread\"\n{body}\n")


HEALTHY_STACK = [
    "all_reduce (torch/distributed/distributed_c10d.py:2050)",
    "reduce_gradients (megatron/core/distributed/grad_buffer.py:212)",
    "train_step (megatron/training.py:540)",
    "train (megatron/training.py:904)",
    "pretrain (megatron/training.py:188)",
    "<module> (pretrain_gpt.py:249)",
]
CULPRIT_STACK = [
    "synchronize (torch/cuda/__init__.py:801)",
    "forward_step (megatron/schedules.py:118)",
    "train_step (megatron/training.py:521)",
    "train (megatron/training.py:904)",
    "pretrain (megatron/training.py:188)",
    "<module> (pretrain_gpt.py:249)",
]


def build_lake(lake: Path, *, gpu_interval_s: float = 10.0, seed: int = 7) -> ScenarioLake:
    """Write the scenario's lake under ``lake`` and return what tests assert on."""
    rng = random.Random(seed)
    before = Topology.packed(8, 2, 2, job=JOB)
    after_placement = {r: (("n005" if n == CULPRIT else n), g) for r, (n, g) in before.placement.items()}
    after = Topology(tp=8, pp=2, dp=2, placement=after_placement, job=JOB)
    records: list[Any] = [
        JobTopology(ts=T0, job=JOB, tp=8, pp=2, dp=2, ranks=before.to_job_dict()["ranks"]),
        JobTopology(ts=RESUME_TS - 30, job=JOB, tp=8, pp=2, dp=2, ranks=after.to_job_dict()["ranks"]),
    ]
    # steps: every rank, every step_s, with a workload that varies (long batches are slower)
    step = 0
    t = T0
    while t < END_TS:
        if FAULT_TS <= t < RESUME_TS:
            t = RESUME_TS
            continue
        topo = before if t < FAULT_TS else after
        n_seqs = rng.randint(6, 10)
        lens = [rng.randint(512, 4096) for _ in range(n_seqs)]
        sum_len, sum_len_sq = sum(lens), sum(x * x for x in lens)
        duration = 1.2 + sum_len * 5e-5 + sum_len_sq * 4e-9
        for rank, (node, _) in topo.placement.items():
            records.append(StepTiming(
                ts=t + duration, job=JOB, rank=rank, node=node, step=step,
                duration_s=duration * rng.uniform(0.98, 1.03), n_seqs=n_seqs, sum_len=sum_len,
                sum_len_sq=sum_len_sq, tokens=sum_len, loss=2.5 - step * 1e-4, **topo.coords(rank)))
        step += 1
        t += duration  # steps run back to back
    # GPU samples: temperatures, clocks; the culprit GPU vanishes at the fault
    nodes = ["n001", "n002", "n003", "n004", "n005"]
    t = T0
    while t < END_TS:
        for node in nodes:
            if node == "n005" and t < RESUME_TS - 60:
                continue
            if node == CULPRIT and t >= RESUME_TS:
                continue
            gpus = []
            for g in range(8):
                lost = node == CULPRIT and g == CULPRIT_GPU and t >= FAULT_TS
                # an RMA candidate: double-bit ECC errors in two separate minutes
                dbe = (int(t >= DBE_TS[0]) + int(t >= DBE_TS[1])) if (node, g) == DBE_GPU else 0
                gpus.append(GpuState(
                    index=g, uuid=f"GPU-{node}-{g}", pci_bus=CULPRIT_PCI if (node, g) == (CULPRIT, CULPRIT_GPU) else f"0000:{16 + g:02x}:00",
                    util=0.0 if lost else rng.uniform(88, 99), temp_c=0.0 if lost else rng.uniform(55, 68),
                    power_w=0.0 if lost else rng.uniform(520, 690), sm_clock_mhz=0.0 if lost else 1980.0,
                    ecc_dbe=dbe, ecc_dbe_agg=dbe, lost=lost))
            records.append(GpuSample(ts=t, node=node, gpus=gpus, job=JOB))
        t += gpu_interval_s
    # kernel: routine lines on every node, the Xid 79 on the culprit
    for node in nodes[:4]:
        records.append(KernelEvent(ts=T0 + 5, node=node, kind="other",
                                   raw="[   12.004512] EXT4-fs (nvme0n1p2): mounted filesystem with ordered data mode."))
    records += [
        KernelEvent(ts=FAULT_TS, node=CULPRIT, kind="xid", raw=XID_LINE, xid=79, pci_bus=CULPRIT_PCI,
                    gpu=CULPRIT_GPU, pid=48213, message="GPU has fallen off the bus."),
        KernelEvent(ts=FAULT_TS + 0.1, node=CULPRIT, kind="fell_off_bus", raw=BUS_LINE, pci_bus=CULPRIT_PCI,
                    gpu=CULPRIT_GPU, message="GPU has fallen off the bus."),
    ]
    # nccl: watchdog timeouts on the other ranks 10 minutes later
    watchdog = []
    for rank in (0, 8, 16, 24):
        node = before.node_of(rank)
        raw = (f"[rank{rank}]:[E303 09:50:00.412{rank:03d}] ProcessGroupNCCL.cpp:607] [Rank {rank}] Watchdog caught "
               "collective operation timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE, NumelIn=466119168, "
               "NumelOut=466119168, Timeout(ms)=600000) ran for 600060 milliseconds before timing out.")
        watchdog.append(NcclEvent(ts=FAULT_TS + 600, node=node, kind="watchdog_timeout", raw=raw, level=None,
                                  rank=rank, job=JOB, op_type="ALLREDUCE", seq_num=1580, timeout_ms=600000,
                                  ran_for_ms=600060))
    records += watchdog
    # stacks dumped on request after the hang: the culprit rank differs
    culprit_rank = next(r for r, p in before.placement.items() if p == (CULPRIT, CULPRIT_GPU))
    for rank, (node, _) in before.placement.items():
        frames = CULPRIT_STACK if rank == culprit_rank else HEALTHY_STACK
        records.append(StackDump(ts=FAULT_TS + 60, job=JOB, node=node, rank=rank, pid=40000 + rank,
                                 text=_stack(frames, 40000 + rank), request_id="req-1"))
    suspects = [
        {"node": CULPRIT, "gpu": CULPRIT_GPU, "ranks": [culprit_rank], "score": 0.98,
         "reason": "Xid 79: GPU has fallen off the bus (GPU 5, PCI 0000:9d:00)"},
        {"node": "n004", "score": 0.05, "reason": "same pipeline stage as the lost GPU; no error of its own"},
    ]
    evidence = [
        {"ts": FAULT_TS, "source": "kernel", "node": CULPRIT, "text": XID_LINE},
        {"ts": FAULT_TS + 0.1, "source": "kernel", "node": CULPRIT, "text": BUS_LINE},
        {"ts": FAULT_TS + 5, "source": "gpu", "node": CULPRIT,
         "text": "NVML: GPU 5 lost (GpuIsLost); utilisation and power read 0", "figures": {"gpu": CULPRIT_GPU}},
        {"ts": FAULT_TS + 600, "source": "nccl", "node": "n001", "rank": 0, "text": watchdog[0].raw},
    ]
    opened = Incident(
        id=INCIDENT_ID, job=JOB, opened_ts=FAULT_TS + 2, updated_ts=FAULT_TS + 2, status="open",
        category="gpu_hardware", kind="gpu_lost", title=f"GPU fell off the bus on {CULPRIT}",
        severity="critical", confidence=0.97, suspects=suspects, evidence=evidence[:2], actions=[ACTION_ID],
        summary=f"Xid 79 on {CULPRIT} GPU {CULPRIT_GPU}: the GPU fell off the bus; evict {CULPRIT}.",
    )
    updated = schema.replace(
        opened, updated_ts=FAULT_TS + 610, evidence=evidence,
        muted=[{"item": "nccl watchdog timeouts on 4 ranks", "by_rule": "xid79_mutes_watchdog"}])
    records += [
        opened,
        updated,
        Incident(id="inc-j-xid79-0002", job=JOB, opened_ts=T0 + 15 * 60, updated_ts=T0 + 16 * 60,
                 status="resolved", category="network", kind="ib_flap_transient", severity="warning",
                 title="IB link flap on n002 (recovered)", confidence=0.6,
                 suspects=[{"node": "n002", "score": 0.4, "reason": "mlx5_2 link down then up within 20 s"}],
                 evidence=[{"ts": T0 + 15 * 60, "source": "kernel", "node": "n002",
                            "text": "mlx5_core 0000:4b:00.0 mlx5_2: Port: 1 Link DOWN"}]),
        Action(id=ACTION_ID, incident_id=INCIDENT_ID, job=JOB, ts=FAULT_TS + 3, type="evict_nodes",
               nodes=[CULPRIT], suspects=suspects[:1], evidence=evidence[:1], confidence=0.97, dry_run=True,
               reason=f"Xid 79 on {CULPRIT}: GPU fell off the bus"),
        ActionStatus(ts=FAULT_TS + 4, action_id=ACTION_ID, job=JOB, adapter="dry-run", status="dry_run",
                     detail=f"would drain {CULPRIT} and requeue {JOB}",
                     commands=[["scontrol", "update", f"NodeName={CULPRIT}", "State=DRAIN", "Reason=faultlens Xid 79"]]),
    ]
    write_records(lake, records)
    return ScenarioLake(path=lake)
