"""Diagnosis on what real PyTorch printed and wrote (torch 2.13.0, gloo, torchrun, py-spy 0.4.3), issue 33.

Fixtures: tests/fixtures/real_torch/<scenario>/ (README there: command, version, date). Each
test here failed before its fix: gloo's version-2.10 Flight Recorder dumps, a rank that wrote
no dump, py-spy on a stopped process, DDP's all-reduce inside autograd, torchrun's own
SignalException, and the step timings of real jittery CPU ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from faultlens import decode, flightrec
from faultlens.collectors.batch import read_batch_dir
from faultlens.collectors.nccl import NcclParser
from faultlens.collectors.stacks import dump_stack, process_state
from faultlens.config import Config
from faultlens.diagnosis import hangroot
from faultlens.diagnosis.batch import diagnose_records
from faultlens.diagnosis.classify import classify
from faultlens.diagnosis.exceptions import user_exception
from faultlens.models.failslow import FailSlowDetector
from faultlens.stream.topology import Topology

REAL = Path(__file__).parent / "fixtures" / "real_torch"
JOB = {"job": "realjob", "tp": 1, "pp": 1, "dp": 4, "ranks": {str(r): {"node": f"vn{r}", "gpu": 0} for r in range(4)}}
CAT = hangroot.load_frames()


def _summaries(scenario: str, form: str) -> dict[int, dict]:
    out = {}
    for f in sorted((REAL / scenario).glob("fr_rank_*")):
        if f.name.endswith(".json") != (form == "json"):
            continue
        s = flightrec.summarise(flightrec.loads(f.read_bytes()), flightrec.rank_from_name(f.name))
        out[s["rank"]] = s
    return out


def _pyspy(scenario: str, rank: int) -> str:
    """What ``py-spy dump --pid P > R.txt 2>&1`` leaves: its output, then its error output."""
    d = REAL / scenario
    return (d / f"pyspy_rank{rank}.txt").read_text() + (d / f"pyspy_rank{rank}.stderr").read_text()


def batch_dir(scenario: str, dest: Path, form: str = "pickle") -> Path:
    """A batch directory (docs/design.md) of one recorded run: one rank per virtual node vn0..vn3."""
    src = REAL / scenario
    for sub in ("steps", "stacks", "flight_recorder", "nodes/vn0/nccl"):
        (dest / sub).mkdir(parents=True, exist_ok=True)
    (dest / "job.json").write_text(json.dumps(JOB))
    shutil.copy(src / "torchrun.stderr", dest / "nodes" / "vn0" / "nccl" / "torchrun.log")
    for f in src.glob("steps_rank*.jsonl"):
        shutil.copy(f, dest / "steps" / f.name)
    for r in range(4):
        if (src / f"pyspy_rank{r}.txt").exists():
            (dest / "stacks" / f"{r}.txt").write_text(_pyspy(scenario, r))
    for f in src.glob("fr_rank_*"):
        if f.name.endswith(".json") == (form == "json"):
            shutil.copy(f, dest / "flight_recorder" / f.name)
    return dest


def _diagnose(d: Path):
    data = read_batch_dir(d)
    return diagnose_records(data.job, list(data.records()), Config(), detectors=[FailSlowDetector()])


# ---------------------------------------------------------------- Flight Recorder, gloo, version 2.10


@pytest.mark.parametrize("form", ["pickle", "json"])
def test_gloo_version_2_10_dumps_are_read_with_their_ranks_and_completion(form: str) -> None:
    s = _summaries("stopped_rank", form)[0]
    assert s["version"] == "2.10" and flightrec.version_tuple(s["version"]) == (2, 10) > (2, 8)
    pg = s["pgs"]["0"]  # pg_config says '' while the entries say ('0', 'default_pg'): one group
    assert pg["ranks"] == [0, 1, 2, 3] and pg["desc"] == "default_pg" and "" not in s["pgs"]
    states = [c[1] for c in pg["collectives"]]
    # every entry stays "scheduled": completion is read from retired / pg_status
    assert states[:-1] == ["completed"] * (len(states) - 1) and states[-1] == "scheduled"
    assert pg["collectives"][-1][2] == "gloo:all_reduce"


@pytest.mark.parametrize("form", ["pickle", "json"])
def test_the_stopped_rank_that_wrote_no_dump_is_named_at_the_wavefront(form: str) -> None:
    summ = _summaries("stopped_rank", form)
    assert sorted(summ) == [0, 1, 3]
    missing = flightrec.wavefront(summ)
    assert list(missing) == [2] and "wrote no dump" in missing[2][0]
    # not when most of the group's dumps are absent: then they were not collected
    assert flightrec.wavefront({0: summ[0], 1: summ[1]}) == {}


@pytest.mark.parametrize("form", ["pickle", "json"])
def test_a_rank_behind_is_named_from_gloo_dumps(form: str) -> None:
    summ = _summaries("rank_behind", form)
    assert sorted(summ) == [0, 1, 2, 3]
    missing = flightrec.wavefront(summ)
    assert list(missing) == [2] and "never entered" in missing[2][0]


def test_a_newer_dump_version_is_read_by_field_name() -> None:
    dump = flightrec.loads((REAL / "stopped_rank" / "fr_rank_0").read_bytes())
    s = flightrec.summarise({**dump, "version": "2.11"}, 0)
    assert s["pgs"]["0"]["ranks"] == [0, 1, 2, 3] and "newer" in s["note"]


# ---------------------------------------------------------------- stacks of a hung DDP job


def test_ddp_ranks_waiting_in_backward_are_comm_and_the_stopped_rank_is_stuck() -> None:
    states = {r: hangroot.rank_state(r, _pyspy("stopped_rank", r), CAT) for r in range(4)}
    assert {r: s.category for r, s in states.items()} == {0: "comm", 1: "comm", 2: "stopped", 3: "comm"}
    assert states[0].rule == "ddp_backward_allreduce" and "Failed to suspend process" in states[2].frame
    ranking = hangroot.rank_roots(states, Topology.from_job(JOB), majority=[0, 1, 3])
    assert ranking.roots == ["vn2"]
    # its missing Flight Recorder dump is the same silence: counted once, from the stacks or (without them) the dumps
    flight = flightrec.wavefront(_summaries("stopped_rank", "pickle"))
    with_fr = hangroot.rank_roots(states, Topology.from_job(JOB), majority=[0, 1, 3], flight=flight)
    assert with_fr.rank_scores[2] == ranking.rank_scores[2]
    assert hangroot.rank_roots({}, Topology.from_job(JOB), flight=flight).roots == ["vn2"]
    # active (computing) in the same frame is not a wait
    active = _pyspy("stopped_rank", 0).replace("(idle)", "(active)")
    assert hangroot.rank_state(0, active, CAT).category == "python"


def test_the_simulators_ddp_wait_has_the_real_shape() -> None:
    from faultlens.datasets import signal_stacks

    sim = hangroot.rank_state(0, signal_stacks.pyspy_dump(100, "ddp_backward", "python train.py"), CAT)
    real = hangroot.rank_state(0, _pyspy("stopped_rank", 0), CAT)
    assert (sim.category, sim.rule, sim.frame) == (real.category, real.rule, real.frame)


def test_py_spy_on_a_stopped_process_reports_it_stopped() -> None:
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(pyspy).exists():
        pytest.skip("py-spy not installed (the stacks extra)")
    p = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)"])
    try:
        time.sleep(0.3)
        os.kill(p.pid, signal.SIGSTOP)
        for _ in range(50):
            if process_state(p.pid) == "T":
                break
            time.sleep(0.02)
        d = dump_stack(p.pid, job="j", node="n", rank=0, pyspy=pyspy, subprocesses=False, timeout_s=10)
    finally:
        p.kill()
        p.wait()
    assert d.error is not None and d.error.startswith("process stopped (state T")
    assert hangroot.rank_state(0, d.text, CAT, error=d.error).category == "stopped"


# ---------------------------------------------------------------- torchrun's own lines


def test_torchrun_signal_exception_and_child_failed_summary_are_not_user_code() -> None:
    recs = list(NcclParser("vn0", year=2026).parse((REAL / "stopped_rank" / "torchrun.stderr").read_text().splitlines()))
    sig = [r for r in recs if "SignalException" in r.raw]
    assert sig and all(user_exception(r) is None for r in recs)
    assert {classify(r).rule for r in sig} == {"nccl.launcher.exit"}
    recs = list(NcclParser("vn0", year=2026).parse((REAL / "exception" / "torchrun.stderr").read_text().splitlines()))
    child = [r for r in recs if "ChildFailedError" in r.raw]
    assert child and all(user_exception(r) is None for r in child)
    # the failing worker's own exception still is user code
    assert [user_exception(r) for r in recs if "bad batch" in r.raw and user_exception(r)]


# ---------------------------------------------------------------- the whole batch path


@pytest.mark.parametrize("scenario", ["stopped_rank", "rank_behind"])
@pytest.mark.parametrize("form", ["pickle", "json"])
def test_a_hung_ddp_job_evicts_the_stuck_ranks_machine_only(tmp_path: Path, scenario: str, form: str) -> None:
    incidents, actions = _diagnose(batch_dir(scenario, tmp_path, form))
    assert [i.kind for i in incidents] == ["hang"]
    assert [(a.type, a.nodes) for a in actions] == [("evict_nodes", ["vn2"])]


def test_nan_on_every_rank_blames_no_machine(tmp_path: Path) -> None:
    incidents, actions = _diagnose(batch_dir("nan_all", tmp_path))
    assert "nan_loss" in {i.kind for i in incidents}
    assert not [i for i in incidents if i.kind == "fail_slow"]
    assert not [a for a in actions if a.type in ("evict_nodes", "adapt_parallelism")]


def test_nan_on_every_rank_mutes_the_fail_slow_verdicts_of_its_window(tmp_path: Path) -> None:
    """With the fail-slow gate off (the detector as it was), real jitter gives a fail-slow verdict on every
    machine of the NaN run: the job-wide NaN's onset mutes them into its own incident (inhibit.toml)."""
    import dataclasses

    from faultlens.models.failslow import FailSlowParams

    ungated = dataclasses.replace(FailSlowParams.from_catalog(), peer_z=0.0, min_peer_margin=-9.0, confirm_steps=1,
                                  quiet_noise=9.0)
    data = read_batch_dir(batch_dir("nan_all", tmp_path))
    incidents, actions = diagnose_records(data.job, list(data.records()), Config(),
                                          detectors=[FailSlowDetector(ungated)])
    slow = [i for i in incidents if i.kind == "fail_slow"]
    assert slow and all(i.status == "resolved" and "nan_loss_mutes_machine_slowdowns" in i.summary for i in slow)
    assert [a.type for a in actions] == ["run_diagnostics"]


# ---------------------------------------------------------------- step times of real CPU ranks


def _findings(scenario: str) -> list:
    steps: dict[int, list] = {}
    for f in sorted((REAL / scenario).glob("steps_rank*.jsonl")):
        for line in f.read_text().splitlines():
            rec = decode.from_obj("steps", json.loads(line))
            steps.setdefault(rec.step, []).append(rec)
    det = FailSlowDetector()
    det.set_topology(Topology.from_job(JOB))
    return [f for s in sorted(steps) for f in det.observe_step(steps[s])]


def test_jittery_healthy_cpu_ranks_blame_no_machine() -> None:
    assert [f for f in _findings("steps_noisy") if f.kind == "fail_slow"] == []


def test_a_rank_slowed_by_a_cpu_quota_is_found_and_no_other() -> None:
    onset = int((REAL / "steps_slowed" / "slowed.txt").read_text().split(" at its step ")[1].split()[0])
    slow = [f for f in _findings("steps_slowed") if f.kind == "fail_slow"]
    assert [f.node for f in slow] == ["vn1"]
    assert onset <= slow[0].figures["step"] <= onset + 20 and slow[0].figures["slowdown"] > 1.0
