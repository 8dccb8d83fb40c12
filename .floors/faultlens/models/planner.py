"""Adaptation planner: keep training around a slow GPU, or evict it (ResiHP's scheduler).

Given the job's topology, each GPU's measured speed and the job's shape, the
planner builds candidate layouts, predicts each one's throughput with the cost
model (models/costmodel.py), and picks the option with the most tokens over a
horizon (the expected remaining time of the fault). Options, each the best
layout of its family:

* ``no_action``: the current layout.
* ``rebalance_microbatches`` (DP): replicas take micro-batches in proportion to
  their speed, keeping the global batch (greedy min-makespan on each replica's
  predicted time; ResiHP's progress-aware migration, decided per iteration).
* ``repartition_layers`` (PP): fewer layers on the slow stage, at least one
  per stage (greedy min-max partition over per-layer stage costs, for a few
  blends of the replicas' mean and worst stage speed; e.g. (4,4,4)->(5,2,5)).
* ``shrink_tp`` (TP): leave the slow/failed GPU out of its tensor-parallel
  group, keeping a power-of-two degree >= ``min_tp``; the kept size ``k``
  maximises ``k * min(speed of the k kept)`` (ResiHP's selective exclusion).
* every combination of the three above;
* ``evict_restart``: replace the slow machines and restart at full speed after
  a restart cost (warm standby if enough spares, else a requeue) plus half an
  iteration of lost work.

Goodput over the horizon ``H``: ``tokens_per_s * max(0, H - pause_s)`` where the
pause is the option's switch cost (restart, reconfigure or nothing). The
*default* is the better of the two simple answers, no action and eviction
(eviction when within ``evict_tie_fraction`` (0.5%) of no action: it removes the
cause). An adaptation replaces the default only when its predicted gain exceeds
``gain_confidence_z`` standard deviations of the gain the job would actually
realise over the horizon: iteration times vary with the micro-batches' costs,
so over ``N = (H - pause) / iteration_s`` iterations a small predicted gain
(moving one micro-batch between two replicas) can come out negative. The
standard deviation comes from the cost model's paired Monte Carlo draws (the
same micro-batch stream under both layouts). Among the confident adaptations
the most goodput wins; eviction still wins within ``evict_tie_fraction`` of it,
and ``min_gain_fraction`` adds hysteresis against changing for nothing.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from faultlens.config import AdaptationConfig
from faultlens.models.costmodel import (
    IterationCostModel,
    JobShape,
    Layout,
    Prediction,
    pipeline_time,
    pipeline_time_bound,
)
from faultlens.stream.topology import Topology

SLOW_SPEED = 0.98  # a rank below this relative speed is treated as degraded


@dataclass(frozen=True)
class Option:
    """One option the planner considered, with its predicted figures."""

    name: str
    layout: Layout | None  # None for evict_restart (the healthy layout on new machines)
    iteration_s: float
    tokens_per_s: float
    pause_s: float
    goodput_tokens: float
    evict_nodes: tuple[str, ...] = ()
    # one standard deviation of the goodput gain over the default option that the
    # job would realise over the horizon (0: deterministic costs, or the default itself)
    gain_sd_tokens: float = 0.0

    def to_dict(self, healthy_tokens_per_s: float) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "predicted_tokens_per_s": round(self.tokens_per_s, 3),
            "predicted_iteration_s": round(self.iteration_s, 6) if math.isfinite(self.iteration_s) else None,
            "ratio_to_healthy": round(self.tokens_per_s / healthy_tokens_per_s, 4) if healthy_tokens_per_s else 0.0,
            "pause_s": round(self.pause_s, 3),
            "goodput_tokens": round(self.goodput_tokens, 1),
            "gain_sd_tokens": round(self.gain_sd_tokens, 1),
        }
        if self.layout is not None:
            out["layers_per_stage"] = list(self.layout.layers_per_stage)
            out["microbatches_per_replica"] = list(self.layout.microbatches_per_replica)
            out["tp_excluded_ranks"] = sorted(self.layout.tp_excluded)
        if self.evict_nodes:
            out["evict_nodes"] = list(self.evict_nodes)
        return out


@dataclass(frozen=True)
class Plan:
    """The planner's answer: the chosen option, every option considered, and why."""

    chosen: str
    layout: Layout  # for evict_restart: the healthy layout the restarted job runs
    tp_changes: tuple[dict[str, Any], ...]
    options: tuple[Option, ...]
    healthy_tokens_per_s: float
    horizon_s: float
    why: str
    evict_nodes: tuple[str, ...] = ()
    planning_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        return self.layout.layers_per_stage

    @property
    def microbatches_per_replica(self) -> tuple[int, ...]:
        return self.layout.microbatches_per_replica

    @property
    def evicts(self) -> bool:
        return self.chosen == "evict_restart"

    def option(self, name: str) -> Option:
        for o in self.options:
            if o.name == name:
                return o
        raise KeyError(name)

    @property
    def chosen_option(self) -> Option:
        return self.option(self.chosen)

    def to_dict(self) -> dict[str, Any]:
        """The ``Action.plan`` form (docs/actions.md)."""
        return {
            "layers_per_stage": list(self.layout.layers_per_stage),
            "microbatches_per_replica": list(self.layout.microbatches_per_replica),
            "tp_changes": [dict(c) for c in self.tp_changes],
            "options": [o.to_dict(self.healthy_tokens_per_s) for o in self.options],
            "chosen": self.chosen,
            "why": self.why,
            "horizon_s": self.horizon_s,
            "healthy_tokens_per_s": round(self.healthy_tokens_per_s, 3),
            "evict_nodes": list(self.evict_nodes),
            "planning_s": round(self.planning_s, 4),
            **self.extra,
        }


