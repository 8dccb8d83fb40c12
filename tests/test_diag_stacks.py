"""StackAggregator on real py-spy dumps (tests/fixtures/stacks/), normalisers, fail-slow rounds."""

import pytest

from faultlens.diagnosis.stacks import (
    NORMALISERS,
    FailSlowRounds,
    StackAggregator,
    fingerprint,
    normalise_frame,
    parse_pyspy,
    training_thread,
)
from faultlens.schema import StackDump
from faultlens.stream.topology import Topology

from .conftest import FIXTURES

HANG = FIXTURES / "stacks" / "eval_dataloader_hang"


def dump(rank, text, ts=100.0, error=None):
    return StackDump(ts=ts, job="j1", node="n", rank=rank, pid=1000 + rank, text=text, error=error)


def test_parse_real_dump_and_pick_training_thread():
    threads = parse_pyspy((HANG / "healthy.txt").read_text())
    assert [t.name for t in threads] == ["MainThread", "Thread-2"]
    assert threads[0].frames[0] == "broadcast (torch/distributed/distributed_c10d.py:1191)"
    assert training_thread(threads).name == "MainThread"


def test_native_frames_without_symbols_are_dropped():
    fp = fingerprint((HANG / "native.txt").read_text())
    assert fp.splitlines()[0] == "pthread_cond_timedwait (libc.so.6)"
    assert "0x7fa2" not in fp


@pytest.mark.parametrize("name, raw, expected", [
    ("address", "forward (model.py:10) <Tensor at 0x7f00deadbeef>", "0x?"),
    ("pid", "worker pid=12345 waiting", "pid=?"),
    ("thread_id", "Thread 688514 waits", "Thread ?"),
    ("rank_tag", "send_to rank 12", "rank?"),
])
def test_named_normalisers(name, raw, expected):
    pattern, repl = NORMALISERS[name]
    assert expected in pattern.sub(repl, raw)


def test_line_numbers_stripped_only_when_configured():
    frame = "eval_batch (deepspeed/runtime/pipe/engine.py:449)"
    assert normalise_frame(frame) == frame
    assert normalise_frame(frame, strip_line_numbers=True) == "eval_batch (deepspeed/runtime/pipe/engine.py)"


def test_thread_ids_and_pids_do_not_split_groups():
    a = (HANG / "healthy.txt").read_text()
    b = a.replace("688510", "599213").replace("688601", "599299")
    assert fingerprint(a) == fingerprint(b)


def test_outlier_rank_demarcated_to_its_machine():
    topo = Topology.packed(tp=4, pp=2, dp=2, gpus_per_node=8)  # 16 ranks on 2 nodes, the BLOOM excerpt's shape
    healthy, stuck = (HANG / "healthy.txt").read_text(), (HANG / "stuck.txt").read_text()
    dumps = [dump(r, stuck if r == 12 else healthy) for r in range(16)]
    v = StackAggregator().aggregate(dumps, topo)
    assert v.outliers == [12] and v.missing == []
    assert 12 in v.demarcation.ranks and v.nodes == ["n002"]  # smallest group on one machine
    assert "stack differs" in v.reasons[12]


def test_ranks_that_did_not_answer_are_outliers():
    topo = Topology.packed(tp=4, pp=2, dp=2, gpus_per_node=4)
    healthy = (HANG / "healthy.txt").read_text()
    dumps = [dump(r, healthy) for r in range(16) if r != 6] + [dump(6, "", error="timeout")]
    v = StackAggregator().aggregate(dumps, topo)
    assert v.outliers == [6] and v.missing == [6] and v.nodes == ["n002"]
    assert "timeout" in v.reasons[6]


def test_everyone_alike_names_nobody():
    topo = Topology.packed(tp=4, pp=2, dp=2, gpus_per_node=8)
    healthy = (HANG / "healthy.txt").read_text()
    v = StackAggregator().aggregate([dump(r, healthy) for r in range(16)], topo)
    assert v.outliers == [] and v.demarcation is None


def test_fail_slow_rounds_vote_for_the_degrader():
    topo = Topology.packed(tp=2, pp=4, dp=2, gpus_per_node=2)
    healthy, stuck = (HANG / "healthy.txt").read_text(), (HANG / "stuck.txt").read_text()
    rounds = FailSlowRounds(topo, rounds=5)
    agg = StackAggregator()
    # Rank 9 is slow and caught mid-compute in 4 of 5 rounds; round 3 catches an innocent rank 2 instead.
    for odd in (9, 9, 2, 9, 9):
        rounds.add_round(agg.aggregate([dump(r, stuck if r == odd else healthy) for r in range(16)], topo))
    assert rounds.complete
    d = rounds.degrader()
    assert 9 in d.ranks and 2 not in d.ranks and d.nodes == ("n005",)


def test_narrowed_to_the_odd_stack_when_the_group_is_the_whole_pipeline():
    # PP=4 over 4 machines: the stuck rank (22) and its pipeline peers (6, 14, 30, waiting on it) differ.
    topo = Topology.packed(tp=8, pp=4, dp=1, gpus_per_node=8)
    healthy, stuck = (HANG / "healthy.txt").read_text(), (HANG / "stuck.txt").read_text()
    waiting = healthy.replace("broadcast (torch/distributed/distributed_c10d.py:1191)", "recv (torch/distributed/distributed_c10d.py:1720)")
    texts = {r: healthy for r in range(32)} | {6: waiting, 14: waiting, 30: waiting, 22: stuck}
    v = StackAggregator().aggregate([dump(r, t) for r, t in texts.items()], topo)
    assert v.demarcation.dims == ("pp",) and len(v.demarcation.nodes) == 4
    assert v.narrowed.nodes == ("n003",) and 22 in v.narrowed.ranks
