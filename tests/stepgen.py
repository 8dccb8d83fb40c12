"""A small seeded generator of StepTiming streams for model tests and benchmarks.

Not the simulator (datasets/): just enough physics to exercise the detectors.
Every data-parallel replica packs documents of log-normal length into a fixed
token budget; a rank's compute is ``a + b*tokens + c*sum_len_sq + d*n_seqs``
(times its pipeline stage's factor, a slowdown if injected, and a few percent of
noise); the step ends when the slowest rank is done plus the all-reduce, so every
other rank's ``comm_s`` is its wait. ``surge`` switches to long documents for a
stretch (sequence-length variability, no fault); ``storage`` adds input wait to
every rank's step without touching compute.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from faultlens.schema import GpuSample, GpuState, StepTiming
from faultlens.stream.topology import Topology

COEF = (0.35, 2.0e-5, 2.2e-9, 0.0005)  # a [s], b [s/token], c [s/token^2], d [s/seq]


@dataclass(frozen=True)
class Slowdown:
    node: str
    onset_step: int
    factor: float  # 0.1 = 10% slower compute
    end_step: int | None = None


@dataclass(frozen=True)
class StreamSpec:
    nodes: int = 8
    gpus_per_node: int = 8
    pp: int = 2
    steps: int = 300
    tokens: int = 65_536  # per rank per step
    context: int = 8192
    mean_doc_len: float = 700.0
    surge_every: int = 0  # every this many steps, a surge of long documents...
    surge_len: int = 0  # ...lasting this many steps
    noise: float = 0.015  # CoV of per-rank compute
    slowdown: Slowdown | None = None
    storage_onset_step: int | None = None
    storage_delay_s: float = 0.6
    comm_s: float = 0.25
    job: str = "j1"
    seed: int = 0
    step_s0: float = 1_700_000_000.0


def topology(spec: StreamSpec) -> Topology:
    world = spec.nodes * spec.gpus_per_node
    tp = spec.gpus_per_node
    dp = world // (tp * spec.pp)
    return Topology.packed(tp=tp, pp=spec.pp, dp=dp, gpus_per_node=spec.gpus_per_node, job=spec.job)


def _pack(rng: np.random.Generator, tokens: int, context: int, mean_len: float) -> tuple[int, int, int]:
    """Documents of log-normal length packed into ``tokens``: (n_seqs, sum_len, sum_len_sq)."""
    sigma = 1.0
    mu = np.log(mean_len) - sigma * sigma / 2
    lens = np.minimum(rng.lognormal(mu, sigma, size=int(3 * tokens / mean_len) + 16), context).astype(np.int64)
    lens = np.maximum(lens, 16)
    cum = np.cumsum(lens)
    k = int(np.searchsorted(cum, tokens))
    lens = lens[: k + 1].copy()
    lens[-1] -= int(cum[k] - tokens)
    lens = lens[lens > 0]
    return len(lens), int(lens.sum()), int((lens * lens).sum())


def steps(spec: StreamSpec) -> Iterator[list[StepTiming]]:
    """Yield each step's StepTimings (every rank), in rank order."""
    rng = np.random.default_rng(spec.seed)
    topo = topology(spec)
    world = topo.world_size
    coords = [topo.coords(r) for r in range(world)]
    stage_factor = np.array([1.0 + 0.08 * c["pp"] for c in coords])
    slow_mask = np.zeros(world, dtype=bool)
    if spec.slowdown is not None:
        slow_mask[topo.ranks_on(spec.slowdown.node)] = True
    a, b, c, d = COEF
    ts = spec.step_s0
    for step in range(spec.steps):
        surge = spec.surge_every and (step % spec.surge_every) < spec.surge_len and step >= spec.surge_every
        mean_len = spec.context * 0.6 if surge else spec.mean_doc_len
        work = [_pack(rng, spec.tokens, spec.context, mean_len) for _ in range(topo.dp)]
        w = np.array([work[co["dp"]] for co in coords], dtype=float)  # n_seqs, sum_len, sum_len_sq
        comp = (a + b * w[:, 1] + c * w[:, 2] + d * w[:, 0]) * stage_factor
        comp *= rng.lognormal(0.0, spec.noise, size=world)
        sd = spec.slowdown
        if sd is not None and step >= sd.onset_step and (sd.end_step is None or step < sd.end_step):
            comp[slow_mask] *= 1.0 + sd.factor
        allreduce = spec.comm_s * rng.lognormal(0.0, 0.03)
        extra = spec.storage_delay_s if spec.storage_onset_step is not None and step >= spec.storage_onset_step else 0.0
        duration = float(comp.max()) + allreduce + extra
        ts += duration
        out = []
        for r in range(world):
            node, _ = topo.placement[r]
            co = coords[r]
            out.append(StepTiming(
                ts=ts, job=spec.job, rank=r, node=node, step=step, duration_s=duration,
                n_seqs=int(w[r, 0]), sum_len=int(w[r, 1]), sum_len_sq=int(w[r, 2]), tokens=int(w[r, 1]),
                fwd_s=float(comp[r]) / 3, bwd_s=float(comp[r]) * 2 / 3, comm_s=duration - extra - float(comp[r]),
                tp=co["tp"], pp=co["pp"], dp=co["dp"], cp=co["cp"]))
        yield out


# --------------------------------------------------------------------------- NVML samples

@dataclass(frozen=True)
class GpuFault:
    node: str
    gpu: int
    onset_s: float
    end_s: float | None = None
    kind: str = "thermal"  # thermal: hot, clock down, HW thermal throttle bit; ecc: DBE counter climbs


def gpu_samples(*, nodes: int = 8, gpus: int = 8, seconds: int = 900, interval_s: float = 1.0,
                fault: GpuFault | None = None, seed: int = 0, t0: float = 1_700_000_000.0,
                job: str = "j1") -> Iterator[GpuSample]:
    """1 Hz NVML samples of a job's machines running a healthy, balanced workload (plus one fault)."""
    rng = np.random.default_rng(seed)
    names = [f"n{i + 1:03d}" for i in range(nodes)]
    dbe = 0
    for k in range(int(seconds / interval_s)):
        t = k * interval_s
        for node in names:
            states = []
            for g in range(gpus):
                temp = 62.0 + rng.normal(0, 1.0)
                clock = 1980.0 - abs(rng.normal(0, 10.0))
                power = 650.0 + rng.normal(0, 15.0)
                util = 97.0 + rng.normal(0, 1.0)
                throttle = 0
                active = fault is not None and fault.node == node and fault.gpu == g and t >= fault.onset_s and (
                    fault.end_s is None or t < fault.end_s)
                if active and fault.kind == "thermal":
                    temp += 22.0
                    clock -= 450.0
                    power -= 120.0
                    throttle = 0x40
                if active and fault.kind == "ecc" and rng.random() < 0.05:
                    dbe += 1
                states.append(GpuState(index=g, uuid=f"GPU-{node}-{g}", util=min(util, 100.0), temp_c=temp,
                                       power_w=power, sm_clock_mhz=clock, throttle_reasons=throttle,
                                       ecc_dbe=dbe if active else 0))
            yield GpuSample(ts=t0 + t, node=node, gpus=states, job=job)
