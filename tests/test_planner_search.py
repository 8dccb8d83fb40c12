"""The adaptation planner: each search piece against brute force, and the choice by goodput."""

from __future__ import annotations

import itertools
import random

import pytest

from faultlens.config import AdaptationConfig
from faultlens.models.costmodel import IterationCostModel, JobShape, Layout
from faultlens.models.planner import (
    AdaptationPlanner,
    min_max_partition,
    partial_shares,
    requeue_seconds,
    restart_seconds,
    tp_exclusions,
)
from faultlens.stream.topology import Topology


def _compositions(n: int, k: int):
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(k))


def test_min_max_partition_is_optimal():
    rng = random.Random(3)
    for _ in range(60):
        pp, n = rng.randint(1, 4), rng.randint(4, 14)
        if n < pp:
            continue
        cost = [rng.choice([1.0, 1.0, 1.25, 2.0, 3.3]) for _ in range(pp)]
        got = min_max_partition(n, cost)
        assert sum(got) == n and min(got) >= 1
        best = min(max(n_l * c for n_l, c in zip(comp, cost, strict=True)) for comp in _compositions(n, pp))
        assert max(n_l * c for n_l, c in zip(got, cost, strict=True)) == pytest.approx(best)


def test_paper_example_slow_middle_stage_sheds_layers():
    # ResiHP: (4,4,4) -> (5,2,5) when the middle stage runs at about half speed
    assert min_max_partition(12, [1.0, 2.0, 1.0]) == (5, 2, 5)


def test_rebalance_keeps_the_global_batch_and_matches_brute_force():
    topo = Topology.packed(tp=2, pp=2, dp=3, gpus_per_node=4)
    shape = JobShape(num_layers=4, microbatches=4, microbatch_s=1.0, tokens_per_microbatch=1)
    slow = topo.rank_of(tp=0, dp=1, pp=0)
    model = IterationCostModel(topo, shape, {slow: 0.5})
    mbs = AdaptationPlanner.rebalance(model, (2, 2), frozenset(), 12)
    assert sum(mbs) == 12 and min(mbs) >= 1 and mbs[1] < mbs[0]
    got = model.predict(Layout((2, 2), mbs)).iteration_s
    best = min(model.predict(Layout((2, 2), c)).iteration_s for c in _compositions(12, 3))
    assert got == pytest.approx(best)


def test_tp_exclusion_follows_k_times_min_speed():
    topo = Topology.packed(tp=8, pp=1, dp=2)
    shape = JobShape(num_layers=4, microbatches=4, microbatch_s=1.0, tokens_per_microbatch=1)

    def excluded(speed: float, min_tp: int = 1) -> frozenset[int]:
        return tp_exclusions(IterationCostModel(topo, shape, {3: speed}), min_tp)

    assert excluded(0.6) == frozenset()  # 8 * 0.6 > 4 * 1.0
    ex = excluded(0.3)  # 4 * 1.0 > 8 * 0.3: keep the four fastest
    assert 3 in ex and len(ex) == 4 and ex <= set(topo.group(3, "tp"))
    assert len(excluded(0.0)) == 4
    assert excluded(0.3, min_tp=8) == frozenset()


def test_restart_costs_follow_byterobust():
    cfg = AdaptationConfig()
    assert requeue_seconds(128, cfg) == pytest.approx(454)
    assert requeue_seconds(1024, cfg) == pytest.approx(768)
    assert 454 < requeue_seconds(300, cfg) < 768
    assert restart_seconds(1024, 1, 4, cfg) == pytest.approx(768 / 10.87)
    assert restart_seconds(1024, 5, 4, cfg) == pytest.approx(768)


JOB = Topology.packed(tp=8, pp=4, dp=4)
SHAPE = JobShape(num_layers=32, microbatches=16, microbatch_s=8.0, tokens_per_microbatch=8192,
                 p2p_s=0.01, dp_sync_s=0.3)
SLOW = JOB.rank_of(tp=2, dp=1, pp=2)


def _plan(speed: float, spares: int, horizon_s: float = 1800.0, **cfg):
    return AdaptationPlanner(AdaptationConfig(**cfg)).plan(JOB, SHAPE, {SLOW: speed}, spares=spares,
                                                           horizon_s=horizon_s)


def test_no_spare_adapts_around_a_slow_gpu():
    plan = _plan(1 / 1.4, spares=0)
    assert plan.chosen != "no_action" and not plan.evicts
    assert plan.chosen_option.tokens_per_s > plan.option("no_action").tokens_per_s * 1.2
    assert plan.microbatches_per_replica[1] < plan.microbatches_per_replica[0]
    assert sum(plan.microbatches_per_replica) == 64
    assert "requeue" in plan.why


