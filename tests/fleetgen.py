"""A seeded fleet of many jobs (plus nodes outside any job) as time-ordered records with fault truth.

For the scale-out tests and benchmarks/scaleout.py: ``jobs`` jobs of
``nodes_per_job`` nodes (8 GPUs each; node names carry the job so they are
unique), ``unjobbed`` nodes that no topology names, NVML samples every
``gpu_interval_s``, rank-0 step timings per job, and faults with real kernel
line shapes (the same lines tests/scengen.py uses): Xid 79 (evict at once),
Xid 48 (DBE, evict), an IB link that goes down twice within five minutes
(evict on the repeat), and a Xid 79 on a node outside any job (node-local).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from faultlens.schema import GpuSample, GpuState, JobTopology, KernelEvent, StepTiming
from faultlens.stream.topology import Topology

T0 = 1_700_000_000.0
FAULTS = ("xid79", "xid48", "ib_twice")


@dataclass
class Fleet:
    topologies: list[JobTopology]
    records: list[Any]  # time-ordered telemetry (not the topologies)
    faults: list[dict[str, Any]] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)


def topology_record(topo: Topology, ts: float) -> JobTopology:
    return JobTopology(ts=ts, job=topo.job, **{k: v for k, v in topo.to_job_dict().items() if k != "job"})


def xid_line(node: str, xid: int, ts: float) -> KernelEvent:
    if xid == 79:
        raw = "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."
    else:
        raw = (f"NVRM: Xid (PCI:0000:3b:00): {xid}, pid=4242, name=python, An uncorrectable double bit error (DBE) "
               "has been detected on GPU in the framebuffer at partition 7, subpartition 0.")
    return KernelEvent(ts=ts, node=node, kind="xid", xid=xid, gpu=3, raw=raw)


def ib_down(node: str, ts: float) -> KernelEvent:
    return KernelEvent(ts=ts, node=node, kind="ib_link_down",
                       raw="mlx5_core 0000:0c:00.0: mlx5_port_module_event:1156:(pid 0): Port module event: "
                           "module 0, Cable unplugged / Link down")


def _gpus(rng: random.Random) -> list[GpuState]:
    return [GpuState(index=g, util=95.0 + rng.random() * 4, temp_c=60.0 + rng.random() * 5, power_w=650.0,
                     sm_clock_mhz=1980.0, mem_clock_mhz=2619.0) for g in range(8)]


def fleet(*, jobs: int, nodes_per_job: int, unjobbed: int = 2, duration_s: float = 120.0, gpu_interval_s: float = 5.0,
          faulty_jobs: int | None = None, seed: int = 0, t0: float = T0, fault_at_s: float = 30.0) -> Fleet:
    """The fleet's records sorted by time; faults on the first ``faulty_jobs`` jobs (all kinds in turn)."""
    rng = random.Random(seed)
    topos = [Topology.packed(tp=8, pp=1, dp=nodes_per_job, gpus_per_node=8, job=f"job{j:04d}",
                             node_fmt=f"j{j:04d}n{{:02d}}") for j in range(jobs)]
    spare = [f"spare{i:03d}" for i in range(unjobbed)]
    nodes = [n for t in topos for n in t.nodes] + spare
    recs: list[Any] = []
    steps = int(duration_s / gpu_interval_s)
    for k in range(steps):
        ts = t0 + k * gpu_interval_s
        gpus = _gpus(rng)
        for i, n in enumerate(nodes):
            recs.append(GpuSample(ts=ts + (i % 97) * 1e-3, node=n, gpus=gpus))
        for t in topos:
            recs.append(StepTiming(ts=ts + 0.5, job=t.job, rank=0, node=t.nodes[0], step=k, duration_s=gpu_interval_s))
    faults = []
    n_faulty = jobs if faulty_jobs is None else faulty_jobs
    for j in range(n_faulty):
        kind = FAULTS[j % len(FAULTS)]
        t = topos[j]
        node = t.nodes[(j * 7) % len(t.nodes)]
        at = t0 + fault_at_s + (j % 10)
        if kind == "xid79":
            recs.append(xid_line(node, 79, at))
        elif kind == "xid48":
            recs.append(xid_line(node, 48, at))
        else:
            recs.append(ib_down(node, at))
            recs.append(ib_down(node, at + 40.0))
        faults.append({"job": t.job, "node": node, "kind": kind, "ts": at, "action": "evict_nodes"})
    if spare:
        recs.append(xid_line(spare[0], 79, t0 + fault_at_s + 5))
        faults.append({"job": "unknown", "node": spare[0], "kind": "xid79", "ts": t0 + fault_at_s + 5,
                       "action": "evict_nodes"})
    recs.sort(key=lambda r: r.ts)
    return Fleet([topology_record(t, t0 - 10) for t in topos], recs, faults, nodes)
