"""A seeded scenario: a training job on a simulated cluster, faults injected, every signal rendered.

``Scenario(spec)`` is lazy: the job's step timeline, the faults' effects and
each signal are computed on first use and cached. Outputs:

* ``write_batch_dir(scenario, out_dir)``: DESIGN.md's batch directory plus
  truth.json inside it;
* ``Scenario.events(since_ts, until_ts)``: every record in time order as
  ``Event(ts, node, source, path, payload)`` for live streaming;
  ``LiveWriter`` appends them to the batch-directory files as simulated time
  advances (the same bytes as ``write_batch_dir`` once it reaches the end);
* ``Scenario.gpu_states(node, ts)`` / ``nvml_events(node)`` behind
  ``datasets.nvml_sim.SimulatedNvml``.

The same spec (seed included) always gives the same bytes. One module (~600 lines) on
purpose: every signal is rendered from one cached timeline, and splitting the renderers
would pass that cache between modules.
"""

from __future__ import annotations

import heapq
import math
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np
import orjson

from faultlens.collectors.nvml_backend import NvmlEvent
from faultlens.datasets import signal_gpu, signal_kernel, signal_nccl, signal_stacks
from faultlens.datasets.cluster import ClusterSpec
from faultlens.datasets.effects import Effects, FaultContext
from faultlens.datasets.faults import fault_class
from faultlens.datasets.steptime import CostModel, iteration_times
from faultlens.datasets.workload import WorkloadSpec, pack
from faultlens.schema import GpuState

DEFAULT_START_TS = 1763700000.0  # 2025-11-21T04:40:00Z


@dataclass(frozen=True)
class FaultSpec:
    """One fault to inject: its kind, and optionally where and when (else drawn from the seed)."""

    kind: str
    id: str = ""
    onset_s: float | None = None
    node: str | None = None
    gpu: int | None = None
    params: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FaultSpec:
        return cls(kind=d["kind"], id=d.get("id", ""), onset_s=d.get("onset_s"), node=d.get("node"),
                   gpu=d.get("gpu"), params=dict(d.get("params", {})))


@dataclass(frozen=True)
class ScenarioSpec:
    name: str = "scenario"
    seed: int = 0
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    duration_s: float = 600.0
    start_ts: float = DEFAULT_START_TS
    faults: tuple[FaultSpec, ...] = ()
    plans: tuple[tuple[float, Mapping[str, Any]], ...] = ()  # (seconds after start, plan)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    cost: CostModel = field(default_factory=CostModel)
    watchdog_timeout_s: float | None = None  # None: 600 s, scaled down for short scenarios
    startup_s: float = 20.0
    sample_interval_s: float = 1.0
    step_noise: float = 0.01
    kernel_format: str | None = None  # None: each node draws dmesg / iso / syslog
    kernel_noise_per_hour: float = 12.0

    @property
    def timeout_s(self) -> float:
        if self.watchdog_timeout_s is not None:
            return float(self.watchdog_timeout_s)
        return float(min(600.0, max(60.0, round(self.duration_s * 0.45 / 10.0) * 10.0)))


class Event(NamedTuple):
    ts: float
    node: str
    source: str  # gpu | kernel | nccl | steps | stacks
    path: str  # the batch-directory file it belongs to
    payload: str  # the text appended to that file (no trailing newline)


@dataclass
class _Steps:
    start: np.ndarray  # (S,)
    end: np.ndarray
    duration: np.ndarray
    data_wait: np.ndarray
    compute: np.ndarray  # (S, world); 0 for excluded ranks
    excluded: np.ndarray  # (S, world) bool
    workload: dict[str, np.ndarray]  # name -> (S, dp)
    replica_of: np.ndarray  # (world,)