def requeue_seconds(machines: int, cfg: AdaptationConfig) -> float:
    """ByteRobust Table 7 requeue time, interpolated on log2(machines), clamped to the measured range."""
    x = min(max(math.log2(max(machines, 1)), 7.0), 10.0)  # 128..1,024 machines
    return cfg.requeue_s_at_128 + (cfg.requeue_s_at_1024 - cfg.requeue_s_at_128) * (x - 7.0) / 3.0


def restart_seconds(machines: int, evicted: int, spares: int, cfg: AdaptationConfig) -> float:
    """Warm standby if the pool covers every evicted machine, else a full requeue."""
    requeue = requeue_seconds(machines, cfg)
    return requeue / cfg.warm_standby_speedup if spares >= evicted > 0 else requeue


def partial_shares(current: tuple[int, ...], target: tuple[int, ...],
                   fractions: tuple[float, ...] = (0.25, 0.5, 0.75)) -> list[tuple[int, ...]]:
    """Micro-batch shares part of the way from ``current`` to ``target`` (same total), distinct, in order.

    Each donor replica gives ``floor(f * its reduction)``; the moved micro-batches
    go to the receivers by largest remainder of ``f * their increase``.
    """
    out: list[tuple[int, ...]] = []
    up = [max(0, t - c) for c, t in zip(current, target, strict=True)]
    for f in fractions:
        give = [math.floor(f * max(0, c - t)) for c, t in zip(current, target, strict=True)]
        moved = sum(give)
        if moved == 0:
            continue
        want = [f * u for u in up]
        take = [min(math.floor(w), u) for w, u in zip(want, up, strict=True)]
        by_remainder = sorted(range(len(up)), key=lambda d: (want[d] - take[d], up[d]), reverse=True)
        while sum(take) > moved:
            take[max(range(len(take)), key=lambda d: take[d])] -= 1
        for d in by_remainder * 2:
            if sum(take) >= moved:
                break
            if take[d] < up[d]:
                take[d] += 1
        share = tuple(c - g + k for c, g, k in zip(current, give, take, strict=True))
        if sum(take) == moved and share not in out and share != tuple(target) and share != tuple(current):
            out.append(share)
    return out


