"""Iteration-time cost model of a hybrid-parallel job under a parallel layout.

The adaptation planner (models/planner.py) asks "if the job ran with *this*
layer split, *this* micro-batch share per data-parallel replica and *these*
GPUs left out of their tensor-parallel group, how long would one iteration
take, given how fast each GPU is now?". This module answers it, for a
non-interleaved 1F1B pipeline schedule (Megatron-LM's default).

The model, in the order the job experiences it:

* A *cell* is the set of ranks that run one pipeline stage of one data-parallel
  replica (its TP x CP ranks). Tensor and context parallelism are synchronous
  inside a layer, so a cell runs at the speed of its slowest member. A TP group
  that leaves out ``x`` of its ``tp`` GPUs runs at ``(tp - x) / tp`` times the
  speed of its slowest *kept* GPU (the same work on fewer GPUs, but no waiting
  for the slow one: ResiHP's selective device exclusion).
* One micro-batch on a stage holding ``l`` of the model's ``L`` layers takes
  ``microbatch_s * cost * l / L / speed`` seconds, forward (``forward_fraction``)
  plus backward, where ``microbatch_s`` is the forward+backward time of one
  micro-batch through the whole model on healthy GPUs and ``cost`` its relative
  workload (1.0 on average; sequence lengths move it).
* Each replica runs its micro-batches through the stages in 1F1B order; its
  time is the critical path of that schedule: by default the closed form
  ``sum_s c_s + (m - 1) * max_s c_s`` (the bottleneck stage runs every
  micro-batch back to back, the others add their fill and drain once; the
  simulator's step-time model uses the same form), or, with ``exact=True``, an
  event simulation of the schedule (``pipeline_time``).
* The iteration ends when the slowest replica is done and gradients are
  reduced across replicas: ``dp_sync_s`` on the healthy layout, scaled by the
  largest share of parameters one GPU holds (more layers on a stage, or a TP
  group shrunk from 8 to 4, means more gradient bytes to reduce).
* Micro-batch costs vary (sequence lengths), so the slowest replica of an
  iteration is a random maximum. With ``microbatch_cv > 0`` (or observed
  ``microbatch_cost_samples``) every layout is scored on the same fixed-seed
  Monte Carlo draws (:class:`CostDraws`: iterations of micro-batch costs dealt
  to replicas in order, as the job's data stream is): the prediction is the
  mean over draws of ``max_d T_d + sync``, and the per-draw times let the
  planner compare two layouts *paired*, with the variance of the difference.

It imports nothing of the simulator (models never import datasets/); the tests
and benchmarks/adaptation.py check it against the simulator's step-time model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from faultlens.stream.topology import Topology

FAILED = 0.0  # speed of a GPU that no longer computes


@dataclass(frozen=True)
class JobShape:
    """What one iteration of the job looks like on healthy GPUs.

    ``microbatches`` is per data-parallel replica in the healthy layout, so the
    global batch is ``microbatches * dp`` micro-batches of
    ``tokens_per_microbatch`` tokens each.
    """

    num_layers: int
    microbatches: int
    microbatch_s: float  # fwd+bwd of one micro-batch through all layers, healthy cell
    tokens_per_microbatch: int
    forward_fraction: float = 1.0 / 3.0
    p2p_s: float = 0.0  # one activation/gradient hop between adjacent stages
    dp_sync_s: float = 0.0  # gradient reduction + optimizer step on the healthy layout
    # True: the sync grows with the largest parameter share one GPU holds (more
    # gradient bytes); False: a constant (reduction overlapped with backward).
    sync_grows_with_params: bool = True
    # Coefficient of variation of one micro-batch's cost (sequence lengths): the
    # slowest of several replicas is slower than the average one, so with cv > 0
    # predict() returns the expected maximum over replicas, not the maximum of means.
    microbatch_cv: float = 0.0
    # Observed micro-batch costs (any scale, e.g. seconds from recent steps): when
    # given, the Monte Carlo resamples them (the real, heavy-tailed distribution)
    # instead of assuming a log-normal of microbatch_cv.
    microbatch_cost_samples: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.microbatches < 1:
            raise ValueError("num_layers and microbatches must be >= 1")
        if self.microbatch_s <= 0 or self.tokens_per_microbatch <= 0:
            raise ValueError("microbatch_s and tokens_per_microbatch must be > 0")
        if not 0.0 < self.forward_fraction < 1.0:
            raise ValueError("forward_fraction must be in (0, 1)")
        if self.microbatch_cv < 0:
            raise ValueError("microbatch_cv must be >= 0")
        if any(not (math.isfinite(c) and c > 0) for c in self.microbatch_cost_samples):
            raise ValueError("microbatch_cost_samples must be finite and > 0")

    @property
    def stochastic(self) -> bool:
        """Whether micro-batch costs vary (then predictions are Monte Carlo means)."""
        samples = self.microbatch_cost_samples
        return self.microbatch_cv > 0 or (len(samples) > 1 and max(samples) > min(samples))

    @classmethod
    def from_iteration(cls, topology: Topology, iteration_s: float, tokens_per_iteration: int, *,
                       num_layers: int, microbatches: int, forward_fraction: float = 1.0 / 3.0,
                       p2p_s: float = 0.0, dp_sync_s: float = 0.0) -> JobShape:
        """Back out ``microbatch_s`` from one observed healthy iteration (1F1B: ``m + pp - 1`` slots)."""
        pp = topology.pp
        per_stage = (iteration_s - dp_sync_s - 2 * (pp - 1) * p2p_s) / (microbatches + pp - 1)
        if per_stage <= 0:
            raise ValueError("iteration_s too small for the given p2p_s/dp_sync_s")
        tokens_mb = max(1, round(tokens_per_iteration / (microbatches * topology.dp)))
        return cls(num_layers=num_layers, microbatches=microbatches, microbatch_s=per_stage * pp,
                   tokens_per_microbatch=tokens_mb, forward_fraction=forward_fraction,
                   p2p_s=p2p_s, dp_sync_s=dp_sync_s)


def even_layers(num_layers: int, pp: int) -> tuple[int, ...]:
    """Megatron's default split: as even as integers allow, extra layers on the first stages."""
    if num_layers < pp:
        raise ValueError(f"{num_layers} layers cannot fill {pp} pipeline stages")
    base, extra = divmod(num_layers, pp)
    return tuple(base + (1 if s < extra else 0) for s in range(pp))