def _seed(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _plan_key(plan: Mapping[str, Any] | None) -> bytes:
    return orjson.dumps(plan or {}, option=orjson.OPT_SORT_KEYS)


class Scenario:
    """One simulated run. Construct from a spec; everything else is computed on demand."""

    def __init__(self, spec: ScenarioSpec):
        self.spec = spec
        self._plans: list[tuple[float, Mapping[str, Any]]] = sorted(
            ((spec.start_ts + t, p) for t, p in spec.plans), key=lambda x: x[0])

    # ------------------------------------------------------------------ set-up
    @property
    def cluster(self) -> ClusterSpec:
        return self.spec.cluster

    @property
    def topology(self):  # noqa: ANN201 - faultlens.stream.topology.Topology
        return self.spec.cluster.topology

    @property
    def start_ts(self) -> float:
        return self.spec.start_ts

    @property
    def end_ts(self) -> float:
        return self.spec.start_ts + self.spec.duration_s

    @property
    def train_start_ts(self) -> float:
        return self.spec.start_ts + self.spec.startup_s

    def apply_plan(self, t: float, plan: Mapping[str, Any]) -> None:
        """From simulated time ``t`` (epoch seconds) on, steps follow ``plan`` (see steptime)."""
        self._plans.append((float(t), dict(plan)))
        self._plans.sort(key=lambda x: x[0])
        for name in ("steps", "_step_extras"):
            self.__dict__.pop(name, None)

    @cached_property
    def procs(self) -> dict[int, signal_nccl.RankProc]:
        rng = _seed(self.spec.seed, "procs")
        base = {n: int(rng.integers(100_000, 3_900_000)) for n in self.cluster.node_names}
        topo = self.topology
        return {r: signal_nccl.RankProc(rank=r, node=n, gpu=g, pid=base[n] + 17 * g, world=topo.world_size,
                                        ip=self.cluster.node_ip(n))
                for r, (n, g) in sorted(topo.placement.items())}

    @cached_property
    def _faults(self) -> tuple[Effects, list[dict[str, Any]]]:
        fx = Effects()
        truths = []
        for i, fs in enumerate(self.spec.faults):
            cls = fault_class(fs.kind)
            fid = fs.id or f"f{i + 1}"
            fault = cls(id=fid, onset_s=fs.onset_s, node=fs.node, gpu=fs.gpu, params=dict(fs.params))
            ctx = FaultContext(self.cluster, self.start_ts, self.spec.duration_s, self.train_start_ts,
                               self.spec.timeout_s, _seed(self.spec.seed, f"fault:{fid}:{fs.kind}"), self.procs, fx)
            truths.append(fault.inject(ctx))
        return fx, truths

    @property
    def effects(self) -> Effects:
        return self._faults[0]

    def truth(self) -> dict[str, Any]:
        """The truth.json object (common brief's format)."""
        return {"scenario": self.spec.name, "seed": self.spec.seed, "job": self.cluster.job,
                "start_ts": self.start_ts, "duration_s": self.spec.duration_s, "nodes": self.cluster.nodes,
                "gpus_per_node": self.cluster.gpus_per_node, "faults": self._faults[1]}

    # ------------------------------------------------------------------ step timeline
    def _speed_at(self, t: float) -> tuple[int, ...]:
        return tuple(i for i, (_, _, t0, t1) in enumerate(self.effects.slow) if t0 <= t < t1)

    def _plan_at(self, t: float) -> Mapping[str, Any] | None:
        plan = None
        for tp, p in self._plans:
            if tp <= t:
                plan = p
        return plan

    def _surge_at(self, t: float) -> int:
        for i, (t0, t1, _) in enumerate(self.effects.surges):
            if t0 <= t < t1:
                return i
        return -1

    @cached_property
    def steps(self) -> _Steps:
        spec, cl, fx = self.spec, self.cluster, self.effects
        topo = self.topology
        world, dp = topo.world_size, topo.dp
        n_mb = dp * cl.microbatches
        rng = _seed(spec.seed, "workload")
        noise_rng = _seed(spec.seed, "step-noise")
        stop = fx.stop_ts if fx.stop_ts is not None else math.inf
        chunk = 128
        starts, ends, durs, waits, comps, excl = [], [], [], [], [], []
        wl: dict[str, list[np.ndarray]] = {k: [] for k in ("n_seqs", "sum_len", "sum_len_sq", "tokens")}
        t = self.train_start_ts
        done = False
        while not done:
            normal = pack(rng, chunk * n_mb, spec.workload).reshape(chunk, n_mb)
            surge = [pack(rng, chunk * n_mb, spec.workload, m).reshape(chunk, n_mb) for _, _, m in fx.surges]
            noise = np.exp(noise_rng.normal(0.0, spec.step_noise, chunk))
            cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
            for k in range(chunk):
                s_idx, speed_key, plan = self._surge_at(t), self._speed_at(t), self._plan_at(t)
                mbs = surge[s_idx] if s_idx >= 0 else normal
                key = (s_idx, speed_key, _plan_key(plan))
                if key not in cache:
                    speed = np.ones(world)
                    for i in speed_key:
                        speed[fx.slow[i][0]] *= fx.slow[i][1]
                    costs = spec.cost.microbatch_cost(mbs.tokens, mbs.sum_len_sq)
                    cache[key] = iteration_times(topo, speed, plan, costs, sync_s=spec.cost.sync_s)
                it = float(cache[key][0][k]) * float(noise[k])
                wait = sum(extra * it for t0, t1, extra in fx.step_delay if t0 <= t < t1)
                hic = sum(extra for th, extra in fx.hiccups if t <= th < t + it + wait)
                dur = it + wait + hic
                if t + dur > stop or t + dur > self.end_ts:
                    done = True
                    break
                starts.append(t)
                ends.append(t + dur)
                durs.append(dur)
                waits.append(wait)
                comps.append(cache[key][1][k])
                ex = np.zeros(world, dtype=bool)
                ex[[int(r) for r in (plan or {}).get("tp_excluded_gpus", ())]] = True
                excl.append(ex)
                bounds = np.concatenate([[0], np.cumsum((plan or {}).get("microbatches_per_replica")
                                                        or [cl.microbatches] * dp)])
                for name in wl:
                    row = np.concatenate([[0], np.cumsum(getattr(mbs, name)[k])])
                    wl[name].append(row[bounds[1:]] - row[bounds[:-1]])
                t += dur
        s = len(starts)
        coords = [topo.coords(r) for r in range(world)]
        return _Steps(
            start=np.array(starts), end=np.array(ends), duration=np.array(durs), data_wait=np.array(waits),
            compute=np.array(comps).reshape(s, world), excluded=np.array(excl).reshape(s, world),
            workload={k: np.array(v, dtype=np.int64).reshape(s, dp) for k, v in wl.items()},
            replica_of=np.array([c["dp"] for c in coords]),
        )

    def _loss(self) -> tuple[list[str], list[str]]:
        st = self.steps
        rng = _seed(self.spec.seed, "loss")
        n = len(st.end)
        idx = np.arange(n)
        loss = 2.1 + 1.6 * np.exp(-idx / 400.0) + rng.normal(0, 0.02, n)
        gnorm = np.abs(0.25 + rng.normal(0, 0.03, n))
        nan_from = self.effects.nan_from
        loss_s = [f"{x:.6f}" for x in loss]
        gn_s = [f"{x:.6f}" for x in gnorm]
        if nan_from is not None:
            first = int(np.searchsorted(st.end, nan_from))
            for i in range(max(0, first - 3), min(first, n)):
                gn_s[i] = f"{gnorm[i] * (6 + 4 * (i - first + 3)):.6f}"
            for i in range(first, n):
                loss_s[i] = "null"  # JSON has no NaN: StepReporter writes a non-finite loss as null
                gn_s[i] = "null"
        return loss_s, gn_s

    # ------------------------------------------------------------------ signals
    @cached_property
    def _step_extras(self) -> tuple[list[str], list[str], np.ndarray, np.ndarray]:
        st = self.steps
        rng = _seed(self.spec.seed, "step-jitter")
        n, world = len(st.end), self.topology.world_size
        loss_s, gn_s = self._loss() if n else ([], [])
        return loss_s, gn_s, rng.uniform(0.0005, 0.004, (n, world)), rng.normal(1.0, 0.004, (n, world))

    def step_lines(self, node: str) -> list[tuple[float, str]]:
        """[(ts, line)] of the StepReporter lines of the node's ranks, in time order."""
        st, topo, job = self.steps, self.topology, self.cluster.job
        n = len(st.end)
        lines: list[tuple[float, str]] = []
        if n == 0:
            return lines
        loss_s, gn_s, jitter, split = self._step_extras
        for r in topo.ranks_on(node):
            c = topo.coords(r)
            d = c["dp"]
            head = '{"v":1,"ts":%s,"job":' + orjson.dumps(job).decode() + ',"rank":' + str(r) + ',"node":' + \
                orjson.dumps(node).decode() + ',"step":%d,"duration_s":%.6f,"n_seqs":%d,"sum_len":%d,' \
                '"sum_len_sq":%d,"tokens":%d,"loss":%s,"grad_norm":%s,"fwd_s":%.6f,"bwd_s":%.6f,"comm_s":%.6f,' + \
                f'"tp":{c["tp"]},"pp":{c["pp"]},"dp":{d},"cp":{c["cp"]}' + '}'
            ts = st.end + jitter[:, r]
            comp = st.compute[:, r] * split[:, r]
            comm = np.maximum(st.duration - comp - st.data_wait, 0.0)
            wl = st.workload
            rows = zip(ts.tolist(), range(1, n + 1), st.duration.tolist(), wl["n_seqs"][:, d].tolist(),
                       wl["sum_len"][:, d].tolist(), wl["sum_len_sq"][:, d].tolist(), wl["tokens"][:, d].tolist(),
                       loss_s, gn_s, (comp / 3).tolist(), (comp * 2 / 3).tolist(), comm.tolist(),
                       st.excluded[:, r].tolist(), strict=True)
            for tsv, step, dur, ns, sl, sq, tok, lo, gn, fw, bw, cm, ex in rows:
                if not ex:
                    lines.append((tsv, head % (f"{tsv:.6f}", step, dur, ns, sl, sq, tok, lo, gn, fw, bw, cm)))
        lines.sort(key=lambda x: x[0])
        return lines

    @cached_property
    def sample_ts(self) -> np.ndarray:
        n = int(self.spec.duration_s / self.spec.sample_interval_s)
        return self.start_ts + np.arange(n) * self.spec.sample_interval_s

    def _node_phase(self, node: str) -> float:
        return (zlib.crc32(node.encode()) % 1000) / 1000.0 * self.spec.sample_interval_s

    def gpu_columns(self, node: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(sample timestamps, field -> (samples, gpus) array) of one node."""
        return self._gpu_columns(node)

    def _gpu_columns(self, node: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        cache = self.__dict__.setdefault("_gpu_cache", {})
        if node in cache:
            return cache[node]
        while len(cache) >= 4:  # a few nodes only: an hour of 128 nodes would not fit in memory
            cache.pop(next(iter(cache)))
        spec, fx, topo = self.spec, self.effects, self.topology
        G = self.cluster.gpus_per_node
        rng = _seed(spec.seed, f"gpu:{node}")
        ts = self.sample_ts + self._node_phase(node)
        n = len(ts)
        cols = signal_gpu.empty_columns(n, G)
        t = ts[:, None]
        stop = fx.stop_ts if fx.stop_ts is not None else math.inf
        ranks = [topo.ranks_on(node)[g] if g < len(topo.ranks_on(node)) else -1 for g in range(G)]
        exit_ts = np.array([fx.exits.get(r, (math.inf, 0))[0] for r in ranks])[None, :]
        training = (t >= self.train_start_ts) & (t < stop) & (t < exit_ts)
        hung = (t >= stop) & (t < exit_ts)
        idle_hung = np.array([fx.hung_states.get(r) in signal_stacks.IDLE_STATES for r in ranks])[None, :]
        spin = hung & ~idle_hung
        busy = training | spin
        loaded = (t >= self.train_start_ts - 12.0) & (t < exit_ts)  # model in GPU memory
        base_temp = rng.uniform(52, 64, G)
        base_power = rng.uniform(560, 680, G)
        base_mem = rng.uniform(68000, 74000, G)
        drift = 2.0 * np.sin(2 * np.pi * (ts - self.start_ts) / rng.uniform(600, 1800))[:, None]
        cols["util"] = np.where(busy, np.clip(np.rint(rng.normal(97, 1.5, (n, G))), 88, 100), 0.0)
        cols["mem_util"] = np.where(training, np.rint(rng.uniform(28, 55, (n, G))), np.where(spin, 2.0, 0.0))
        cols["mem_used_mb"] = np.where(loaded, np.rint(base_mem + rng.normal(0, 40, (n, G))), 531.0)
        cols["temp_c"] = np.rint(np.where(busy, base_temp + drift + rng.normal(0, 0.6, (n, G)),
                                          base_temp - 22 + rng.normal(0, 0.4, (n, G))))
        cols["power_w"] = np.round(np.where(training, base_power + rng.normal(0, 15, (n, G)),
                                            np.where(spin, 0.45 * base_power, 71.0 + rng.normal(0, 2, (n, G)))), 1)
        cols["sm_clock_mhz"] = np.where(busy, 1980.0, 345.0) + np.zeros((n, G))
        cols["mem_clock_mhz"][:] = 2619.0
        cols["throttle_reasons"] = np.where(busy, 0, 1).astype(np.int64) + np.zeros((n, G), dtype=np.int64)
        cols["ecc_sbe_agg"] += (rng.random(G) < 0.25) * rng.integers(1, 6, G)
        cols["remapped_rows_corr"] += (rng.random(G) < 0.1).astype(np.int64)
        for fnode, g, name, value, t0, t1 in fx.gpu_set:
            if fnode != node:
                continue
            m = (ts >= t0) & (ts < t1)
            col = cols[name]
            if isinstance(value, tuple) and value[0] == "ramp":
                _, target, r0, r1 = value
                frac = np.clip((ts[m] - r0) / max(r1 - r0, 1e-9), 0, 1)
                col[m, g] = np.rint(col[m, g] + (target - col[m, g]) * frac + rng.normal(0, 0.4, m.sum()) * (frac >= 1))
            elif isinstance(value, tuple) and value[0] == "scale":
                col[m, g] = np.round(col[m, g] * value[1], 1)
            else:
                keep = busy[:, g] if name in ("sm_clock_mhz", "throttle_reasons") else np.ones(n, dtype=bool)
                col[m & keep, g] = value
        for fnode, g, name, t0, t1, total in fx.gpu_ramp:
            if fnode != node:
                continue
            frac = np.clip((ts - t0) / (t1 - t0), 0.0, 1.0)
            cols[name][:, g] += np.floor(frac * total + 1e-9).astype(np.int64)
        lost = cols["lost"]
        if lost.any():
            for name in signal_gpu.GAUGES:
                cols[name][lost] = 0
            cols["throttle_reasons"][lost] = 0
        cache[node] = (ts, cols)
        return ts, cols

    def gpu_lines(self, node: str) -> list[tuple[float, str]]:
        ts, cols = self._gpu_columns(node)
        G = self.cluster.gpus_per_node
        uuids = [self.cluster.gpu_uuid(node, g) for g in range(G)]
        pci = [self.cluster.gpu_pci_full(g) for g in range(G)]
        lines = signal_gpu.render_lines(ts, node, self.cluster.job, uuids, pci, cols)
        return list(zip(ts.tolist(), lines, strict=True))

    def gpu_states(self, node: str, ts: float) -> list[GpuState]:
        """The node's GPUs as NVML would answer at simulated time ``ts`` (the last sample at or before it)."""
        sts, cols = self._gpu_columns(node)
        i = int(np.clip(np.searchsorted(sts, ts, side="right") - 1, 0, len(sts) - 1))
        out = []
        for g in range(self.cluster.gpus_per_node):
            kw: dict[str, Any] = {}
            for name, col in cols.items():
                v = col[i, g]
                kw[name] = bool(v) if name in signal_gpu.BOOL_FIELDS else (
                    float(v) if name in signal_gpu.FLOAT_FIELDS else int(v))
            out.append(GpuState(index=g, uuid=self.cluster.gpu_uuid(node, g), pci_bus=self.cluster.gpu_pci_full(g), **kw))
        return out

    def nvml_events(self, node: str) -> list[NvmlEvent]:
        return sorted((e for n, e in self.effects.nvml_events if n == node), key=lambda e: e.ts)

    @cached_property
    def kernel_formats(self) -> dict[str, str]:
        rng = _seed(self.spec.seed, "kernel-format")
        fmts = signal_kernel.FORMATS
        return {n: self.spec.kernel_format or fmts[int(rng.integers(0, len(fmts)))] for n in self.cluster.node_names}

    def kernel_lines(self, node: str) -> list[tuple[float, str]]:
        rng = _seed(self.spec.seed, f"kernel:{node}")
        boot = self.start_ts - float(rng.uniform(2, 40)) * 86400.0
        fmt = signal_kernel.KernelFormatter(self.kernel_formats[node], node, boot)
        recs = signal_kernel.noise_records(rng, self.start_ts, self.spec.duration_s, self.spec.kernel_noise_per_hour)
        recs += [(ts, lines) for n, ts, lines in self.effects.kernel if n == node]
        recs = [(ts, lines) for ts, lines in recs if self.start_ts <= ts < self.end_ts]
        recs.sort(key=lambda x: x[0])
        return [(ts, fmt.render(ts, lines)) for ts, lines in recs]

    def _seq_before(self, ts: float) -> int:
        """SeqNum of the collective in flight at ``ts`` (3 collectives per step after 8 at start-up)."""
        return 8 + 3 * int(np.searchsorted(self.steps.end, ts)) + 1

    def nccl_lines(self, rank: int) -> list[tuple[float, str]]:
        p = self.procs[rank]
        fx = self.effects
        comm_id = f"0x{zlib.crc32((self.cluster.job + str(self.spec.seed)).encode()):08x}{self.spec.seed & 0xffff:04x}c3e1"
        t0 = self.train_start_ts - 8.0 + 0.003 * (rank % 64)
        out = signal_nccl.startup_lines(p, comm_id, self.topology.world_size, t0)
        out += [(ts, line) for r, ts, line in fx.nccl if r == rank]
        timeout_ms = int(self.spec.timeout_s * 1000)
        for w in fx.watchdogs:
            if rank in w.ranks:
                fire = w.fire_ts + 0.0013 * (rank % 97)
                stop = fx.stop_ts if fx.stop_ts is not None else fire - self.spec.timeout_s
                ran = int((fire - stop) * 1000)
                ran = max(ran, timeout_ms + 1)
                numel = 8 if w.op == "BROADCAST" else w.numel
                out += signal_nccl.watchdog_timeout(p, fire, self._seq_before(stop), w.op, numel, timeout_ms, ran)
        out = [(ts, line) for ts, line in out if ts < self.end_ts]
        out.sort(key=lambda x: x[0])
        return out

    def launcher_lines(self, node: str) -> list[tuple[float, str]]:
        rng = _seed(self.spec.seed, f"launcher:{node}")
        agent = int(rng.integers(50_000, 99_000))
        out = [(self.start_ts + 1.0, signal_nccl.launcher_start(self.start_ts + 1.0, agent))]
        for r in self.topology.ranks_on(node):
            if r in self.effects.exits:
                ts, code = self.effects.exits[r]
                if ts < self.end_ts:
                    p = self.procs[r]
                    out.append((ts + 0.8, signal_nccl.launcher_failed(ts + 0.8, agent, p.gpu, p.pid, code)))
        out.sort(key=lambda x: x[0])
        return out

    def stacks(self) -> tuple[float | None, dict[int, str]]:
        """(dump time, rank -> py-spy text) when the scenario dumped stacks, else (None, {})."""
        fx = self.effects
        if fx.dump_ts is None or fx.default_stack is None:
            return None, {}
        cl = self.cluster
        cmd = (f"/usr/bin/python3 -u pretrain_gpt.py --tensor-model-parallel-size {cl.tp} "
               f"--pipeline-model-parallel-size {cl.pp} --context-parallel-size {cl.cp} --num-layers {cl.num_layers} "
               f"--micro-batch-size 1 --seq-length {self.spec.workload.context_len}")
        out = {}
        for r, p in self.procs.items():
            if r in fx.exits and fx.exits[r][0] <= fx.dump_ts:
                continue  # the process is gone: py-spy has nothing to attach to
            out[r] = signal_stacks.pyspy_dump(p.pid, fx.stack_states.get(r, fx.default_stack), cmd)
        return fx.dump_ts, out

    def job_dict(self) -> dict[str, Any]:
        d = self.topology.to_job_dict()
        d["num_layers"] = self.cluster.num_layers
        d["micro_batches"] = self.cluster.microbatches
        return d

    # ------------------------------------------------------------------ ordered events
    def node_streams(self, node: str) -> list[list[Event]]:
        """The node's records, one time-ordered list per batch-directory file."""
        streams = [[Event(ts, node, "gpu", f"nodes/{node}/gpu.jsonl", s) for ts, s in self.gpu_lines(node)],
                   [Event(ts, node, "kernel", f"nodes/{node}/kernel.log", s) for ts, s in self.kernel_lines(node)],
                   [Event(ts, node, "nccl", f"nodes/{node}/nccl/launcher.log", s) for ts, s in self.launcher_lines(node)]]
        for r in self.topology.ranks_on(node):
            streams.append([Event(ts, node, "nccl", f"nodes/{node}/nccl/rank{r}.log", s) for ts, s in self.nccl_lines(r)])
        streams.append([Event(ts, node, "steps", f"steps/{node}.jsonl", s) for ts, s in self.step_lines(node)])
        return streams

    def stack_events(self) -> list[Event]:
        dump_ts, texts = self.stacks()
        if dump_ts is None:
            return []
        return [Event(dump_ts + 0.01 * i, self.topology.node_of(r), "stacks", f"stacks/{r}.txt", texts[r].rstrip("\n"))
                for i, r in enumerate(sorted(texts))]

    def _streams(self) -> Iterator[list[Event]]:
        for node in self.cluster.node_names:
            yield from self.node_streams(node)
        yield self.stack_events()

    def events(self, since_ts: float | None = None, until_ts: float | None = None) -> Iterator[Event]:
        """Every record with ``since_ts < ts <= until_ts`` in time order (ties: stable by source)."""
        lo = -math.inf if since_ts is None else since_ts
        hi = math.inf if until_ts is None else until_ts
        for ev in heapq.merge(*list(self._streams()), key=lambda e: e.ts):
            if ev.ts <= lo:
                continue
            if ev.ts > hi:
                break
            yield ev


def scenario_for(kind: str, *, nodes: int = 4, gpus_per_node: int = 8, duration_s: float = 600.0, seed: int = 0,
                 name: str | None = None, **cluster_kw: Any) -> Scenario:
    """A scenario with one fault of ``kind`` ("healthy": none) on a usual layout."""
    cluster = ClusterSpec.for_nodes(nodes, gpus_per_node, **cluster_kw)
    faults = () if kind == "healthy" else (FaultSpec(kind=kind, id="f1"),)
    return Scenario(ScenarioSpec(name=name or f"{kind}-s{seed}", seed=seed, cluster=cluster,
                                 duration_s=duration_s, faults=faults))


__all__ = ["Event", "FaultSpec", "Scenario", "ScenarioSpec", "scenario_for"]