def test_spare_and_long_fault_evicts():
    plan = _plan(1 / 1.6, spares=2, horizon_s=3600)
    assert plan.evicts and plan.evict_nodes == (JOB.node_of(SLOW),)


def test_slight_slowdown_short_horizon_is_left_alone():
    plan = _plan(1 / 1.01, spares=0, horizon_s=600)
    assert plan.chosen == "no_action"


def test_failed_gpu_without_spare_shrinks_tp():
    plan = _plan(0.0, spares=0)
    assert plan.chosen.startswith("shrink_tp")
    assert plan.tp_changes and plan.tp_changes[0]["tp_to"] == 4 and SLOW in plan.tp_changes[0]["excluded_ranks"]
    assert plan.option("no_action").tokens_per_s == 0.0


def test_chosen_option_has_the_most_goodput_and_every_option_is_reported():
    for speed, spares, horizon in itertools.product((0.0, 0.3, 0.6, 0.9), (0, 2), (600, 3600)):
        plan = _plan(speed, spares, horizon)
        names = {o.name for o in plan.options}
        assert {"no_action", "evict_restart"} <= names
        # a dead GPU cannot take any micro-batch: only leaving it out of TP helps
        assert ("rebalance_microbatches" in names) == (speed > 0)
        assert plan.chosen_option.goodput_tokens >= max(o.goodput_tokens for o in plan.options) / 1.01 - 1e-6
        assert plan.chosen in plan.why
        d = plan.to_dict()
        assert d["chosen"] == plan.chosen and len(d["options"]) == len(plan.options)


def test_disallowed_changes_are_not_considered():
    plan = _plan(0.3, spares=0, allow_tp_shrink=False, allow_layer_repartition=False)
    names = {o.name for o in plan.options}
    assert not any("shrink_tp" in n or "repartition" in n for n in names)


def test_pipeline_only_job_repartitions_layers():
    topo = Topology.packed(tp=8, pp=3, dp=1)
    shape = JobShape(num_layers=12, microbatches=24, microbatch_s=3.0, tokens_per_microbatch=4096)
    slow = topo.rank_of(tp=0, pp=1)
    plan = AdaptationPlanner(AdaptationConfig(allow_tp_shrink=False)).plan(topo, shape, {slow: 0.5}, spares=0)
    assert plan.chosen == "repartition_layers"
    assert plan.layers_per_stage == (5, 2, 5)


def test_partial_shares_move_part_of_the_way_keeping_the_total():
    assert partial_shares((32, 32), (30, 34)) == [(31, 33)]
    for share in partial_shares((16,) * 8, (17,) * 7 + (9,)):
        assert sum(share) == 128 and share[7] < 16 and all(16 <= x <= 17 for x in share[:7])
    assert partial_shares((4, 4), (4, 4)) == []


NOISY = JobShape(num_layers=32, microbatches=32, microbatch_s=8.0, tokens_per_microbatch=8192,
                 dp_sync_s=0.3, microbatch_cv=0.4)
TWO = Topology.packed(tp=8, pp=4, dp=2)
SLOW2 = TWO.rank_of(tp=1, dp=0, pp=1)


def _plan2(slowdown: float, horizon_s: float, z: float):
    cfg = AdaptationConfig(gain_confidence_z=z)
    return AdaptationPlanner(cfg).plan(TWO, NOISY, {SLOW2: 1 / (1 + slowdown)}, spares=0, horizon_s=horizon_s)


def test_a_gain_inside_its_uncertainty_is_not_taken():
    # 8% slow, two replicas, a 10-minute horizon: rebalancing is expected to gain ~1%,
    # but over ~70 iterations of heavy-tailed micro-batches it may well come out negative
    blind = _plan2(0.08, 600, z=0.0)
    assert blind.chosen == "rebalance_microbatches"
    careful = _plan2(0.08, 600, z=2.0)
    rebalance = careful.option("rebalance_microbatches")
    gain = rebalance.goodput_tokens - careful.option("no_action").goodput_tokens
    assert 0 < gain < 2.0 * rebalance.gain_sd_tokens
    assert careful.chosen == "no_action" and "standard deviations" in careful.why
    # an hour averages six times the iterations: the same gain becomes sure
    assert _plan2(0.08, 3600, z=2.0).chosen == "rebalance_microbatches"
    # a large slowdown gains far beyond the noise at once
    sure = _plan2(0.4, 600, z=2.0)
    assert sure.chosen == "rebalance_microbatches"
    assert sure.chosen_option.goodput_tokens - sure.option("no_action").goodput_tokens > 5 * sure.chosen_option.gain_sd_tokens


def test_deterministic_costs_carry_no_uncertainty():
    plan = _plan(1 / 1.4, spares=0)
    assert all(o.gain_sd_tokens == 0.0 for o in plan.options)
    assert plan.to_dict()["default"] == "no_action"