def min_max_partition(num_layers: int, layer_cost: list[float]) -> tuple[int, ...]:
    """Integer layers per stage (>= 1 each) minimising the slowest stage ``l_s * layer_cost[s]``.

    Greedy: give each next layer to the stage that stays fastest with it; optimal
    for costs linear in the layer count.
    """
    pp = len(layer_cost)
    layers = [1] * pp
    heap = [(2 * c, s) for s, c in enumerate(layer_cost)]
    heapq.heapify(heap)
    for _ in range(num_layers - pp):
        _, s = heapq.heappop(heap)
        layers[s] += 1
        heapq.heappush(heap, ((layers[s] + 1) * layer_cost[s], s))
    return tuple(layers)


def tp_exclusions(model: IterationCostModel, min_tp: int) -> frozenset[int]:
    """Ranks to leave out: per degraded TP group, the power-of-two kept size maximising k * min(p)."""
    t = model.topology
    excluded: set[int] = set()
    sizes = [k for k in (2 ** i for i in range(t.tp.bit_length())) if min_tp <= k <= t.tp]
    for group in t.groups("tp"):
        ranked = sorted(group, key=model.speed, reverse=True)
        if model.speed(ranked[-1]) >= SLOW_SPEED:
            continue
        best_k, best = t.tp, t.tp * max(model.speed(ranked[-1]), 0.0)
        for k in sizes:
            value = k * model.speed(ranked[k - 1])
            if value > best * (1 + 1e-9):
                best_k, best = k, value
        excluded.update(ranked[best_k:])
    return frozenset(excluded)


