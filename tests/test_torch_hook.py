"""faultlens.torch (the training-side hook) and the agent's readers of what real ranks leave:
torchrun's error files (collectors/elastic.py) and Flight Recorder dumps (collectors/flight_recorder.py).

The real outputs are in tests/fixtures/real_torch/ (torch 2.13.0+cpu, gloo; see its README)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from faultlens import flightrec, schema
from faultlens.collectors import flight_recorder
from faultlens.collectors.elastic import ElasticErrorSource, local_rank_of, read_error_file
from faultlens.config import AgentConfig, Config
from faultlens.torch import TrainingMonitor, workload

REAL = Path(__file__).resolve().parent / "fixtures" / "real_torch"


class Services:
    """What a source is given by the agent: here it keeps what is emitted (the agent's own plumbing is
    tested in test_agent_*)."""

    def __init__(self, agent_config: AgentConfig, node: str = "vn1"):
        self.node, self.job, self.config, self.from_end = node, "rj", Config(agent=agent_config), False
        self.emitted: list[Any] = []
        self.states: dict[str, str] = {}
        self.failures = 0
        self.health: dict[str, Any] = {}
        self.clock = time.time

    @property
    def stop_event(self) -> threading.Event:
        return threading.Event()

    def emit_many(self, records: list[Any]) -> None:
        self.emitted += records

    def set_state(self, name: str, state: str, detail: str = "") -> None:
        self.states[name] = state

    def success(self, name: str, lines: int = 0, records: int = 0, now: float | None = None) -> None:
        pass

    def parse_failure(self, name: str) -> None:
        self.failures += 1


def test_step_records_are_steps_topic_records(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    mon = TrainingMonitor(job="j1", rank=3, node="vn1", steps_path=str(path), stall_s=3600, flight_recorder=False)
    with mon.step(7, lengths=[10, 20, 30]) as s:
        s.mark("fwd")
        s.mark("bwd")
        s.update(loss=2.5, grad_norm=0.7)
    with mon.step(8, lengths=[5]) as s:
        s.update(loss=math.nan)  # NaN: JSON has none, so null (diagnosis reads "missing where it was a number")
    with pytest.raises(ConnectionError), mon.step(9, lengths=[5]) as s:
        raise ConnectionError("a peer went away")  # the step did not complete: no record, counted
    mon.close()
    recs = [schema.from_dict("steps", json.loads(line)) for line in path.read_text().splitlines()]
    assert [r.step for r in recs] == [7, 8]
    a, b = recs
    assert (a.job, a.rank, a.node, a.n_seqs, a.sum_len, a.sum_len_sq, a.tokens) == ("j1", 3, "vn1", 3, 60, 1400, 60)
    assert a.loss == 2.5 and a.grad_norm == 0.7 and a.fwd_s is not None and a.bwd_s is not None
    assert a.duration_s >= a.fwd_s + a.bwd_s - 1e-9
    assert b.loss is None
    assert mon.stats()["written"] == 2 and mon.errors == 0 and mon.failed_steps == 1


def test_a_path_it_cannot_write_is_counted_never_raised(tmp_path: Path) -> None:
    mon = TrainingMonitor(job="j", rank=0, steps_path=str(tmp_path / "no" / "such" / "dir" / "s.jsonl"),
                          stall_s=3600, flight_recorder=False)
    for i in range(3):
        with mon.step(i, lengths=[4]):
            pass
    mon.close()
    assert mon.written == 0 and mon.dropped == 3 and mon.errors >= 1


def test_workload_of_lengths() -> None:
    assert workload([3, 4]) == {"n_seqs": 2, "sum_len": 7, "sum_len_sq": 25, "tokens": 7}


# ---------------------------------------------------------------------- torch, gloo, one process
DDP_SCRIPT = textwrap.dedent("""
    import json, os, sys, time, torch, torch.distributed as dist
    from faultlens.torch import TrainingMonitor
    mon = TrainingMonitor(job="t", stall_s=1.0, poll_s=0.1)
    dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:%d" % int(sys.argv[1]))
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
    hooked = mon.watch_ddp(model)
    for i in range(3):
        with mon.step(i, lengths=[3, 5]) as s:
            loss = model(torch.randn(4, 8)).square().mean(); s.mark("fwd")
            loss.backward(); s.mark("bwd")
            s.update(loss=loss.detach())
    time.sleep(2.0)                       # no step for 2 s: the watchdog dumps (stall_s 1 s)
    stall_dump = os.path.getmtime(mon.dump_path)
    open(mon.dump_path + ".request", "w").write("now")
    time.sleep(1.0)                       # the agent's request: a fresh dump
    print(json.dumps({"hooked": hooked, "stall_dump": stall_dump, "after_request": os.path.getmtime(mon.dump_path),
                      **mon.stats()}))
    mon.close()
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_ddp_over_gloo_comm_split_stall_dump_and_dump_on_request(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, FAULTLENS_STEPS_DIR=str(tmp_path), TORCH_NCCL_DEBUG_INFO_TEMP_FILE=str(tmp_path / "fr_"),
               RANK="0", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", DDP_SCRIPT, str(port)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["hooked"] and out["dump_errors"] == 0 and out["dumps"] >= 2
    assert out["after_request"] > out["stall_dump"]
    recs = [json.loads(line) for line in (tmp_path / "steps-t-0.jsonl").read_text().splitlines()]
    assert len(recs) == 3 and all(r["comm_s"] >= 0 and r["loss"] > 0 for r in recs)
    dump = flightrec.loads((tmp_path / "fr_0").read_bytes())
    assert dump["version"] == "2.10"  # what torch 2.13 writes for gloo
    assert any(e.get("profiling_name") == "gloo:all_reduce" for e in dump["entries"])
    info = json.loads((tmp_path / "fr_0.monitor").read_text())
    assert info["job"] == "t" and info["rank"] == 0


# ---------------------------------------------------------------------- torchrun's error file
def _tree_with_error_file(tmp_path: Path, local_rank: int) -> Path:
    path = tmp_path / "tr" / "rj_abc" / "attempt_0" / str(local_rank) / "error.json"
    path.parent.mkdir(parents=True)
    shutil.copy(REAL / "torchelastic_error_rank1.json", path)
    return path


def test_real_error_file_reads_as_the_failing_ranks_traceback(tmp_path: Path) -> None:
    exception, stack, ts = read_error_file((REAL / "torchelastic_error_rank1.json").read_text())
    assert exception.startswith("RuntimeError: injected failure on rank 1")
    assert stack.startswith("Traceback (most recent call last):") and ts is not None
    path = _tree_with_error_file(tmp_path, 1)
    assert local_rank_of(str(path)) == 1
    (tmp_path / "job.json").write_text(json.dumps({"job": "rj", "ranks": {
        "2": {"node": "vn1", "gpu": 0}, "3": {"node": "vn1", "gpu": 1}, "1": {"node": "vn0", "gpu": 1}}}))
    agent = Services(AgentConfig(error_files_glob=str(tmp_path / "tr" / "*" / "attempt_*" / "*" / "error.json"),
                                 job_file=str(tmp_path / "job.json")))
    src = ElasticErrorSource(agent, {})
    src.start({})
    src.poll(time.monotonic())
    (rec,) = agent.emitted
    assert isinstance(rec, schema.NcclEvent) and rec.kind == "traceback"
    assert rec.rank == 3 and rec.node == "vn1" and rec.ts == ts  # local rank 1 on vn1 is global rank 3
    assert rec.exception is not None and rec.exception.startswith("RuntimeError: injected failure")
    assert rec.fields["source"] == "torchelastic_error_file"
    src.poll(time.monotonic() + 5)
    assert len(agent.emitted) == 1  # read once


def test_a_many_line_gloo_error_is_one_record(tmp_path: Path) -> None:
    """Rank 0's error when its peer died (the message as torchrun_childfailed.log shows it): one record."""
    log = (REAL / "torchrun_childfailed.log").read_text()
    msg = log[log.index("RuntimeError: Got the following error"):].split("\n\n\n")[0].replace("[rank0]: ", "")
    path = _tree_with_error_file(tmp_path, 0)
    path.write_text(json.dumps({"message": {"message": msg, "extraInfo": {
        "py_callstack": "Traceback (most recent call last):\n  File \"train.py\", line 139, in main\n" + msg,
        "timestamp": "1795878682"}}}))
    agent = Services(AgentConfig(error_files_glob=str(path)))
    src = ElasticErrorSource(agent, {})
    src.start({})
    src.poll(time.monotonic())
    (rec,) = agent.emitted
    assert rec.rank == 0 and rec.fields["rank_from"] == "local rank"
    assert rec.exception.startswith("RuntimeError: Got the following error") and "Connection closed by peer" in rec.exception


def test_a_file_that_is_no_error_file_is_a_dead_letter(tmp_path: Path) -> None:
    path = _tree_with_error_file(tmp_path, 0)
    path.write_text("{not json")
    agent = Services(AgentConfig(error_files_glob=str(path)))
    src = ElasticErrorSource(agent, {})
    src.start({})
    src.poll(time.monotonic())
    (rec,) = agent.emitted
    assert isinstance(rec, schema.DeadLetter) and rec.reason == "not_an_error_file" and agent.failures == 1


# ---------------------------------------------------------------------- Flight Recorder on the agent
def test_a_rank_that_does_not_answer_the_dump_request_is_said(tmp_path: Path) -> None:
    prefix = str(tmp_path / "fr_")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                            env=dict(os.environ, TORCH_NCCL_DEBUG_INFO_TEMP_FILE=prefix))
    try:
        (tmp_path / "fr_5.monitor").write_text(json.dumps({"pid": proc.pid, "job": "rj", "rank": 5}))
        shutil.copy(REAL / "fr_gloo_rank0_stall.pkl", tmp_path / "fr_5")
        os.utime(tmp_path / "fr_5", (time.time() - 60, time.time() - 60))
        t0 = time.monotonic()
        dumps = flight_recorder.for_processes("rj", "vn2", [(proc.pid, 5)], request_id="cmd-1")
        waited = time.monotonic() - t0
    finally:
        proc.kill()
        proc.wait()
    assert (tmp_path / "fr_5.request").exists()
    silent = [d for d in dumps if d.error and flight_recorder.NOT_ANSWERED in d.error]
    assert len(silent) == 1 and silent[0].rank == 5 and silent[0].pid == proc.pid
    assert len(dumps) == 2  # its older dump is still sent, with the silence beside it
    assert flight_recorder.REQUEST_WAIT_S - 0.2 <= waited < flight_recorder.REQUEST_WAIT_S + 2


