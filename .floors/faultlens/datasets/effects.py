"""What injected faults do to a scenario, collected before any signal is rendered.

A fault never writes lines or samples itself: it declares effects here
(a rank slows down from t, a counter rises, a kernel record at t, training
stops at t, these ranks' watchdogs fire...). The scenario then renders every
signal from the job's timeline and these effects, so faults compose and the
same seed always gives the same bytes. All times are epoch seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from faultlens.collectors.nvml_backend import NvmlEvent
from faultlens.datasets.cluster import ClusterSpec
from faultlens.datasets.signal_nccl import RankProc
from faultlens.stream.topology import Topology


@dataclass
class Watchdog:
    ranks: list[int]
    fire_ts: float
    op: str = "ALLREDUCE"
    numel: int = 40_000_000


@dataclass
class Effects:
    slow: list[tuple[int, float, float, float]] = field(default_factory=list)  # (rank, factor, t0, t1)
    step_delay: list[tuple[float, float, float]] = field(default_factory=list)  # (t0, t1, extra fraction)
    surges: list[tuple[float, float, float]] = field(default_factory=list)  # (t0, t1, mean_len)
    hiccups: list[tuple[float, float]] = field(default_factory=list)  # (t, extra seconds) on one step
    stop_ts: float | None = None
    exits: dict[int, tuple[float, int]] = field(default_factory=dict)  # rank -> (ts, exit code)
    watchdogs: list[Watchdog] = field(default_factory=list)
    gpu_set: list[tuple[str, int, str, Any, float, float]] = field(default_factory=list)
    gpu_ramp: list[tuple[str, int, str, float, float, float]] = field(default_factory=list)  # total added t0..t1
    kernel: list[tuple[str, float, list[str]]] = field(default_factory=list)
    nccl: list[tuple[int, float, str]] = field(default_factory=list)
    launcher: list[tuple[str, float, str]] = field(default_factory=list)
    nvml_events: list[tuple[str, NvmlEvent]] = field(default_factory=list)
    stack_states: dict[int, str] = field(default_factory=dict)
    default_stack: str | None = None  # state of every rank not in stack_states when dumped
    dump_ts: float | None = None
    nan_from: float | None = None
    hung_states: dict[int, str] = field(default_factory=dict)  # rank -> state while hung (for GPU util)


class FaultContext:
    """The handle a fault gets: the job, its clock, a seeded RNG and the effect sinks."""

    def __init__(self, cluster: ClusterSpec, start_ts: float, duration_s: float, train_start_ts: float,
                 timeout_s: float, rng: np.random.Generator, procs: dict[int, RankProc], effects: Effects):
        self.cluster = cluster
        self.topology: Topology = cluster.topology
        self.start_ts = start_ts
        self.duration_s = duration_s
        self.end_ts = start_ts + duration_s
        self.train_start_ts = train_start_ts
        self.timeout_s = timeout_s
        self.rng = rng
        self.procs = procs
        self.fx = effects

    # -- where -------------------------------------------------------------------------
    def pick_gpu(self, node: str | None = None, gpu: int | None = None) -> tuple[str, int, int]:
        """(node, gpu, rank) of the culprit: the requested one or a random one."""
        nodes = self.cluster.node_names
        node = node or nodes[int(self.rng.integers(0, len(nodes)))]
        if node not in nodes:
            raise ValueError(f"node {node!r} is not in this cluster ({nodes[0]}..{nodes[-1]})")
        gpu = int(self.rng.integers(0, self.cluster.gpus_per_node)) if gpu is None else int(gpu)
        rank = next(r for r, (n, g) in self.topology.placement.items() if n == node and g == gpu)
        return node, gpu, rank

    def onset(self, onset_s: float | None, lo: float = 0.2, hi: float = 0.35) -> float:
        """Absolute onset: the requested offset from the start, or a random one in [lo, hi] of the run."""
        if onset_s is None:
            onset_s = float(self.rng.uniform(lo, hi)) * self.duration_s
        return max(self.start_ts + onset_s, self.train_start_ts + 5.0)

    def ranks_on(self, node: str) -> list[int]:
        return self.topology.ranks_on(node)

    # -- effects -----------------------------------------------------------------------
    def slow_rank(self, rank: int, factor: float, t0: float, t1: float | None = None) -> None:
        self.fx.slow.append((rank, factor, t0, t1 if t1 is not None else float("inf")))

    def kernel(self, node: str, ts: float, lines: list[str]) -> None:
        self.fx.kernel.append((node, ts, lines))

    def nccl(self, rank: int, ts: float, line: str) -> None:
        self.fx.nccl.append((rank, ts, line))

    def nccl_lines(self, rank: int, ts: float, lines: list[str], step_s: float = 0.0001) -> None:
        for i, line in enumerate(lines):
            self.fx.nccl.append((rank, ts + i * step_s, line))

    def gpu_set(self, node: str, gpu: int, fld: str, value: Any, t0: float, t1: float | None = None) -> None:
        self.fx.gpu_set.append((node, gpu, fld, value, t0, t1 if t1 is not None else float("inf")))

    def gpu_ramp(self, node: str, gpu: int, fld: str, total: float, t0: float, t1: float) -> None:
        """A cumulative counter rising by ``total`` between t0 and t1 (step-wise, integers)."""
        self.fx.gpu_ramp.append((node, gpu, fld, t0, max(t1, t0 + 1.0), float(total)))

    def nvml_event(self, node: str, event: NvmlEvent) -> None:
        self.fx.nvml_events.append((node, event))

    def stop_training(self, ts: float) -> None:
        """No step completes after ``ts``: the job hangs or dies there."""
        self.fx.stop_ts = ts if self.fx.stop_ts is None else min(self.fx.stop_ts, ts)

    def exit_ranks(self, ranks: list[int], ts: float, exitcode: int) -> None:
        """These processes end at ``ts``; torchrun on their node reports each failure."""
        for r in ranks:
            if r in self.fx.exits and self.fx.exits[r][0] <= ts:
                continue
            self.fx.exits[r] = (ts, exitcode)

    def kill_node_ranks_after(self, node: str, ts: float, first_rank: int, exitcode: int) -> None:
        """One local worker failed: torchrun stops the node's other workers (SIGTERM)."""
        self.exit_ranks([first_rank], ts, exitcode)
        self.exit_ranks([r for r in self.ranks_on(node) if r != first_rank], ts + 0.5, -15)

    def watchdog(self, ranks: list[int], fire_ts: float, op: str = "ALLREDUCE") -> None:
        """These ranks' ProcessGroupNCCL watchdogs time out at ``fire_ts`` and abort (SIGABRT)."""
        ranks = [r for r in ranks if r not in self.fx.exits or self.fx.exits[r][0] > fire_ts]
        if not ranks or fire_ts >= self.end_ts:
            return
        self.fx.watchdogs.append(Watchdog(ranks, fire_ts, op))
        for r in ranks:
            self.fx.exits[r] = (fire_ts + 0.3 + 0.05 * (r % 7), -6)

    def dump_stacks(self, ts: float, states: dict[int, str], default: str) -> None:
        if ts < self.end_ts:
            self.fx.dump_ts = ts
            self.fx.stack_states.update(states)
            self.fx.default_stack = default
