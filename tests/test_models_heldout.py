"""The classifier is scored on a scenario family it never saw (issue 16): the split and a feature that must not
depend on the family's shape."""

from faultlens.datasets.suite import suite_specs
from faultlens.models.features import WindowFeatures
from faultlens.schema import NcclEvent
from faultlens.stream.topology import Topology

WATCHDOG = ("[rank{r}]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] [Rank {r}] Watchdog caught collective "
            "operation timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE, NumelIn=4, NumelOut=4, Timeout(ms)=600000) "
            "ran for 600060 milliseconds before timing out.")


def test_heldout_family_shares_no_shape_with_training():
    train = suite_specs(32, 11, min_nodes=2, max_nodes=8, family="train")
    test = suite_specs(16, 22, min_nodes=3, max_nodes=6, family="heldout")
    shape = lambda s: (s.cluster.gpus_per_node, s.cluster.nodes, s.sample_interval_s, s.kernel_format)  # noqa: E731
    for i in range(4):  # GPUs per node, node count, NVML interval, kernel log shape: none shared
        assert not {shape(s)[i] for s in train} & {shape(s)[i] for s in test}, i
    assert {s.sample_interval_s for s in train} == {1.0} and {s.sample_interval_s for s in test} == {5.0}
    assert min(s.cost.alpha_s_per_token for s in test) > 2 * max(s.cost.alpha_s_per_token for s in train)
    # the base family (the diagnosis benchmark's) is unchanged by the families
    assert [s.kernel_format for s in suite_specs(8, 11)] == [None] * 8


def test_watchdog_counts_do_not_grow_with_gpus_per_node():
    rows = {}
    for gpus in (4, 8):
        topo = Topology.packed(tp=gpus, pp=1, dp=2, gpus_per_node=gpus, job="j")
        wf = WindowFeatures()
        wf.set_topology(topo)
        recs = [NcclEvent(ts=100.0 + r * 0.01, node=topo.node_of(r), kind="watchdog_timeout", rank=r,
                          raw=WATCHDOG.format(r=r), job="j") for r in range(topo.world_size)]
        rows[gpus] = wf.window(recs, topo.nodes, end_ts=160.0)[topo.node_of(0)]
    assert rows[4]["nccl_timeout"] == rows[8]["nccl_timeout"] > 0
