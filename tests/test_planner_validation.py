"""The cost model against the simulator's step-time model (datasets/steptime.py), within 5%.

Random topologies, GPU speeds and plans (layer splits, micro-batch shares, TP
exclusions); micro-batch costs from the simulator's packed heavy-tailed
workload. Two checks: per iteration given each micro-batch's cost (what
ResiHP's iteration-time predictor does), and the mean of 30 iterations
predicted from the mean cost and its coefficient of variation only (what the
planner knows).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from faultlens.config import AdaptationConfig
from faultlens.datasets import steptime, workload
from faultlens.models.costmodel import IterationCostModel, JobShape, Layout
from faultlens.models.planner import AdaptationPlanner
from faultlens.stream.topology import Topology

STEPS = 30


def _random_case(r: random.Random):
    tp, pp, dp, cp = r.choice([2, 4, 8]), r.choice([1, 2, 4]), r.choice([1, 2, 4]), r.choice([1, 1, 2])
    topo = Topology.packed(tp, pp, dp, cp, gpus_per_node=8)
    num_layers, m = pp * r.randint(2, 6), r.choice([4, 8, 16])
    speeds = {x: r.uniform(0.3, 1.0) for x in r.sample(range(topo.world_size), min(3, r.randint(0, 3)))}
    layers = [1] * pp
    for _ in range(num_layers - pp):
        layers[r.randrange(pp)] += 1
    mbs = [1] * dp
    for _ in range(m * dp - dp):
        mbs[r.randrange(dp)] += 1
    excluded: set[int] = set()
    if speeds and r.random() < 0.5:
        slow = next(iter(speeds))
        others = [x for x in topo.group(slow, "tp") if x != slow]
        excluded = {slow, *r.sample(others, tp // 2 - 1)}
    return topo, num_layers, m, speeds, Layout(tuple(layers), tuple(mbs), frozenset(excluded))


@pytest.mark.parametrize("seed", range(4))
def test_predicted_iteration_time_within_5_percent_of_the_simulator(seed):
    r, rng = random.Random(seed), np.random.default_rng(seed)
    sim_cost = steptime.CostModel()
    worst_given, worst_mean = 0.0, 0.0
    for _ in range(12):
        topo, num_layers, m, speeds, layout = _random_case(r)
        total = sum(layout.microbatches_per_replica)
        mb = workload.pack(rng, STEPS * total, workload.WorkloadSpec())
        w = sim_cost.microbatch_cost(mb.tokens, mb.sum_len_sq).reshape(STEPS, total)
        speed = np.ones(topo.world_size)
        for rank, v in speeds.items():
            speed[rank] = v
        sim_plan = {"layers_per_stage": list(layout.layers_per_stage),
                    "microbatches_per_replica": list(layout.microbatches_per_replica),
                    "tp_excluded_gpus": sorted(layout.tp_excluded)}
        simulated, _ = steptime.iteration_times(topo, speed, sim_plan, w, sync_s=sim_cost.sync_s)

        w_mean = float(w.mean())
        shape = JobShape(num_layers=num_layers, microbatches=m, microbatch_s=w_mean * topo.pp,
                         tokens_per_microbatch=8192, dp_sync_s=sim_cost.sync_s, sync_grows_with_params=False,
                         microbatch_cv=float(w.std() / w_mean))
        model = IterationCostModel(topo, shape, speeds)
        bounds = np.concatenate([[0], np.cumsum(layout.microbatches_per_replica)])
        for i in range(STEPS):
            costs = [list(w[i, bounds[d]:bounds[d + 1]] / w_mean) for d in range(topo.dp)]
            predicted = model.predict(layout, microbatch_costs=costs).iteration_s
            worst_given = max(worst_given, abs(predicted - simulated[i]) / simulated[i])
        predicted_mean = model.predict(layout).iteration_s
        worst_mean = max(worst_mean, abs(predicted_mean - simulated.mean()) / simulated.mean())
    assert worst_given < 0.05
    assert worst_mean < 0.05


def test_a_wrong_model_would_fail_the_check():
    # the same comparison with TP exclusion ignored by the model is far off: the check can fail
    topo = Topology.packed(8, 2, 2)
    slow = topo.rank_of(tp=1, dp=0, pp=1)
    excluded = frozenset([slow, *[x for x in topo.group(slow, "tp") if x != slow][:3]])
    shape = JobShape(num_layers=8, microbatches=8, microbatch_s=0.2, tokens_per_microbatch=1, dp_sync_s=0.3,
                     sync_grows_with_params=False)
    costs = np.full((1, 16), 0.1)
    plan = {"layers_per_stage": [4, 4], "microbatches_per_replica": [8, 8], "tp_excluded_gpus": sorted(excluded)}
    simulated = steptime.iteration_time(topo, {slow: 0.3}, plan, costs[0], sync_s=0.3).iteration_s
    right = IterationCostModel(topo, shape, {slow: 0.3}).predict(Layout((4, 4), (8, 8), excluded)).iteration_s
    wrong = IterationCostModel(topo, shape, {slow: 0.3}).predict(Layout((4, 4), (8, 8))).iteration_s
    assert abs(right - simulated) / simulated < 0.01
    assert abs(wrong - simulated) / simulated > 0.05


def test_the_gain_uncertainty_matches_the_spread_the_simulator_realises():
    """The planner's standard deviation of a rebalance's realised gain, against many simulated windows.

    The planner sees 50 iterations of history; the simulator then runs 80
    windows of the horizon's iterations under both layouts (the same micro-batch
    stream). The spread of the realised gain must match the predicted one; an
    unpaired estimate (the layouts' variances added) would not.
    """
    topo = Topology.packed(2, 4, 2, gpus_per_node=8)
    slow = topo.rank_of(tp=1, dp=0, pp=2)
    speeds = {slow: 1 / 1.1}
    sim_cost, spec, rng = steptime.CostModel(), workload.WorkloadSpec(), np.random.default_rng(11)
    total = 2 * 16

    def draw(iterations: int) -> np.ndarray:
        mb = workload.pack(rng, iterations * total, spec)
        return sim_cost.microbatch_cost(mb.tokens, mb.sum_len_sq).reshape(iterations, total)

    history = draw(50)
    shape = JobShape(num_layers=16, microbatches=16, microbatch_s=float(history.mean()) * topo.pp,
                     tokens_per_microbatch=spec.tokens_per_microbatch, dp_sync_s=sim_cost.sync_s,
                     sync_grows_with_params=False, microbatch_cv=float(history.std() / history.mean()),
                     microbatch_cost_samples=tuple(history.ravel()))
    plan = AdaptationPlanner(AdaptationConfig(gain_confidence_z=0.0)).plan(topo, shape, speeds, spares=0,
                                                                             horizon_s=120.0)
    rebalance, no_action = plan.option("rebalance_microbatches"), plan.option("no_action")
    predicted_sd = rebalance.gain_sd_tokens / no_action.goodput_tokens
    n = round(120.0 / rebalance.iteration_s)
    windows = draw(80 * n)
    speed = np.ones(topo.world_size)
    speed[slow] = speeds[slow]
    sim = {"microbatches_per_replica": list(rebalance.layout.microbatches_per_replica)}
    a, _ = steptime.iteration_times(topo, speed, None, windows, sync_s=sim_cost.sync_s)
    b, _ = steptime.iteration_times(topo, speed, sim, windows, sync_s=sim_cost.sync_s)
    realised = a.reshape(80, n).mean(axis=1) / b.reshape(80, n).mean(axis=1) - 1.0
    assert 0.7 < realised.std() / predicted_sd < 1.4
    assert abs(realised.mean() - (rebalance.goodput_tokens / no_action.goodput_tokens - 1)) < 2 * predicted_sd
    unpaired = np.hypot(a.std() / a.mean(), b.std() / b.mean()) / np.sqrt(n)
    assert not 0.7 < realised.std() / unpaired < 1.4
