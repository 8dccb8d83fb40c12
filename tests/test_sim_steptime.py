"""The simulator's step-time model: the pure function the adaptation planner is validated against."""

from __future__ import annotations

import numpy as np
import pytest

from faultlens.datasets.cluster import ClusterSpec
from faultlens.datasets.scenario import FaultSpec, Scenario, ScenarioSpec
from faultlens.datasets.steptime import CostModel, iteration_time, iteration_times
from faultlens.datasets.workload import WorkloadSpec, pack
from faultlens.stream.topology import Topology

TOPO = Topology.packed(tp=4, pp=2, dp=2, gpus_per_node=8)  # 16 ranks on 2 nodes


def test_equal_stages_follow_1f1b_formula() -> None:
    w = 0.2
    it, comp = iteration_time(TOPO, None, None, [w] * 8, sync_s=0.3)
    assert it == pytest.approx((4 + 2 - 1) * w + 0.3)
    assert comp[0] == pytest.approx(4 * w) and len(comp) == 16


def test_slow_rank_gates_its_stage_and_only_it_computes_longer() -> None:
    w = 0.2
    it, comp = iteration_time(TOPO, {5: 0.8}, None, [w] * 8)
    # rank 5 is tp=1 of dp=1, pp=0: its stage is the bottleneck of replica 1
    assert it == pytest.approx(4 * w / 0.8 + w)
    assert comp[5] == pytest.approx(4 * w / 0.8)
    assert comp[4] == pytest.approx(4 * w)


def test_layers_microbatches_and_tp_exclusion() -> None:
    w = 0.1
    base = iteration_time(TOPO, {5: 0.5}, None, [w] * 8).iteration_s
    # fewer layers on the slow stage: (4, 12) of 16 -> stage 0 does half the work
    moved = iteration_time(TOPO, {5: 0.5}, {"layers_per_stage": [4, 12]}, [w] * 8).iteration_s
    assert moved < base
    # fewer micro-batches on the slow replica
    shifted = iteration_time(TOPO, {5: 0.5}, {"microbatches_per_replica": [6, 2]}, [w] * 8).iteration_s
    assert shifted < base
    # excluding the slow GPU from its TP group: the group runs at 3/4 speed, no longer gated by 0.5
    ex = iteration_time(TOPO, {5: 0.5}, {"tp_excluded_gpus": [5]}, [w] * 8)
    assert 5 not in ex.per_rank_compute_s
    assert ex.per_rank_compute_s[4] == pytest.approx(4 * w * 4 / 3)
    assert ex.iteration_s == pytest.approx(4 * w * 4 / 3 + w)
    with pytest.raises(ValueError):
        iteration_time(TOPO, None, {"microbatches_per_replica": [3, 3]}, [w] * 8)


def test_vectorised_matches_scalar() -> None:
    rng = np.random.default_rng(0)
    costs = rng.uniform(0.1, 0.4, (5, 8))
    speed = np.ones(16)
    speed[9] = 0.7
    plan = {"layers_per_stage": [10, 6]}
    its, comps = iteration_times(TOPO, speed, plan, costs)
    for k in range(5):
        one = iteration_time(TOPO, {9: 0.7}, plan, costs[k])
        assert one.iteration_s == pytest.approx(its[k])
        assert one.per_rank_compute_s[3] == pytest.approx(comps[k, 3])


def test_healthy_variability_from_sequence_lengths_alone() -> None:
    cost = CostModel()
    rng = np.random.default_rng(3)
    topo = Topology.packed(tp=8, pp=4, dp=4, gpus_per_node=8)
    mbs = pack(rng, 100 * 4 * 8, WorkloadSpec()).reshape(100, 32)
    assert (mbs.tokens == WorkloadSpec().tokens_per_microbatch).all()
    its, _ = iteration_times(topo, None, None, cost.microbatch_cost(mbs.tokens, mbs.sum_len_sq), sync_s=cost.sync_s)
    assert its.max() / its.min() >= 1.2


def test_scenario_follows_a_plan_applied_at_t() -> None:
    cluster = ClusterSpec(nodes=2, tp=4, pp=2, dp=2, microbatches=4)
    spec = ScenarioSpec(seed=5, cluster=cluster, duration_s=400,
                        faults=(FaultSpec(kind="thermal_throttle", onset_s=60, node="n001", gpu=1,
                                          params={"slowdown": 0.5}),))
    slow = Scenario(spec)
    adapted = Scenario(spec)
    t_plan = spec.start_ts + 200
    adapted.apply_plan(t_plan, {"tp_excluded_gpus": [1]})
    a, b = slow.steps, adapted.steps
    before = a.end < t_plan - 30
    assert np.allclose(a.duration[before], b.duration[: before.sum()])
    after_a = a.duration[a.start > t_plan].mean()
    after_b = b.duration[b.start > t_plan].mean()
    assert after_b < 0.85 * after_a
    assert b.excluded[b.start > t_plan][:, 1].all()