@dataclass(frozen=True)
class Layout:
    """A parallel layout: layer split, micro-batch share, and GPUs left out of TP."""

    layers_per_stage: tuple[int, ...]
    microbatches_per_replica: tuple[int, ...]
    tp_excluded: frozenset[int] = field(default_factory=frozenset)  # ranks no longer computing

    @classmethod
    def healthy(cls, topology: Topology, shape: JobShape) -> Layout:
        return cls(even_layers(shape.num_layers, topology.pp), (shape.microbatches,) * topology.dp)

    def to_dict(self, topology: Topology | None = None) -> dict:
        out: dict = {"layers_per_stage": list(self.layers_per_stage),
                     "microbatches_per_replica": list(self.microbatches_per_replica),
                     "tp_excluded_ranks": sorted(self.tp_excluded)}
        if topology is not None and topology.placement:
            out["tp_excluded_gpus"] = [{"rank": r, "node": topology.node_of(r), "gpu": topology.gpu_of(r)}
                                       for r in sorted(self.tp_excluded)]
        return out


@dataclass(frozen=True)
class Prediction:
    iteration_s: float  # expected iteration time (Monte Carlo mean when costs vary)
    tokens_per_s: float
    replica_s: tuple[float, ...]  # pipeline time of each DP replica at the mean cost (before the sync)
    sync_s: float
    cell_speed: tuple[tuple[float, ...], ...]  # [dp][pp] effective speed of each cell
    # iteration time on each Monte Carlo draw (None: deterministic); the same draws
    # for every layout of one model, so two layouts' samples can be compared paired
    samples_s: np.ndarray | None = field(default=None, compare=False, repr=False)


