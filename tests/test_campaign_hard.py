"""Hard renders of campaign failures (issue 35 item 7): partial hang evidence and cascades, decided by the real
engine and kept in their own cache beside the clean one."""

import json

import numpy as np
import pytest

from faultlens.datasets.campaign_hard import HARD, decide_hard, hard_digest, hard_spec, harden_hang
from faultlens.datasets.campaign_outcomes import _cache_file, code_digest, measure, sample_noise
from faultlens.datasets.campaign_render import PRIORITY, SliceLayout
from faultlens.datasets.scenario import Scenario
from faultlens.schema import KernelEvent, NcclEvent, StackDump

# 4 machines of 8 GPUs (the 8B campaign's slice) and a 600 s NCCL timeout: a hang renders in a few seconds
LAYOUT = SliceLayout(gpus_per_node=8, tp=8, pp=1, dp=4, num_layers=32, microbatches=8)
TIMEOUT = 600.0
NODES = {f"n{j:03d}" for j in range(1, 5)}


def _hung_task_render_losing_nodes_and_line() -> int:
    """The first render i of hung_task whose hardening silences whole nodes and loses the kernel line."""
    for i in range(40):
        seed, noise = sample_noise("hung_task", i)
        sc = Scenario(hard_spec("hung_task", LAYOUT, seed, "hang", TIMEOUT, noise))
        h = harden_hang(sc, "hung_task", np.random.default_rng([seed, 35]))
        if h.silent_nodes and h.kernel_line_lost:
            return i
    raise AssertionError("no such render in the first 40")


@pytest.mark.slow
def test_a_hung_task_with_silent_nodes_and_no_kernel_line_is_still_decided():
    i = _hung_task_render_losing_nodes_and_line()
    seed, noise = sample_noise("hung_task", i)
    r = decide_hard("hung_task", LAYOUT, seed, i, fault_class="hang", nccl_timeout_s=TIMEOUT, noise=noise)
    h, culprit = r.hardening, r.truth["faults"][0]["nodes"][0]
    assert h.family == "hang" and h.kernel_line_lost and 1 <= len(h.silent_nodes) <= 2
    assert culprit not in h.silent_nodes
    dumps = [x for x in r.records if isinstance(x, StackDump)]
    assert dumps and not {d.node for d in dumps} & set(h.silent_nodes)  # the silent nodes' dumps are absent
    assert not {d.rank for d in dumps} & set(h.dumps_dropped)
    assert {d.node for d in dumps} == NODES - set(h.silent_nodes)  # every other node answered
    kernel = [x for x in r.records if isinstance(x, KernelEvent)]
    assert not any("blocked for more than" in x.raw for x in kernel)  # the agent missed the line
    d = r.decision
    assert d.expected_action == "evict_nodes" and d.action in (*PRIORITY, "none")
    assert isinstance(d.right, bool) and d.path == "hard"


@pytest.mark.slow
def test_a_gpu_lost_cascade_carries_late_peer_errors_a_transient_and_the_culprits_repeats():
    seed, noise = sample_noise("gpu_lost", 0)
    r = decide_hard("gpu_lost", LAYOUT, seed, 0, fault_class="fail_stop", nccl_timeout_s=TIMEOUT, noise=noise)
    h, fault = r.hardening, r.truth["faults"][0]
    culprit, onset = fault["nodes"][0], float(fault["onset_ts"])
    others = NODES - {culprit}
    assert h.family == "cascade" and set(h.peer_errors) == others
    peer = [x for x in r.records if isinstance(x, NcclEvent) and "Got completion from peer" in x.raw]
    assert {x.node for x in peer} == others  # one NET/IB error on every other machine...
    assert min(x.ts for x in peer) > onset + TIMEOUT  # ...arriving after the NCCL timeout
    remote = [x for x in r.records if isinstance(x, NcclEvent) and "ncclRemoteError" in x.raw]
    assert {x.node for x in remote} >= others
    xid79 = [x for x in r.records if isinstance(x, KernelEvent) and x.node == culprit and x.xid == 79]
    assert len(xid79) >= 2 and max(x.ts for x in xid79) > onset + 20.0  # the culprit's Xid 79 again, later
    node, what = h.transient.split(" ")[1], h.transient.split(" ")[0]
    assert node != culprit and what in ("ib_flap", "aer_burst")
    assert any(isinstance(x, KernelEvent) and x.node == node and ("mlx5_core" in x.raw or "AER" in x.raw)
               for x in r.records)
    d = r.decision
    assert d.expected_action == "evict_nodes" and d.action in (*PRIORITY, "none") and isinstance(d.right, bool)


@pytest.mark.slow
def test_hard_renders_are_cached_apart_from_the_clean_ones(tmp_path):
    kinds = {"gpu_lost": "fail_stop"}
    kw = dict(nccl_timeout_s=TIMEOUT, job_dp=4, late_after_s=900.0, n_min=1, n_max=1, cache_dir=tmp_path)
    hard = measure(kinds, LAYOUT, hard=True, **kw)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [_cache_file(tmp_path, code_digest(), LAYOUT, TIMEOUT, 4, "gpu_lost", True).name]
    assert f"+{hard_digest()}-" in files[0] and files[0].endswith("-hard-gpu_lost.jsonl")
    assert hard.hard and hard.rendered == 1
    row = json.loads((tmp_path / files[0]).read_text())
    assert row["path"] == "hard" and row["bucket"] == 0
    again = measure(kinds, LAYOUT, hard=True, **kw)  # read back, not rendered again
    assert again.rendered == 0 and again.by_kind["gpu_lost"][0] == hard.by_kind["gpu_lost"][0]
    clean = _cache_file(tmp_path, code_digest(), LAYOUT, TIMEOUT, 4, "gpu_lost")
    assert clean.name != files[0] and not clean.exists()
    # a kind without a hard variant keeps its clean file
    assert "user_exception" not in HARD
    assert _cache_file(tmp_path, "d", LAYOUT, TIMEOUT, 4, "user_exception", True) == \
        _cache_file(tmp_path, "d", LAYOUT, TIMEOUT, 4, "user_exception")
