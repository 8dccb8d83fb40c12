"""The iteration-time cost model: 1F1B critical path, cell speeds, layout checks."""

from __future__ import annotations

import itertools
import random

import pytest

from faultlens.models.costmodel import (
    IterationCostModel,
    JobShape,
    Layout,
    even_layers,
    pipeline_time,
    pipeline_time_bound,
)
from faultlens.stream.topology import Topology


def test_uniform_pipeline_matches_the_textbook_1f1b_time():
    # pp stages of equal cost c: (m + pp - 1) slots of c
    for pp, m in itertools.product((1, 2, 4, 8), (1, 3, 8, 16)):
        fwd, bwd = [1.0] * pp, [2.0] * pp
        assert pipeline_time(fwd, bwd, m) == pytest.approx(3.0 * (m + pp - 1))
        assert pipeline_time_bound(fwd, bwd, m) == pytest.approx(3.0 * (m + pp - 1))


def test_exact_time_never_exceeds_the_closed_form_bound_and_grows_with_load():
    rng = random.Random(7)
    for _ in range(200):
        pp, m = rng.randint(1, 6), rng.randint(1, 12)
        fwd = [rng.uniform(0.2, 2.0) for _ in range(pp)]
        bwd = [2 * f for f in fwd]
        exact = pipeline_time(fwd, bwd, m, p2p_s=0.01)
        assert exact <= pipeline_time_bound(fwd, bwd, m, p2p_s=0.01) + 1e-9
        # the slowest stage must run all its micro-batches
        assert exact >= m * max(f + b for f, b in zip(fwd, bwd, strict=True)) - 1e-9
        assert pipeline_time(fwd, bwd, m + 1, p2p_s=0.01) > exact


def test_microbatch_costs_scale_the_work():
    fwd, bwd = [1.0, 1.0], [2.0, 2.0]
    assert pipeline_time(fwd, bwd, 4, costs=[2.0] * 4) == pytest.approx(2 * pipeline_time(fwd, bwd, 4))
    with pytest.raises(ValueError):
        pipeline_time(fwd, bwd, 4, costs=[1.0] * 3)


def test_healthy_prediction_and_tokens():
    topo = Topology.packed(tp=8, pp=4, dp=2)
    shape = JobShape(num_layers=32, microbatches=8, microbatch_s=4.0, tokens_per_microbatch=4096, dp_sync_s=0.5)
    pred = IterationCostModel(topo, shape).predict(Layout.healthy(topo, shape))
    # each stage: 1 s per micro-batch; 8 + 4 - 1 slots; plus the sync
    assert pred.iteration_s == pytest.approx(11.0 + 0.5)
    assert pred.tokens_per_s == pytest.approx(4096 * 16 / 11.5)


def test_slow_gpu_slows_its_cell_and_tp_exclusion_trades_width_for_speed():
    topo = Topology.packed(tp=8, pp=2, dp=2)
    shape = JobShape(num_layers=8, microbatches=4, microbatch_s=2.0, tokens_per_microbatch=1)
    slow = topo.rank_of(tp=3, dp=1, pp=1)
    model = IterationCostModel(topo, shape, {slow: 0.3})
    speeds = model.cell_speeds()
    assert speeds[1][1] == pytest.approx(0.3) and speeds[0][0] == 1.0
    group = topo.group(slow, "tp")
    excluded = frozenset([slow, *[r for r in group if r != slow][:3]])
    assert model.cell_speeds(excluded)[1][1] == pytest.approx(0.5)
    healthy = Layout.healthy(topo, shape)
    shrunk = Layout(healthy.layers_per_stage, healthy.microbatches_per_replica, excluded)
    assert model.predict(shrunk).iteration_s < model.predict(healthy).iteration_s
    # a failed GPU stops the job unless it is left out
    dead = IterationCostModel(topo, shape, {slow: 0.0})
    assert dead.predict(healthy).tokens_per_s == 0.0
    assert dead.predict(shrunk).tokens_per_s > 0.0


def test_sync_grows_with_the_largest_parameter_share():
    topo = Topology.packed(tp=4, pp=2, dp=2, gpus_per_node=4)
    shape = JobShape(num_layers=8, microbatches=4, microbatch_s=1.0, tokens_per_microbatch=1, dp_sync_s=1.0)
    model = IterationCostModel(topo, shape)
    assert model.predict(Layout((4, 4), (4, 4))).sync_s == pytest.approx(1.0)
    assert model.predict(Layout((6, 2), (4, 4))).sync_s == pytest.approx(1.5)
    half = frozenset(topo.group(0, "tp")[2:])
    assert model.predict(Layout((4, 4), (4, 4), half)).sync_s == pytest.approx(2.0)


def test_cp_ranks_belong_to_the_same_cell():
    topo = Topology.packed(tp=2, pp=2, dp=2, cp=2, gpus_per_node=8)
    shape = JobShape(num_layers=4, microbatches=2, microbatch_s=1.0, tokens_per_microbatch=1)
    slow = topo.rank_of(tp=1, cp=1, dp=0, pp=1)
    speeds = IterationCostModel(topo, shape, {slow: 0.5}).cell_speeds()
    assert speeds == [[1.0, 0.5], [1.0, 1.0]]


def test_bad_layouts_are_refused():
    topo = Topology.packed(tp=8, pp=4, dp=2)
    shape = JobShape(num_layers=16, microbatches=4, microbatch_s=1.0, tokens_per_microbatch=1)
    model = IterationCostModel(topo, shape)
    for bad in (Layout((4, 4, 4), (4, 4)), Layout((5, 4, 4, 4), (4, 4)), Layout((8, 8, 0, 0), (4, 4)),
                Layout((4, 4, 4, 4), (8, 0)), Layout((4, 4, 4, 4), (4, 4, 4))):
        with pytest.raises(ValueError):
            model.predict(bad)
    assert even_layers(10, 4) == (3, 3, 2, 2)
    with pytest.raises(ValueError):
        even_layers(3, 4)


def test_shape_from_an_observed_iteration_round_trips():
    topo = Topology.packed(tp=8, pp=4, dp=4)
    shape = JobShape(num_layers=32, microbatches=16, microbatch_s=3.0, tokens_per_microbatch=8192,
                     p2p_s=0.02, dp_sync_s=0.4)
    pred = IterationCostModel(topo, shape).predict(Layout.healthy(topo, shape))
    back = JobShape.from_iteration(topo, pred.iteration_s, 8192 * 16 * 4, num_layers=32, microbatches=16,
                                   p2p_s=0.02, dp_sync_s=0.4)
    assert back.microbatch_s == pytest.approx(3.0)
    assert back.tokens_per_microbatch == 8192