MC_ELEMENTS = 1 << 20  # draws x micro-batches per Monte Carlo matrix (~8 MB)
MC_MIN_DRAWS, MC_MAX_DRAWS = 256, 4096
MC_SEED = 0  # fixed: the same shape always gives the same prediction


class CostDraws:
    """Fixed-seed draws of relative micro-batch costs (mean 1), one row per simulated iteration.

    Rows are dealt to replicas in order (replica 0 takes the first ``m_0``
    micro-batches, ...), so layouts that move a few micro-batches share the
    rest: comparisons between layouts are paired, as in the running job whose
    data stream is the same whichever layout it uses.
    """

    def __init__(self, shape: JobShape, total: int) -> None:
        draws = int(min(max(MC_ELEMENTS // max(total, 1), MC_MIN_DRAWS), MC_MAX_DRAWS))
        rng = np.random.default_rng(MC_SEED)
        if len(shape.microbatch_cost_samples) > 1:
            observed = np.asarray(shape.microbatch_cost_samples, dtype=float)
            costs = rng.choice(observed / observed.mean(), size=(draws, total))
        else:
            sigma2 = math.log1p(shape.microbatch_cv ** 2)
            costs = rng.lognormal(-sigma2 / 2.0, math.sqrt(sigma2), size=(draws, total))
        costs /= costs.mean()
        self.draws, self.total = draws, total
        self._cumsum = np.concatenate([np.zeros((draws, 1)), np.cumsum(costs, axis=1)], axis=1)

    def replica_means(self, counts: Sequence[int]) -> np.ndarray:
        """(draws, dp) mean relative cost of each replica's micro-batches."""
        bounds = np.concatenate([[0], np.cumsum(counts)])
        if bounds[-1] > self.total:
            raise ValueError(f"{bounds[-1]} micro-batches exceed the {self.total} drawn")
        sums = self._cumsum[:, bounds[1:]] - self._cumsum[:, bounds[:-1]]
        return sums / np.asarray(counts, dtype=float)


class IterationCostModel:
    """Predict iteration time and throughput of ``topology`` under a :class:`Layout`."""

    def __init__(self, topology: Topology, shape: JobShape, speeds: Mapping[int, float] | None = None, *,
                 exact: bool = False, draws: dict[int, CostDraws] | None = None) -> None:
        if topology.pp > shape.num_layers:
            raise ValueError(f"pp={topology.pp} exceeds num_layers={shape.num_layers}")
        self.topology = topology
        self.shape = shape
        # Monte Carlo draws by global micro-batch count, shared with with_speeds() copies (paired comparisons)
        self._draws: dict[int, CostDraws] = {} if draws is None else draws
        self.exact = exact  # default schedule model of predict(): event simulation or critical-path form
        self.speeds = {int(r): float(v) for r, v in (speeds or {}).items()}
        # cells[d][s] = TP groups (tuples of ranks) of that stage of that replica, one per cp index
        t = topology
        self._cells: list[list[list[tuple[int, ...]]]] = [
            [[tuple(t.rank_of(tp=i, cp=c, dp=d, pp=s) for i in range(t.tp)) for c in range(t.cp)]
             for s in range(t.pp)]
            for d in range(t.dp)
        ]

    def with_speeds(self, speeds: Mapping[int, float]) -> IterationCostModel:
        return IterationCostModel(self.topology, self.shape, speeds, exact=self.exact, draws=self._draws)

    def cost_draws(self, total: int) -> CostDraws:
        """The Monte Carlo draws for ``total`` micro-batches per iteration (built once, then shared)."""
        if total not in self._draws:
            self._draws[total] = CostDraws(self.shape, total)
        return self._draws[total]

    def speed(self, rank: int) -> float:
        return self.speeds.get(rank, 1.0)

    def tp_groups_of_cell(self, d: int, s: int) -> list[tuple[int, ...]]:
        return self._cells[d][s]

    # ------------------------------------------------------------------ speeds
    def tp_group_speed(self, group: Sequence[int], excluded: frozenset[int] | set[int] = frozenset()) -> float:
        """Speed of one TP group relative to a healthy full group (0: cannot compute)."""
        kept = [r for r in group if r not in excluded]
        if not kept:
            return FAILED
        return len(kept) / len(group) * min(self.speed(r) for r in kept)

    def cell_speeds(self, excluded: frozenset[int] = frozenset()) -> list[list[float]]:
        return [[min(self.tp_group_speed(g, excluded) for g in cell) for cell in replica]
                for replica in self._cells]

    def param_share(self, layout: Layout) -> float:
        """Largest parameter share one GPU holds, relative to the healthy even layout."""
        t, shape = self.topology, self.shape
        per_stage = shape.num_layers / t.pp
        worst = 0.0
        for replica in self._cells:
            for s, cell in enumerate(replica):
                for g in cell:
                    kept = sum(1 for r in g if r not in layout.tp_excluded)
                    if kept:
                        worst = max(worst, layout.layers_per_stage[s] / per_stage * len(g) / kept)
        return worst

    # ------------------------------------------------------------------ prediction
    def stage_times(self, layout: Layout, speeds_row: Sequence[float]) -> tuple[list[float], list[float]]:
        """Forward and backward seconds of one average micro-batch on each stage of one replica."""
        shape = self.shape
        per_layer = shape.microbatch_s / shape.num_layers
        fwd, bwd = [], []
        for layers, v in zip(layout.layers_per_stage, speeds_row, strict=True):
            c = per_layer * layers / v if v > 0 else float("inf")
            fwd.append(c * shape.forward_fraction)
            bwd.append(c * (1.0 - shape.forward_fraction))
        return fwd, bwd

    def predict(self, layout: Layout, *, exact: bool | None = None,
                microbatch_costs: Sequence[Sequence[float]] | None = None) -> Prediction:
        """Iteration time and tokens/s of ``layout``.

        By default (``exact`` None: the model's setting, False unless asked) the
        critical-path form ``sum_s c_s + (m - 1) * max_s c_s`` is used: linear
        in the micro-batch costs, so the mean cost predicts the sum. ``exact``
        simulates the 1F1B schedule event by event instead (it is shorter by
        the bubbles a mid-pipeline bottleneck hides: up to ~(pp-1)/(m+pp-1)).
        ``microbatch_costs[d]`` gives the relative cost of each of replica d's
        micro-batches (default: all 1.0).
        """
        exact = self.exact if exact is None else exact
        t = self.topology
        self._check(layout)
        speeds = self.cell_speeds(layout.tp_excluded)
        replica_s = []
        for d in range(t.dp):
            fwd, bwd = self.stage_times(layout, speeds[d])
            m = layout.microbatches_per_replica[d]
            costs = microbatch_costs[d] if microbatch_costs is not None else None
            if exact:
                replica_s.append(pipeline_time(fwd, bwd, m, self.shape.p2p_s, costs))
            else:
                scale = sum(costs) / m if costs is not None and m else 1.0
                replica_s.append(scale * pipeline_time_bound(fwd, bwd, m) + 2 * (t.pp - 1) * self.shape.p2p_s)
        share = self.param_share(layout) if self.shape.sync_grows_with_params else 1.0
        sync = self.shape.dp_sync_s * share
        samples = None
        if self.shape.stochastic and microbatch_costs is None and all(map(math.isfinite, replica_s)):
            # the expected slowest replica: compute scales with the replica's mean cost, p2p hops do not
            fixed = 0.0 if exact else 2 * (t.pp - 1) * self.shape.p2p_s
            means = self.cost_draws(sum(layout.microbatches_per_replica)).replica_means(
                layout.microbatches_per_replica)
            samples = np.max(means * (np.asarray(replica_s) - fixed) + fixed, axis=1) + sync
            iteration = float(samples.mean())
        else:
            iteration = max(replica_s) + sync
        tokens = self.shape.tokens_per_microbatch * sum(layout.microbatches_per_replica)
        tps = tokens / iteration if iteration > 0 and iteration != float("inf") else 0.0
        return Prediction(iteration, tps, tuple(replica_s), sync, tuple(tuple(r) for r in speeds), samples)

    def _check(self, layout: Layout) -> None:
        t = self.topology
        if len(layout.layers_per_stage) != t.pp or sum(layout.layers_per_stage) != self.shape.num_layers:
            raise ValueError(f"layers_per_stage {layout.layers_per_stage} must be {t.pp} stages "
                             f"summing to {self.shape.num_layers}")
        if min(layout.layers_per_stage) < 1:
            raise ValueError("every stage needs at least one layer")
        if len(layout.microbatches_per_replica) != t.dp or min(layout.microbatches_per_replica) < 1:
            raise ValueError(f"microbatches_per_replica must give each of {t.dp} replicas >= 1")


def expected_max(means: Sequence[float], cvs: Sequence[float], draws: int = 512) -> float:
    """E[max_d means[d] * (1 + cvs[d] * Z_d)], Z_d independent standard normal (fixed draws: repeatable)."""
    mu = np.asarray(means, dtype=float)
    if not np.all(np.isfinite(mu)):
        return float("inf")
    z = np.random.default_rng(0).standard_normal((draws, len(mu)))
    return float(np.mean(np.max(mu * (1.0 + np.asarray(cvs, dtype=float) * z), axis=1)))


def pipeline_time_bound(fwd: Sequence[float], bwd: Sequence[float], m: int, p2p_s: float = 0.0) -> float:
    """Closed-form 1F1B critical path: fill and drain through every stage, steady state at the slowest."""
    c = [f + b for f, b in zip(fwd, bwd, strict=True)]
    return sum(c) + (m - 1) * max(c) + 2 * (len(c) - 1) * p2p_s


def pipeline_time(fwd: Sequence[float], bwd: Sequence[float], m: int, p2p_s: float = 0.0,
                  costs: Sequence[float] | None = None) -> float:
    """Exact makespan of a non-interleaved 1F1B schedule of ``m`` micro-batches.

    Stage ``s`` runs ``min(pp - s - 1, m)`` warm-up forwards, then alternates one
    forward and one backward, then drains the remaining backwards; a forward
    needs the previous stage's forward of the same micro-batch, a backward the
    next stage's backward (plus ``p2p_s`` per hop). ``costs`` scales each
    micro-batch's compute (sequence-length-driven workload).
    """
    pp = len(fwd)
    if any(x == float("inf") for x in fwd):
        return float("inf")
    scale = list(costs) if costs is not None else [1.0] * m
    if len(scale) != m:
        raise ValueError(f"{len(scale)} micro-batch costs for {m} micro-batches")
    orders: list[list[tuple[str, int]]] = []
    for s in range(pp):
        warm = min(pp - s - 1, m)
        ops = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            ops.append(("F", warm + i))
            ops.append(("B", i))
        ops.extend(("B", i) for i in range(m - warm, m))
        orders.append(ops)
    f_end = [[-1.0] * m for _ in range(pp)]
    b_end = [[-1.0] * m for _ in range(pp)]
    free = [0.0] * pp
    pos = [0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(pp):
            while pos[s] < len(orders[s]):
                kind, i = orders[s][pos[s]]
                if kind == "F":
                    if s == 0:
                        ready = 0.0
                    elif f_end[s - 1][i] >= 0:
                        ready = f_end[s - 1][i] + p2p_s
                    else:
                        break
                    start = max(free[s], ready)
                    free[s] = f_end[s][i] = start + fwd[s] * scale[i]
                else:
                    if s == pp - 1:
                        ready = f_end[s][i]
                    elif b_end[s + 1][i] >= 0:
                        ready = b_end[s + 1][i] + p2p_s
                    else:
                        break
                    start = max(free[s], ready)
                    free[s] = b_end[s][i] = start + bwd[s] * scale[i]
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - the schedule above is always deadlock-free
            raise RuntimeError("1F1B schedule deadlocked")
    return max(free)


__all__ = ["FAILED", "CostDraws", "IterationCostModel", "JobShape", "Layout", "Prediction", "even_layers", "expected_max",
           "pipeline_time", "pipeline_time_bound"]
