"""Iteration time of a hybrid-parallel job from its workload, GPU speeds and plan.

This is the simulator's ground-truth performance model; the adaptation
planner (models/costmodel.py) is validated against ``iteration_time``. The
model (datasets/README.md, "Step-time model", states it with the same symbols):

* micro-batch cost at speed 1 on one pipeline stage holding an equal share of
  the layers: ``w_j = alpha * tokens_j + beta * sum_len_sq_j + c``;
* stage ``s`` of replica ``d`` runs micro-batch ``j`` in
  ``t[d,s,j] = w_j * q[d,s]`` with ``q[d,s] = (L_s / (L/pp)) / g[d,s]``: its
  share of layers over its group speed;
* ``g[d,s]``: the slowest rank of the stage's TP x CP block gates it. A rank
  of speed ``v`` takes ``1/v`` as long; a TP group with ``k`` GPUs excluded
  runs at ``(tp-k)/tp`` of its slowest remaining GPU;
* 1F1B pipeline: ``T_d = sum_j t[d,s*,j] + sum_{s != s*} mean_j t[d,s,j]``
  where ``s*`` is the bottleneck stage (largest ``q``): the slowest stage runs
  every micro-batch back to back, the others add their fill/drain once. With
  equal stages this is ``(m + pp - 1) * t``;
* iteration: ``max_d T_d + sync_s`` (the slowest data-parallel replica, then
  the gradient all-reduce / optimizer step);
* a rank's compute time: ``sum_{j in d} w_j * (L_s/(L/pp)) * (tp/(tp-k)) / v_rank``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from faultlens.stream.topology import Topology


@dataclass(frozen=True)
class CostModel:
    """Micro-batch cost ``alpha * tokens + beta * sum(len^2) + c`` (seconds, one stage's share, speed 1)."""

    alpha_s_per_token: float = 9.77e-6
    beta_s_per_token_sq: float = 7.0e-9
    const_s: float = 0.02
    sync_s: float = 0.3  # gradient all-reduce + optimizer step after the pipeline drains

    def microbatch_cost(self, tokens: Any, sum_len_sq: Any) -> Any:
        return self.alpha_s_per_token * np.asarray(tokens, dtype=float) + \
            self.beta_s_per_token_sq * np.asarray(sum_len_sq, dtype=float) + self.const_s


class IterationTime(NamedTuple):
    iteration_s: float
    per_rank_compute_s: dict[int, float]  # excluded ranks are absent


@dataclass(frozen=True)
class _Layout:
    """The plan resolved against a topology: everything that does not change per step."""

    mb_per_replica: np.ndarray  # (dp,)
    q: np.ndarray  # (dp, pp): stage time multiplier
    rank_factor: np.ndarray  # (world,): compute multiplier of each rank (0: excluded)
    rank_dp: np.ndarray
    rank_pp: np.ndarray


def _resolve(topology: Topology, speed: np.ndarray, plan: Mapping[str, Any] | None, n_microbatches: int) -> _Layout:
    plan = plan or {}
    tp, pp, dp = topology.tp, topology.pp, topology.dp
    world = topology.world_size
    layers = plan.get("layers_per_stage")
    if layers is None:
        ratio = np.ones(pp)
    else:
        if len(layers) != pp or min(layers) < 0 or sum(layers) <= 0:
            raise ValueError(f"layers_per_stage must list {pp} non-negative counts")
        ratio = np.asarray(layers, dtype=float) / (sum(layers) / pp)
    mbs = plan.get("microbatches_per_replica")
    if mbs is None:
        if n_microbatches % dp:
            raise ValueError(f"{n_microbatches} micro-batches do not split evenly over dp={dp}")
        mb = np.full(dp, n_microbatches // dp, dtype=np.int64)
    else:
        if len(mbs) != dp or sum(mbs) != n_microbatches or min(mbs) < 0:
            raise ValueError(f"microbatches_per_replica must list {dp} counts summing to {n_microbatches}")
        mb = np.asarray(mbs, dtype=np.int64)
    excluded = {int(r) for r in plan.get("tp_excluded_gpus", ())}
    coords = [topology.coords(r) for r in range(world)]
    rank_dp = np.array([c["dp"] for c in coords])
    rank_pp = np.array([c["pp"] for c in coords])
    factor = np.ones(world)
    for group in topology.groups("tp"):
        k = sum(1 for r in group if r in excluded)
        if k >= tp:
            raise ValueError(f"every GPU of TP group {group} is excluded")
        for r in group:
            factor[r] = 0.0 if r in excluded else tp / (tp - k)
    rank_factor = np.where(factor > 0, ratio[rank_pp] * factor / np.maximum(speed, 1e-9), 0.0)
    if np.any((speed <= 0) & (factor > 0)):
        raise ValueError("a rank with speed 0 must be excluded from its TP group")
    q = np.zeros((dp, pp))
    np.maximum.at(q, (rank_dp, rank_pp), rank_factor)
    return _Layout(mb_per_replica=mb, q=q, rank_factor=rank_factor, rank_dp=rank_dp, rank_pp=rank_pp)


def iteration_times(topology: Topology, speed: np.ndarray | None, plan: Mapping[str, Any] | None,
                    costs: np.ndarray, *, sync_s: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised over steps: ``costs`` (steps, micro-batches) -> (iteration_s (steps,), compute_s (steps, world)).

    Micro-batches are dealt to replicas in order: replica 0 takes the first
    ``microbatches_per_replica[0]``, and so on. Excluded ranks have compute 0.
    """
    costs = np.atleast_2d(np.asarray(costs, dtype=float))
    world = topology.world_size
    speed = np.ones(world) if speed is None else np.asarray(speed, dtype=float)
    lay = _resolve(topology, speed, plan, costs.shape[1])
    bounds = np.concatenate([[0], np.cumsum(lay.mb_per_replica)])
    csum = np.concatenate([np.zeros((costs.shape[0], 1)), np.cumsum(costs, axis=1)], axis=1)
    sum_w = csum[:, bounds[1:]] - csum[:, bounds[:-1]]  # (steps, dp)
    mean_w = np.divide(sum_w, lay.mb_per_replica, out=np.zeros_like(sum_w), where=lay.mb_per_replica > 0)
    q_star = lay.q.max(axis=1)  # (dp,)
    fill = lay.q.sum(axis=1) - q_star
    replica = sum_w * q_star + mean_w * fill  # (steps, dp)
    iteration = replica.max(axis=1) + sync_s
    compute = sum_w[:, lay.rank_dp] * lay.rank_factor
    return iteration, compute


def iteration_time(topology: Topology, per_rank_speed: Mapping[int, float] | None, plan: Mapping[str, Any] | None,
                   microbatch_costs: Sequence[float] | np.ndarray, *, sync_s: float = 0.0) -> IterationTime:
    """One iteration: ``(iteration_s, {rank: compute_s})``.

    ``per_rank_speed``: rank -> relative speed (missing ranks: 1.0; 0.8 takes
    1/0.8 as long). ``plan``: optional ``layers_per_stage`` (pp counts),
    ``microbatches_per_replica`` (dp counts summing to the number of
    micro-batches), ``tp_excluded_gpus`` (ranks removed from their TP group).
    ``microbatch_costs``: each micro-batch's ``w_j`` (CostModel.microbatch_cost),
    flat (dealt to replicas in order) or shaped (dp, m) for an equal split.
    """
    speed = np.ones(topology.world_size)
    for r, v in (per_rank_speed or {}).items():
        speed[int(r)] = float(v)
    costs = np.asarray(microbatch_costs, dtype=float).reshape(1, -1)
    it, comp = iteration_times(topology, speed, plan, costs, sync_s=sync_s)
    excluded = {int(r) for r in (plan or {}).get("tp_excluded_gpus", ())}
    return IterationTime(float(it[0]), {r: float(comp[0, r]) for r in range(topology.world_size) if r not in excluded})
