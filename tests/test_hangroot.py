"""The root of a hang (diagnosis/hangroot.py) and Flight Recorder dumps (faultlens/flightrec.py), issue 23.

Recorded cases: hang directories of tests/hangcases.py (one per stuck kind) through the batch
path, Flight Recorder fixtures (tests/fixtures/flight_recorder, their source in make_fixtures.py)
in pickle and JSON of versions 1.5, 2.4 and 2.8, and a pickle that runs code when loaded.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest

from faultlens import flightrec
from faultlens.collectors import flight_recorder
from faultlens.collectors.batch import read_batch_dir
from faultlens.config import Config, load_config
from faultlens.diagnosis import hangroot
from faultlens.diagnosis.batch import diagnose_records
from faultlens.errors import CatalogError
from faultlens.stream.topology import Topology
from tests.hangcases import HangCase, cases, write_case

FR = Path(__file__).parent / "fixtures" / "flight_recorder"
CAT = hangroot.load_frames()


def _state(frames: list[str], extra: str = "") -> hangroot.RankState:
    text = 'Process 1: python train.py\n\nThread 0x1 (active): "MainThread"\n' + "".join(f"    {f}\n" for f in frames)
    return hangroot.rank_state(0, text + extra, CAT)


@pytest.mark.parametrize("frames, category", [
    (["synchronize (torch/cuda/__init__.py:801)", "step (train.py:9)"], "device"),
    (["synchronize (/opt/conda/lib/python3.11/site-packages/torch/cuda/streams.py:224)"], "device"),
    (["cudaStreamSynchronize (libcudart.so.12)", "at::native::_local_scalar_dense_cuda (libtorch_cuda.so)"], "device"),
    (["wait (threading.py:324)", "get (queue.py:180)", "_try_get_data (torch/utils/data/dataloader.py:1133)"], "input"),
    (["_read (megatron/core/datasets/indexed_dataset.py:241)", "__getitem__ (megatron/core/datasets/gpt_dataset.py:143)"],
     "input"),
    (["write (torch/serialization.py:619)", "_save (torch/serialization.py:853)"], "storage"),
    (["_write_files_from_queue (torch/distributed/checkpoint/filesystem.py:310)"], "storage"),
    (["wait (torch/distributed/distributed_c10d.py:4399)", "finish_grad_sync (x.py:1)"], "comm"),
    (["all_reduce (deepspeed/comm/torch.py:158)"], "comm"),
    (["_reduce_scatter_base (/usr/lib/python3/dist-packages/torch/distributed/distributed_c10d.py:3310)"], "comm"),
    (["barrier (torch/distributed/distributed_c10d.py:3900)"], "comm"),
    (["get (torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py:80)"], "comm"),
    (["_pack_sequences (/workspace/data/packing.py:118)", "step (loop.py:61)"], "python"),
])
def test_frames_are_classified_from_the_catalog(frames, category):
    assert _state(frames).category == category


def test_p2p_direction_is_the_outermost_pipeline_step():
    st = _state(["wait (torch/distributed/distributed_c10d.py:1)", "_communicate (megatron/core/pipeline_parallel/p2p_communication.py:381)",
                 "recv_forward (megatron/core/pipeline_parallel/p2p_communication.py:412)"])
    assert (st.category, st.points) == ("comm", "prev")
    st = _state(["recv (deepspeed/runtime/pipe/p2p.py:84)", "_exec_recv_grads (deepspeed/runtime/pipe/engine.py:1097)"])
    assert (st.category, st.points) == ("comm", "next")


def test_a_subprocess_stuck_in_a_read_counts_for_its_rank_an_idle_worker_does_not():
    main = ["get (queue.py:180)", "_next_data (torch/utils/data/dataloader.py:1332)"]
    stuck_child = ("\nProcess 2: python train.py\n\nThread 2 (idle): \"MainThread\"\n"
                   "    read (/workspace/data/shard_reader.py:77)\n    _worker_loop (torch/utils/data/_utils/worker.py:308)\n")
    idle_child = ("\nProcess 3: python train.py\n\nThread 3 (idle): \"MainThread\"\n"
                  "    get (multiprocessing/queues.py:103)\n    _worker_loop (torch/utils/data/_utils/worker.py:275)\n")
    assert _state(main, stuck_child + idle_child).children and "read" in _state(main, stuck_child).children[0]
    assert _state(main, idle_child).children == ()


def test_a_bad_catalog_entry_is_named():
    with pytest.raises(CatalogError, match="frame\\[0\\] x: category"):
        hangroot.parse_frames_catalog({"frame": [{"name": "x", "category": "gpu", "func": "a"}]})


def _states(topo: Topology, odd: dict[int, hangroot.RankState]) -> dict[int, hangroot.RankState]:
    wait = hangroot.RankState(0, "comm", "work_wait", "wait (torch/distributed/distributed_c10d.py:1)")
    return {r: odd.get(r, hangroot.RankState(r, wait.category, wait.rule, wait.frame)) for r in range(topo.world_size)}


def test_the_stuck_rank_outranks_its_waiting_peers_with_no_tie():
    topo = Topology.packed(tp=8, pp=1, dp=4)
    odd = {13: hangroot.RankState(13, "device", "cuda_synchronize", "synchronize (torch/cuda/__init__.py:954)")}
    odd.update({r: hangroot.RankState(r, "comm", "c10d_collective", "broadcast (torch/distributed/distributed_c10d.py:1)")
                for r in range(8, 16) if r != 13})
    ranking = hangroot.rank_roots(_states(topo, odd), topo, majority=[r for r in range(32) if not 8 <= r < 16])
    assert ranking.roots == ["n002"]
    assert ranking.rank_scores[13] > max(v for r, v in ranking.rank_scores.items() if r != 13)
    assert any("waiting on the GPU" in x for x in ranking.suspects[0].reasons)


def test_the_pipeline_chain_leads_to_the_stage_the_others_wait_for():
    topo = Topology.packed(tp=1, pp=4, dp=1, gpus_per_node=1)
    states = {0: hangroot.RankState(0, "comm", "p2p", "recv_backward (x:1)", "next"),
              1: hangroot.RankState(1, "comm", "p2p", "recv_backward (x:1)", "next"),
              2: hangroot.RankState(2, "python", "", "forward (model.py:1)"),
              3: hangroot.RankState(3, "comm", "p2p", "recv_forward (x:1)", "prev")}
    ranking = hangroot.rank_roots(states, topo, majority=[0, 1])
    assert ranking.roots == ["n003"]
    assert any("p2p waits of 3 pipeline rank(s)" in x for x in ranking.suspects[0].reasons)


def test_equal_evidence_on_several_machines_singles_none_out():
    topo = Topology.packed(tp=8, pp=1, dp=8)
    odd = {r: hangroot.RankState(r, "device", "cuda_synchronize", "synchronize (torch/cuda/__init__.py:954)")
           for r in (3, 11, 19)}
    ranking = hangroot.rank_roots(_states(topo, odd), topo, allowed=2)
    assert ranking.roots == [] and "more than 2" in ranking.why_not


# --------------------------------------------------------------------------- Flight Recorder


def _summaries(d: Path) -> dict[int, dict]:
    out = {}
    for f in sorted(d.iterdir()):
        s = flightrec.summarise(flightrec.loads(f.read_bytes()), flightrec.rank_from_name(f.name))
        out[s["rank"]] = s
    return out


def test_flight_recorder_json_v2_8_names_the_rank_that_never_entered():
    summ = _summaries(FR / "v2.8-json")
    assert sorted(summ) == [0, 1, 2, 3] and summ[0]["version"] == "2.8"
    missing = flightrec.wavefront(summ)
    assert list(missing) == [2] and "never entered collective #3" in missing[2][0]


def test_flight_recorder_pickle_v2_4_names_the_rank_whose_gpu_never_started():
    summ = _summaries(FR / "v2.4-pickle")
    assert sorted(summ) == [4, 5, 6, 7]
    assert all("2" not in s["pgs"] for s in summ.values())  # the p2p entry is not a collective
    missing = flightrec.wavefront(summ)
    assert list(missing) == [5] and "scheduled but never started" in missing[5][0]


def test_flight_recorder_pickle_v1_5_seq_id():
    missing = flightrec.wavefront(_summaries(FR / "v1.5-pickle"))
    assert list(missing) == [1] and "its last is #6" in missing[1][0]


def test_a_pickle_that_runs_code_is_refused_and_nothing_runs():
    data = (FR / "malicious.pkl").read_bytes()
    with pytest.raises(flightrec.FlightRecorderError, match=r"refused to load (builtins|__builtin__)\.exec"):
        flightrec.loads(data)
    assert "_fr_pwned" not in vars(sys.modules["faultlens"])
    try:  # the fixture is live: plain pickle runs it
        pickle.loads(data)  # noqa: S301 - proving the fixture would run code
        assert vars(sys.modules["faultlens"]).pop("_fr_pwned") is True
    finally:
        vars(sys.modules["faultlens"]).pop("_fr_pwned", None)


def test_not_a_dump_is_a_clear_error():
    with pytest.raises(flightrec.FlightRecorderError, match="not a Flight Recorder dump"):
        flightrec.loads(b'{"hello": 1}')
    with pytest.raises(flightrec.FlightRecorderError, match="not a readable pickle"):
        flightrec.loads(b"\x80\x04garbage")


def test_the_agent_collects_the_dumps_its_ranks_left(tmp_path):
    prefix = str(tmp_path / "nccl_trace_rank_")
    (tmp_path / "nccl_trace_rank_5").write_bytes((FR / "v2.4-pickle" / "nccl_trace_rank_5").read_bytes())
    (tmp_path / "nccl_trace_rank_6").write_bytes((FR / "malicious.pkl").read_bytes())
    got = flight_recorder.collect("j", "n1", [(5, prefix), (6, prefix), (7, prefix)])
    assert [(d.rank, d.error is None) for d in got] == [(5, True), (6, False)]
    assert flightrec.from_text(got[0].text)["rank"] == 5 and "refused" in (got[1].error or "")


def test_a_batch_directorys_flight_recorder_folder_is_read_and_bad_files_reported(tmp_path):
    case = HangCase(name="fr-read", nodes=4, tp=8, pp=1, dp=4, stuck={13: "cuda_sync"}, flight="json", stacks=False)
    d = write_case(case, tmp_path / "d")
    (d / "flight_recorder" / "nccl_trace_rank_99").write_bytes((FR / "malicious.pkl").read_bytes())
    data = read_batch_dir(d)
    fr = [s for s in data.stacks if s.text.startswith(flightrec.MARKER)]
    assert len(fr) == 32
    assert any("nccl_trace_rank_99" in e and "refused" in e for e in data.errors)


# --------------------------------------------------------------------------- end to end


def _diagnose(case: HangCase, tmp: Path):
    d = write_case(case, tmp / case.name)
    data = read_batch_dir(d)
    return diagnose_records(data.job, list(data.records()), Config())


CASES = {c.name: c for c in cases()}


@pytest.mark.parametrize("name", ["cuda-sync-tp4-pp2-dp4", "dataloader-tp8-dp8", "worker-subprocess-read",
                                  "ckpt-save-tp8-dp8", "pipeline8-stage5-read", "two-stuck-one-node",
                                  "silent-node-tp8-dp8", "nccl-kernel-fr-pickle", "fr-only-json-v2.2-cuda",
                                  "dcp-fsync-thread-fsdp", "cp2-tp4-cuda"])
def test_a_hang_evicts_the_stuck_ranks_machine_only(name, tmp_path):
    case = CASES[name]
    incidents, actions = _diagnose(case, tmp_path)
    evictions = [a for a in actions if a.type == "evict_nodes"]
    assert evictions and set(evictions[0].nodes) == case.culprits(), [(a.type, a.nodes, a.reason) for a in actions]
    hang = next(i for i in incidents if i.kind == "hang")
    top = max(hang.suspects, key=lambda s: s["score"])
    assert top["node"] in evictions[0].nodes  # the headline is the machine the action names
    scores = sorted((s["score"] for s in hang.suspects), reverse=True)
    assert len(scores) < 2 or scores[0] > scores[len(case.culprits())]  # no tie with a healthy machine
    assert hang.summary.startswith("hang rooted at")


def test_when_the_guard_refuses_the_eviction_the_job_is_not_left_on_notify(tmp_path):
    case = CASES["cuda-sync-tp8-dp4"]
    d = write_case(case, tmp_path / "d")
    data = read_batch_dir(d)
    config = load_config(env={}, overrides=["guard.min_confidence_evict=0.99"])  # every eviction refused
    _, actions = diagnose_records(data.job, list(data.records()), config)
    types = [a.type for a in actions]
    assert "evict_nodes" not in types and "run_diagnostics" in types
    diag = next(a for a in actions if a.type == "run_diagnostics")
    assert diag.nodes == sorted(case.culprits())


def test_identical_stacks_and_no_other_evidence_restart_with_diagnostics_not_notify(tmp_path):
    case = HangCase(name="no-evidence", nodes=4, tp=1, pp=1, dp=32, framework="ddp", stuck={9: "nccl_kernel"},
                    gpu_evidence=False)
    _, actions = _diagnose(case, tmp_path)
    # nothing names a machine: a job-level restart with stop-time diagnostics (diagnosis.guard.job_level),
    # never a node-targeted action with no node, never notify alone
    acted = [a for a in actions if a.type != "notify"]
    assert [a.type for a in acted] == ["restart_job"]
    assert acted[0].plan and acted[0].plan.get("diagnostics_requested") is True


def test_every_rank_waiting_on_input_is_a_job_wide_stall_notified_not_a_restart(tmp_path):
    case = HangCase(name="input-stall", nodes=4, tp=1, pp=1, dp=32, framework="ddp",
                    stuck={r: "dataloader" for r in range(32)}, gpu_evidence=False)
    incidents, actions = _diagnose(case, tmp_path)
    hang = next(i for i in incidents if i.kind == "hang")
    assert [a.type for a in actions] == ["notify"] and "job-wide input stall" in actions[0].reason, hang.summary


def test_a_subprocess_dump_file_joins_its_ranks_dump(tmp_path):
    case = HangCase(name="child-file", nodes=4, tp=8, pp=1, dp=4, stuck={13: "dataloader"})
    d = write_case(case, tmp_path / "d")
    (d / "stacks" / "13.worker-0.txt").write_text(
        'Thread 77 (idle): "MainThread"\n    readinto (/workspace/data/shard_reader.py:77)\n'
        "    __getitem__ (/workspace/data/jsonl_dataset.py:30)\n")
    data = read_batch_dir(d)
    dump = next(s for s in data.stacks if s.rank == 13)
    assert not data.errors and "Process 0: 13.worker-0.txt" in dump.text
    st = hangroot.rank_state(13, dump.text, CAT)
    assert st.category == "input" and "readinto" in st.children[0]


def test_a_hang_rooted_on_a_machine_with_a_hung_task_is_that_tasks_incident(tmp_path):
    """Recorded after the merges (benchmarks/diagnosis.py --quick, hung_task 0/2): rank 31 blocked in a dataset
    read on n004, whose kernel reported the hung task. The hang's stacks singled out n004 and evicted it while
    the hung task (weak, waiting for the job's other nodes) later sent the same machine to diagnostics: two
    actions for one stall. The hung task is the cause; the hang is muted into it; one action on n004: an eviction
    (issue 35), since the stacks and the kernel name the same machine and no other node stalls."""
    import subprocess

    out = tmp_path / "ht"
    subprocess.run([sys.executable, "-m", "faultlens.cli", "simulate", "scenario", "--fault", "hung_task",
                    "--seed", "11", "--out", str(out)], check=True, capture_output=True)
    data = read_batch_dir(out)
    incidents, actions = diagnose_records(data.job, list(data.records()), load_config(env={}))
    acted = [(a.type, a.nodes) for a in actions if a.type != "notify"]
    assert acted == [("evict_nodes", ["n004"])]
    hang = [i for i in incidents if i.kind == "hang"]
    assert hang and all(i.status == "resolved" and "hung_task" in i.summary for i in hang)