class AdaptationPlanner:
    """Search layouts around degraded GPUs; compare with eviction by goodput over a horizon."""

    def __init__(self, config: AdaptationConfig | None = None) -> None:
        self.config = config or AdaptationConfig()

    # ------------------------------------------------------------------ search pieces
    @staticmethod
    def rebalance(model: IterationCostModel, layers: tuple[int, ...], excluded: frozenset[int],
                  total: int) -> tuple[int, ...]:
        """Micro-batches per replica minimising the slowest replica, ``total`` kept, >= 1 each.

        Each replica's time is affine in its count: its pipeline time at the
        healthy count plus one steady-state slot (its slowest stage) per extra
        micro-batch; a greedy assignment is then optimal.
        """
        t, m0 = model.topology, model.shape.microbatches
        speeds = model.cell_speeds(excluded)
        layout = Layout(layers, (m0,) * t.dp, excluded)
        base, slope = [], []
        cache: dict[tuple[float, ...], tuple[float, float]] = {}
        for d in range(t.dp):
            key = tuple(speeds[d])
            if key not in cache:
                fwd, bwd = model.stage_times(layout, speeds[d])
                slot = max(f + b for f, b in zip(fwd, bwd, strict=True))
                base_s = (pipeline_time(fwd, bwd, m0, model.shape.p2p_s) if model.exact
                          else pipeline_time_bound(fwd, bwd, m0, model.shape.p2p_s))
                cache[key] = (base_s, slot)
            b, s = cache[key]
            base.append(b)
            slope.append(s)
        if not all(math.isfinite(s) for s in slope):
            return (m0,) * t.dp
        counts = [1] * t.dp
        heap = [(base[d] + (2 - m0) * slope[d], d) for d in range(t.dp)]
        heapq.heapify(heap)
        for _ in range(total - t.dp):
            _, d = heapq.heappop(heap)
            counts[d] += 1
            heapq.heappush(heap, (base[d] + (counts[d] + 1 - m0) * slope[d], d))
        return tuple(counts)

    def layer_candidates(self, model: IterationCostModel, excluded: frozenset[int]) -> list[tuple[int, ...]]:
        """Min-max partitions for blends of the replicas' mean and worst per-layer stage cost."""
        speeds = model.cell_speeds(excluded)
        pp, n = model.topology.pp, model.shape.num_layers
        inv = [[1.0 / v if v > 0 else 1e9 for v in row] for row in speeds]
        mean = [sum(row[s] for row in inv) / len(inv) for s in range(pp)]
        worst = [max(row[s] for row in inv) for s in range(pp)]
        out: list[tuple[int, ...]] = []
        for alpha in (0.0, 0.25, 0.5, 0.75, 1.0):
            cost = [(1 - alpha) * a + alpha * b for a, b in zip(mean, worst, strict=True)]
            cand = min_max_partition(n, cost)
            if cand not in out:
                out.append(cand)
        return out

    # ------------------------------------------------------------------ plan
    def plan(self, topology: Topology, shape: JobShape, speeds: Mapping[int, float], *,
             spares: int | None = None, horizon_s: float | None = None) -> Plan:
        """The best option for the next ``horizon_s`` seconds given ``spares`` warm machines."""
        started = time.perf_counter()
        cfg = self.config
        horizon = cfg.horizon_s if horizon_s is None else float(horizon_s)
        spares = cfg.spare_nodes if spares is None else int(spares)
        model = IterationCostModel(topology, shape, speeds)
        current = Layout.healthy(topology, shape)
        total_mb = sum(current.microbatches_per_replica)
        healthy = model.with_speeds({}).predict(current)

        tp_options: list[frozenset[int]] = [frozenset()]
        if cfg.allow_tp_shrink:
            shrink = tp_exclusions(model, max(1, cfg.min_tp))
            if shrink:
                tp_options.append(shrink)

        candidates: dict[str, list[Layout]] = {}

        def consider(name: str, layout: Layout) -> None:
            if layout not in candidates.setdefault(name, []):
                candidates[name].append(layout)

        for excluded in tp_options:
            tp_tag = ["shrink_tp"] if excluded else []
            layer_sets = [current.layers_per_stage]
            if cfg.allow_layer_repartition and topology.pp > 1:
                layer_sets += [c for c in self.layer_candidates(model, excluded) if c != current.layers_per_stage]
            for layers in layer_sets:
                pp_tag = ["repartition_layers"] if layers != current.layers_per_stage else []
                consider("+".join(tp_tag + pp_tag) or "no_action", Layout(layers, current.microbatches_per_replica, excluded))
                if cfg.allow_microbatch_rebalance and topology.dp > 1:
                    mbs = self.rebalance(model, layers, excluded, total_mb)
                    if mbs != current.microbatches_per_replica:
                        name = "+".join(tp_tag + pp_tag + ["rebalance_microbatches"])
                        # part of the way too: moving fewer micro-batches gains less but is surer
                        for share in (mbs, *partial_shares(current.microbatches_per_replica, mbs)):
                            consider(name, Layout(layers, share, excluded))

        scored: dict[str, list[tuple[Option, Prediction]]] = {}
        for name, layouts in candidates.items():
            for layout in layouts:
                pred = model.predict(layout)
                if name == "no_action":
                    pause = 0.0
                elif layout.tp_excluded or layout.layers_per_stage != current.layers_per_stage:
                    pause = cfg.reconfigure_s
                else:
                    pause = cfg.rebalance_s
                scored.setdefault(name, []).append(
                    (Option(name, layout, pred.iteration_s, pred.tokens_per_s, pause,
                            pred.tokens_per_s * max(0.0, horizon - pause)), pred))

        slow_ranks = [r for r, v in model.speeds.items() if v < SLOW_SPEED]
        evict_nodes = tuple(topology.nodes_of(slow_ranks)) if topology.placement else ()
        if slow_ranks:
            machines = len(topology.nodes) or max(1, topology.world_size // 8)
            restart = restart_seconds(machines, max(1, len(evict_nodes)), spares, cfg)
            after = model.with_speeds({r: v for r, v in model.speeds.items() if r not in set(slow_ranks)})
            pred = after.predict(current)  # the same Monte Carlo draws: paired with the others
            pause = restart + 0.5 * healthy.iteration_s  # in-memory checkpoint each step: lose ~half a step
            scored["evict_restart"] = [(Option("evict_restart", None, pred.iteration_s, pred.tokens_per_s, pause,
                                               pred.tokens_per_s * max(0.0, horizon - pause), evict_nodes), pred)]

        (no_action, na_pred), = scored.pop("no_action")
        evict_scored = scored.pop("evict_restart", [])
        evict: Option | None = evict_scored[0][0] if evict_scored else None
        evict_pred: Prediction | None = evict_scored[0][1] if evict_scored else None
        default, default_pred = no_action, na_pred
        if (evict is not None and evict_pred is not None and evict.goodput_tokens > 0
                and evict.goodput_tokens >= no_action.goodput_tokens * (1 - cfg.evict_tie_fraction)):
            default, default_pred = evict, evict_pred
        z = cfg.gain_confidence_z

        def with_sd(o: Option, pred: Prediction) -> Option:
            return o if o is default else replace(o, gain_sd_tokens=gain_sd_tokens(o, pred, default, default_pred,
                                                                                    horizon))

        def is_confident(o: Option) -> bool:
            gain = o.goodput_tokens - default.goodput_tokens
            return gain > 0 and gain > z * o.gain_sd_tokens

        no_action = with_sd(no_action, na_pred)
        evict = with_sd(evict, evict_pred) if evict is not None and evict_pred is not None else None
        default = evict if default.name != "no_action" and evict is not None else no_action
        # each family's representative: its most goodput among candidates sure to gain, else its most goodput
        adaptations: list[Option] = []
        for candidates_scored in scored.values():
            family = [with_sd(o, pred) for o, pred in candidates_scored]
            sure = [o for o in family if is_confident(o)]
            adaptations.append(max(sure or family, key=lambda o: o.goodput_tokens))
        options = [no_action, *adaptations, *([evict] if evict is not None else [])]
        options.sort(key=lambda o: (0 if o.name == "no_action" else 1 + o.name.count("+"), o.name))
        confident = [o for o in adaptations if is_confident(o)]
        winner = max([default, *confident], key=lambda o: o.goodput_tokens)
        if (evict is not None and evict is not winner and evict.goodput_tokens > 0
                and evict.goodput_tokens >= winner.goodput_tokens * (1 - cfg.evict_tie_fraction)):
            # Within the model's error eviction wins: it removes the cause, and
            # its cost is paid once while an adaptation pays if the fault outlasts the horizon.
            winner = evict
        if winner is not no_action and winner.goodput_tokens < no_action.goodput_tokens * (1 + cfg.min_gain_fraction):
            winner = no_action
        # the best adaptation by expectation, when it lost only for being inside its uncertainty
        unsure = max((o for o in adaptations if o not in confident and o.goodput_tokens > winner.goodput_tokens),
                     key=lambda o: o.goodput_tokens, default=None)
        layout = winner.layout or current
        why = self._why(winner, options, healthy.tokens_per_s, horizon, spares)
        if unsure is not None:
            why = why[:-1] + (f"; {unsure.name} is predicted {unsure.goodput_tokens - default.goodput_tokens:,.0f}"
                              f" tokens ahead of {default.name}, within {cfg.gain_confidence_z:g} standard"
                              f" deviations ({unsure.gain_sd_tokens:,.0f}) of what the job would realise.")
        plan = Plan(
            chosen=winner.name, layout=layout, tp_changes=tuple(self._tp_changes(model, layout.tp_excluded)),
            options=tuple(options), healthy_tokens_per_s=healthy.tokens_per_s, horizon_s=horizon, why=why,
            evict_nodes=winner.evict_nodes, planning_s=0.0,
            extra={"default": default.name, "gain_confidence_z": cfg.gain_confidence_z},
        )
        return _with_time(plan, time.perf_counter() - started)

    @staticmethod
    def _tp_changes(model: IterationCostModel, excluded: frozenset[int]) -> list[dict[str, Any]]:
        t = model.topology
        out = []
        for group in t.groups("tp"):
            gone = [r for r in group if r in excluded]
            if not gone:
                continue
            c = t.coords(group[0])
            change: dict[str, Any] = {"dp": c["dp"], "pp": c["pp"], "cp": c["cp"], "tp_from": t.tp,
                                      "tp_to": t.tp - len(gone), "excluded_ranks": gone,
                                      "kept_ranks": [r for r in group if r not in excluded]}
            if t.placement:
                change["excluded_gpus"] = [{"node": t.node_of(r), "gpu": t.gpu_of(r)} for r in gone]
            out.append(change)
        return out

    @staticmethod
    def _why(winner: Option, options: list[Option], healthy_tps: float, horizon: float, spares: int) -> str:
        ratio = winner.tokens_per_s / healthy_tps if healthy_tps else 0.0
        runner_up = max((o for o in options if o is not winner), key=lambda o: o.goodput_tokens, default=None)
        text = (f"{winner.name} is predicted at {winner.tokens_per_s:,.0f} tokens/s ({ratio:.1%} of fault-free)"
                f"{f' after a {winner.pause_s:.0f} s pause' if winner.pause_s else ''}, "
                f"{winner.goodput_tokens:,.0f} tokens over the {horizon:.0f} s horizon")
        if runner_up is not None:
            text += (f"; next best {runner_up.name} gives {runner_up.goodput_tokens:,.0f}"
                     f" ({runner_up.tokens_per_s:,.0f} tokens/s"
                     f"{f', {runner_up.pause_s:.0f} s pause' if runner_up.pause_s else ''})")
        evict = next((o for o in options if o.name == "evict_restart"), None)
        if evict is not None and winner is not evict:
            kind = "warm standby" if spares >= max(1, len(evict.evict_nodes)) else "requeue, no spare"
            text += f"; eviction would cost {evict.pause_s:.0f} s ({kind})"
        return text + "."


def gain_sd_tokens(option: Option, pred: Prediction, base: Option, base_pred: Prediction, horizon_s: float) -> float:
    """Standard deviation of the goodput gain of ``option`` over ``base`` that the job would realise.

    Over the horizon an option runs ``N = (H - pause) / mu`` iterations of mean
    time ``mu`` and trains ``tokens * (H - pause) / mean(X)`` tokens; linearised
    around ``mu``, the gain's fluctuation is ``a_o X_o - a_b X_b`` per iteration
    with ``a = tokens * (H - pause) / mu^2``, averaged over ``N`` iterations.
    ``X_o`` and ``X_b`` are the cost model's paired Monte Carlo samples (the same
    micro-batch stream), so what both layouts share cancels.
    """
    if pred.samples_s is None or not math.isfinite(pred.iteration_s) or option.goodput_tokens <= 0:
        return 0.0
    tokens = option.tokens_per_s * option.iteration_s

    def weight(o: Option, p: Prediction) -> tuple[float, float]:
        run = max(0.0, horizon_s - o.pause_s)
        return tokens * run / p.iteration_s ** 2, run / p.iteration_s

    a_o, n = weight(option, pred)
    fluctuation = a_o * pred.samples_s
    if base_pred.samples_s is not None and base.goodput_tokens > 0 and math.isfinite(base_pred.iteration_s):
        a_b, n_b = weight(base, base_pred)
        fluctuation = fluctuation - a_b * base_pred.samples_s
        n = min(n, n_b)
    return float(np.std(fluctuation) / math.sqrt(max(n, 1.0)))


def _with_time(plan: Plan, seconds: float) -> Plan:
    return replace(plan, planning_s=seconds)


__all__ = ["AdaptationPlanner", "Option", "Plan", "gain_sd_tokens", "min_max_partition", "partial_shares", "requeue_seconds",
           "restart_seconds", "tp_exclusions", "SLOW_SPEED"]