def test_flight_recorder_source_ships_a_dump_the_rank_wrote_itself(tmp_path: Path) -> None:
    (tmp_path / "rank_0").write_bytes(b"an earlier run's file")  # there at start: not news
    agent = Services(AgentConfig(flight_recorder_glob=str(tmp_path / "rank_*")), node="vn0")
    src = flight_recorder.FlightRecorderSource(agent, {})
    src.start({})
    src.poll(time.monotonic())
    assert agent.emitted == []
    (tmp_path / "rank_1.monitor").write_text(json.dumps({"pid": 1, "job": "rj3", "rank": 1}))
    shutil.copy(REAL / "fr_gloo_rank0_requested.pkl", tmp_path / "rank_1")
    src.poll(time.monotonic() + 2)
    (rec,) = agent.emitted
    assert isinstance(rec, schema.StackDump) and (rec.rank, rec.job, rec.node) == (1, "rj3", "vn0")
    assert rec.text.startswith(flightrec.MARKER)
    src.poll(time.monotonic() + 4)
    assert len(agent.emitted) == 1


# ---------------------------------------------------------------------- a real job through the pipeline
def _can_make_virtual_nodes() -> bool:
    if not shutil.which("unshare") or not shutil.which("nsenter"):
        return False
    return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_real_ddp_job_reaches_diagnosis_and_a_lost_machine_is_evicted(tmp_path: Path) -> None:
    """2 virtual nodes x 1 rank of benchmarks/torchjob/train.py (DDP, gloo) with the hook, each node with
    its real agent; the embedded broker, stream processor, online diagnosis and the runner: the ranks'
    step records arrive on the steps topic with their workload, and Xid 79 + SIGKILL of rank 1 gets
    vn1 evicted through the runner's command hook."""
    pytest.importorskip("torch")
    if not _can_make_virtual_nodes():
        pytest.skip("needs unshare/nsenter with PID namespaces (root)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.realjob import _lost_machine
    from benchmarks.torchjob.cluster import Cluster
    from faultlens.config import BusConfig
    from faultlens.stream.bus import Consumer

    c = Cluster(tmp_path / "c", nodes=2, ranks_per_node=1, ckpt_every=5)
    try:
        c.start()
        c.start_job("t-real", ["vn0", "vn1"])
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not ((got := c.last_step()) and got[0] >= 8):
            time.sleep(0.5)
        assert c.last_step() is not None, (tmp_path / "c" / "nodes" / "vn0" / "launcher-1.log").read_text()[-3000:]
        bus = BusConfig(bootstrap_servers=c.bootstrap)
        steps = Consumer(bus, ["steps"], group_id=None, bootstrap=c.bootstrap, from_beginning=True)
        seen: dict[int, Any] = {}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(seen) < 2:
            for m in steps.poll(500):
                rec = schema.decode("steps", m.value, content_type=m.content_type)
                if rec.job == "t-real":
                    seen[rec.rank] = rec
        steps.close()
        assert sorted(seen) == [0, 1]
        assert seen[1].node == "vn1" and seen[1].n_seqs == 8 and seen[1].sum_len_sq > seen[1].sum_len > 0
        assert seen[1].fwd_s is not None and seen[1].comm_s is not None and seen[1].loss is not None

        actions = Consumer(bus, ["actions"], group_id=None, bootstrap=c.bootstrap)
        _lost_machine(c, 1)
        got_action = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and got_action is None:
            for m in actions.poll(500):
                data = json.loads(m.value).get("data", {})
                if data.get("job") == "t-real" and data.get("type") == "evict_nodes":
                    got_action = data
        actions.close()
        assert got_action is not None and got_action["nodes"] == ["vn1"]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (handed := c.hook_actions()):
            time.sleep(0.5)
        assert handed and handed[0]["type"] == "evict_nodes"  # the runner ran the command hook
    finally:
        c.stop()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")  # Lightning 2.6 on torch 2.13: its own advice, deprecations
def test_lightning_callback_records_each_training_batch(tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    import torch

    from faultlens.torch import lightning_callback

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return torch.nn.functional.mse_loss(self.lin(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(12, 4), torch.randn(12, 1))
    mon = TrainingMonitor(job="pl", rank=0, node="n", steps_path=str(tmp_path / "s.jsonl"), stall_s=3600,
                          flight_recorder=False)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[lightning_callback(mon)])
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
    mon.close()
    recs = [schema.from_dict("steps", json.loads(line)) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [r.step for r in recs] == [1, 2, 3] and all(r.loss is not None and r.loss >= 0 for r in recs)
