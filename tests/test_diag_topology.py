"""Parallel groups against Megatron-LM's documented example (initialize_model_parallel docstring).

16 GPUs, TP=2, PP=4 (so DP=2). Megatron's docstring lists:
  data-parallel:     [g0,g2] [g1,g3] [g4,g6] [g5,g7] [g8,g10] [g9,g11] [g12,g14] [g13,g15]
  tensor-parallel:   [g0,g1] [g2,g3] ... [g14,g15]
  pipeline-parallel: [g0,g4,g8,g12] [g1,g5,g9,g13] [g2,g6,g10,g14] [g3,g7,g11,g15]
"""

import pytest

from faultlens.diagnosis.topology import (
    composite_group,
    groups,
    groups_of,
    make_topology,
    smallest_group,
)
from faultlens.stream.topology import Topology

MEGATRON_DP = [(0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 14), (13, 15)]
MEGATRON_TP = [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11), (12, 13), (14, 15)]
MEGATRON_PP = [(0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15)]


@pytest.mark.parametrize("order", ["tp-dp-pp", "tp-cp-dp-pp"])
def test_megatron_documented_groups(order):
    topo = make_topology(tp=2, pp=4, dp=2, gpus_per_node=8, order=order)
    assert sorted(groups(topo, "tp")) == MEGATRON_TP
    assert sorted(groups(topo, "pp")) == MEGATRON_PP
    assert sorted(groups(topo, "dp")) == MEGATRON_DP
    assert groups_of(topo, 5) == {"tp": (4, 5), "cp": (5,), "dp": (5, 7), "pp": (1, 5, 9, 13)}


def test_cp_sits_between_tp_and_dp():
    topo = Topology.packed(tp=2, pp=2, dp=2, cp=2, gpus_per_node=8)
    assert topo.group(0, "cp") == (0, 2)
    assert topo.group(0, "dp") == (0, 4)
    assert topo.group(0, "pp") == (0, 8)


def test_smallest_group_of_pipeline_outliers_is_their_pp_group():
    # ByteRobust Fig. 7 shape: the last pipeline stages of one pipeline differ.
    topo = Topology.packed(tp=2, pp=4, dp=2, gpus_per_node=2)  # one TP group per machine
    d = smallest_group(topo, [9, 13])
    assert d.dims == ("pp",) and d.ranks == (1, 5, 9, 13)
    assert d.nodes == ("n001", "n003", "n005", "n007")


def test_single_outlier_demarcates_its_own_machine():
    topo = Topology.packed(tp=8, pp=2, dp=2, gpus_per_node=8)
    d = smallest_group(topo, [11])
    assert d.dims == ("tp",) and d.nodes == ("n002",)


def test_outliers_in_no_single_group_fall_back_to_a_composite_group():
    topo = Topology.packed(tp=2, pp=2, dp=2, gpus_per_node=2)
    d = smallest_group(topo, [0, 5])  # differ in tp and pp, same dp
    assert set(d.dims) == {"tp", "pp"}
    assert set(d.ranks) == set(composite_group(topo, 0, ("tp", "pp"))) == {0, 1, 4, 5}
    everything = smallest_group(Topology.packed(tp=2, pp=2, dp=2, cp=2, gpus_per_node=2), [0, 15])
    assert everything.label == "job"
