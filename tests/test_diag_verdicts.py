"""One verdict per fault, and faults that explain their symptoms (issue 23, items 4 and 5).

Each case once went wrong on a hand-written directory or the demo: an informational Xid 63
opened a row-remap incident while explain said info/none; a segfault in libc.so.6 was read
as NCCL code and the silence after the crash became a second "hang"; a user exception on
every rank was summarised "1 of N"; a link flap that recovered was critical and open; a GPU
index the node does not have was "GPU lost"; a bad job.json split one fault into two jobs;
a muted-symptoms list grew by one entry per tick; a slow machine got adapt and then evict.
The last test walks every recorded kernel and NCCL catalog line through explain and the
engine and compares what each says to do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from faultlens import schema
from faultlens.collectors.batch import read_batch_dir
from faultlens.collectors.kernel import KernelParser
from faultlens.collectors.nccl import NcclParser
from faultlens.commands.diagnose import make_detectors
from faultlens.config import Config
from faultlens.diagnosis.batch import diagnose_records
from faultlens.diagnosis.engine import DiagnosisEngine
from faultlens.diagnosis.explain import explain_lines
from faultlens.schema import Finding, GpuSample, GpuState
from tests.handwritten import NODES, Expect, Spec, _traceback, at, write

FIXTURES = Path(__file__).resolve().parent / "fixtures"
LINES = {k: v["text"] for k, v in json.loads((FIXTURES / "verdicts" / "lines.json").read_text()).items()}
WATCHDOG = ("[rank{r}]:[E1124 16:15:{s:02d}.123456789 ProcessGroupNCCL.cpp:616] [Rank {r}] Watchdog caught collective "
            "operation timeout: WorkNCCL(SeqNum=48211, OpType=ALLREDUCE, NumelIn=262144, NumelOut=262144, "
            "Timeout(ms)=600000) ran for 600087 milliseconds before timing out.")


def _diagnose(spec: Spec, tmp: Path, tweak: Any = None) -> tuple[Any, list[Any], list[Any]]:
    d = write(spec, tmp / spec.name)
    if tweak is not None:
        tweak(d)
    b = read_batch_dir(d)
    incidents, actions = diagnose_records(b.job, list(b.records()), Config(), detectors=make_detectors("auto"))
    return b, incidents, actions


def _strong(actions: list[Any]) -> list[tuple[str, tuple[str, ...]]]:
    return [(a.type, tuple(a.nodes)) for a in actions if a.type != "notify"]


# --------------------------------------------------------------------------- a fault explains its symptoms


def test_watchdogs_ten_minutes_after_an_xid48_are_its_symptoms(tmp_path: Path) -> None:
    """The collective the broken GPU never finished times out on every rank 10 min later: one incident."""
    spec = Spec("xid48_watchdogs", Expect(), stop_at=250, kernel=[("gpu-a04", at(250) + 1, LINES["xid48"])],
                nccl=[(NODES[r // 8], WATCHDOG.format(r=r, s=5 + r % 30)) for r in range(32)])
    _, incidents, actions = _diagnose(spec, tmp_path)
    assert _strong(actions) == [("evict_nodes", ("gpu-a04",))]
    assert not [i for i in incidents if i.kind == "hang" and i.status != "resolved" and i.actions]
    ecc = next(i for i in incidents if i.kind == "ecc_uncorrectable")
    counts: dict[str, int] = {}
    for m in ecc.muted:
        counts[m["kind"]] = counts.get(m["kind"], 0) + m["count"]
    assert counts.get("hang", 0) >= 32 and len(ecc.muted) <= 8  # counted by kind, a few shown


def test_storage_stall_explains_the_silence_and_the_hung_tasks(tmp_path: Path) -> None:
    """NFS stalls under the whole job: steps stop, every node prints hung tasks: one notify, no diagnostics."""
    lines = ["nfs: server 10.1.0.5 not responding, still trying", "INFO: task python3:23101 blocked for more than 120 seconds.",
             "      Tainted: P           OE     5.15.0-91-generic #101-Ubuntu",
             "\"echo 0 > /proc/sys/kernel/hung_task_timeout_secs\" disables this message."]
    spec = Spec("storage_silence", Expect(), stop_at=160, kernel=[("*", at(158) + i * 7, m) for i, m in enumerate(lines)])
    _, incidents, actions = _diagnose(spec, tmp_path)
    assert _strong(actions) == [] and [a.type for a in actions] == ["notify"]
    assert [i.kind for i in incidents if i.status != "resolved" or i.actions] == ["storage"]


def test_a_crash_explains_the_silence_after_it(tmp_path: Path) -> None:
    """A segfault in libc.so.6 is a user-space crash (kernel.segfault, not NCCL code): the job is restarted
    and the silence of its steps is the crash's, not a second incident with stop-time diagnostics."""
    assert [e.c.rule for e in explain_lines([LINES["segfault_libc"]], "kernel")] == ["kernel.segfault"]
    assert [e.c.rule for e in explain_lines([LINES["segfault_nccl"]], "kernel")] == ["kernel.segfault.nccl"]
    spec = Spec("segfault", Expect(), stop_at=200, kernel=[("gpu-a02", at(200), LINES["segfault_libc"])])
    _, incidents, actions = _diagnose(spec, tmp_path)
    assert _strong(actions) == [("restart_job", ("gpu-a02",))]
    crash = next(i for i in incidents if i.actions)
    assert any(m["kind"] == "hang" and m["by_rule"] == "restart_explains_silence" for m in crash.muted)


def test_a_slow_machine_gets_one_decision() -> None:
    """The counters' slow GPU and the step-time model's fail_slow on the same machine: one remedy, not two."""
    engine = DiagnosisEngine(Config(), batch=True)
    t0 = 1_700_000_000.0

    def finding(kind: str, ts: float, source: str) -> Finding:
        return Finding(ts=ts, kind=kind, category="pcie", severity="critical", action="evict_node", confidence=0.95,
                       source=source, rule=f"test:{kind}", text=f"{kind} on gpu 3", node="n1", job="j", gpu=3)

    engine._file_finding(finding("fail_slow", t0, "model:failslow"))
    out = engine.tick(t0 + 1, final=True)
    engine._file_finding(finding("pcie_degradation", t0 + 22, "gpu"))
    out += engine.tick(t0 + 23, final=True)
    remedies = [o for o in out if isinstance(o, schema.Action) and o.type in ("evict_nodes", "adapt_parallelism")]
    assert len(remedies) == 1, [(a.type, a.incident_id) for a in remedies]
    second = next(i for i in engine.incidents() if i.kind == "pcie_degradation")
    assert not second.actions and "one decision per slow machine" in second.summary


# --------------------------------------------------------------------------- verdicts that disagreed


def test_xid63_is_informational_everywhere(tmp_path: Path) -> None:
    assert [(e.c.severity, e.c.action) for e in explain_lines([LINES["xid63"]], "kernel")] == [("info", "none")]
    spec = Spec("xid63", Expect(), kernel=[("gpu-a02", at(100), LINES["xid63"].split("+00:00 ", 1)[1])])
    _, incidents, actions = _diagnose(spec, tmp_path)
    assert actions == [] and incidents == []


def test_user_exception_counts_the_ranks_that_raised_it(tmp_path: Path) -> None:
    spec = Spec("exception_everywhere", Expect(), stop_at=180, nccl=[(NODES[r // 8], _traceback(r)) for r in range(32)])
    _, incidents, actions = _diagnose(spec, tmp_path)
    assert [a.type for a in actions] == ["rollback_code"]
    assert "32 of 32 rank(s)" in actions[0].reason and actions[0].confidence >= 0.9
    exc = next(i for i in incidents if i.kind == "user_exception")
    assert "32 of 32" in exc.summary and exc.confidence >= 0.9


def test_a_recovered_flap_is_a_resolved_warning_until_it_repeats(tmp_path: Path) -> None:
    down, up = LINES["link_down"], LINES["link_up"]
    spec = Spec("flap", Expect(), kernel=[("gpu-a04", at(200), down), ("gpu-a04", at(200) + 4, up)])
    _, incidents, actions = _diagnose(spec, tmp_path)
    assert actions == []
    flap = next(i for i in incidents if i.kind == "ib_link")
    assert (flap.status, flap.severity) == ("resolved", "warning") and "tolerated" in flap.summary
    again = Spec("flap_again", Expect(), kernel=[("gpu-a04", at(200), down), ("gpu-a04", at(200) + 4, up),
                                                 ("gpu-a04", at(260), down)])
    _, incidents, actions = _diagnose(again, tmp_path)
    assert _strong(actions) == [("evict_nodes", ("gpu-a04",))]
    assert next(i for i in incidents if i.kind == "ib_link").severity == "critical"


def test_a_gpu_index_the_node_does_not_have_is_quarantined() -> None:
    engine = DiagnosisEngine(Config(), batch=True)
    engine.set_topology({"job": "j", "tp": 4, "pp": 1, "dp": 1, "cp": 1,
                         "ranks": {str(g): {"node": "n1", "gpu": g} for g in range(4)}})
    t0 = 1_700_000_000.0
    out = []
    for k in range(40):
        gpus = [GpuState(index=g, util=95.0) for g in range(4)]
        if 3 <= k < 6:
            gpus += [GpuState(index=7, util=0.0), GpuState(index=-5, util=0.0)]  # a stray entry, then gone
        out += engine.observe(GpuSample(ts=t0 + 5 * k, node="n1", job="j", gpus=gpus))
        out += engine.tick(t0 + 5 * k)
    out += engine.tick(t0 + 400, final=True)
    assert not [o for o in out if isinstance(o, schema.Action)]
    assert not [i for i in engine.incidents() if i.kind == "gpu_lost"]
    assert engine.counts["quarantined_gpu_entries"] == 6


def test_a_bad_job_json_is_one_error_and_one_incident_per_fault(tmp_path: Path) -> None:
    def bad_tp(d: Path) -> None:
        j = json.loads((d / "job.json").read_text())
        j["tp"] = "eight"
        (d / "job.json").write_text(json.dumps(j))

    xid79 = "NVRM: Xid (PCI:0000:38:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
    spec = Spec("bad_job", Expect(), stop_at=200, kernel=[("gpu-a02", at(199), xid79)],
                nccl=[(NODES[r // 8], WATCHDOG.format(r=r, s=5)) for r in range(0, 32, 8)])
    b, incidents, actions = _diagnose(spec, tmp_path, bad_tp)
    job_errors = [e for e in b.errors if "job.json" in e]
    assert len(job_errors) == 1 and "'tp'" in job_errors[0]
    assert _strong(actions) == [("evict_nodes", ("gpu-a02",))]
    assert {a.job for a in actions} == {i.job for i in incidents} == {"llm-7b-run"}
    assert len([i for i in incidents if i.actions]) == 1


def test_muted_symptoms_stay_bounded_over_a_long_hang() -> None:
    """A hang re-checked every tick for hours under one cause: a few entries with counts, not one per tick."""
    engine = DiagnosisEngine(Config(), batch=True)
    engine.set_topology({"job": "j", "tp": 2, "pp": 1, "dp": 2, "cp": 1,
                         "ranks": {str(r): {"node": f"n{r // 2}", "gpu": r % 2} for r in range(4)}})
    t0 = 1_700_000_000.0
    for s in range(100):
        for r in range(4):
            engine.observe(schema.StepTiming(ts=t0 + s, job="j", rank=r, node=f"n{r // 2}", step=s, duration_s=1.0))
    rec = next(iter(KernelParser(year=2024).parse(["[100.0] " + LINES["xid48"]])))
    engine.observe(schema.replace(rec, ts=t0 + 100, node="n1"))
    for k in range(1, 400):
        ts = t0 + 100 + 20 * k
        engine.observe(GpuSample(ts=ts, node="n0", job="j", gpus=[GpuState(index=g, util=100.0) for g in range(2)]))
        engine.tick(ts)
    ecc = next(i for i in engine.incidents() if i.kind == "ecc_uncorrectable")
    assert 1 <= len(ecc.muted) <= 8
    assert sum(m["count"] for m in ecc.muted) >= 1


# --------------------------------------------------------------------------- every catalog entry, one verdict

# What a verdict asks for, from nothing to acting on a machine: explain's per-line action and the
# engine's action types on the same scale.
_LINE_CLASS = {"none": 0, "notify": 1, "restart_job": 2, "rollback_code": 2, "run_diagnostics": 3, "reset_gpu": 3,
               "evict_node": 3}
_ACTION_CLASS = {"notify": 1, "restart_job": 2, "rollback_code": 2, "run_diagnostics": 3, "evict_nodes": 3,
                 "adapt_parallelism": 3}


def _recorded_lines() -> list[tuple[str, str]]:
    out = []
    for source in ("kernel", "nccl"):
        for d in sorted((FIXTURES / source).iterdir()):
            if d.is_dir() and d.name != "negative" and (d / "input.log").exists():
                out += [(source, line) for line in (d / "input.log").read_text(encoding="utf-8").splitlines()]
    return out


def test_every_recorded_catalog_line_gets_one_verdict_from_explain_and_the_engine() -> None:
    """Each recorded line alone: explain's action and what the engine does agree. A kernel line: the same
    class (nothing, a person, the job, the machine); a network alert or notify line may stay tolerated.
    An NCCL line is a job's symptom (its cause decides): the engine never does more than explain says."""
    checked = 0
    for source, line in _recorded_lines():
        explained = [e for e in explain_lines([line], source, year=2024) if e.c.rule]
        records = list((KernelParser(year=2024) if source == "kernel" else NcclParser(year=2024)).parse([line]))
        if len(explained) != 1 or len(records) != 1:
            continue  # a continuation line or a multi-line block: judged with its block in test_signatures
        verdict, rec = explained[0].c, records[0]
        engine = DiagnosisEngine(Config(), batch=True)
        engine.set_topology({"job": "j", "ranks": {"0": {"node": rec.node, "gpu": 0}, "8": {"node": "peer", "gpu": 0}}})
        out = engine.observe(schema.replace(rec)) + engine.tick(rec.ts + 1, final=True)
        got = max((_ACTION_CLASS[o.type] for o in out if isinstance(o, schema.Action)), default=0)
        want = _LINE_CLASS[verdict.action] if not (verdict.benign or verdict.category == "none") else 0
        if want == 0:
            assert got == 0 and not engine.incidents(), (line, verdict.rule)
        elif source == "nccl" or want == 1:
            assert got <= want, (line, verdict.rule, verdict.action, got)
        else:
            assert got == want, (line, verdict.rule, verdict.action, got)
        checked += 1
    assert checked >= 100


@pytest.mark.parametrize("name", ["xid63", "link_up"])
def test_informational_lines_are_info_in_explain(name: str) -> None:
    assert [e.c.severity for e in explain_lines([LINES[name]], "kernel") if e.c.rule] == ["info"]


# --------------------------------------------------------------------------- kernel families (item 6)


def test_the_remap_failure_speaks_for_a_dbe_a_remap_failure_and_a_gpu_that_did_not_come_back() -> None:
    """One GPU prints Xid 48 then Xid 64, another RmInitAdapter failed: the line that decides what happens to
    the machine is the remap failure (evict), not the first critical line (the DBE's reset)."""
    from faultlens.collectors.signatures import most_significant

    lines = [ln for d in ("families", "project", "real")
             for ln in (FIXTURES / "kernel" / d / "input.log").read_text().splitlines()]
    dbe = next(x for x in lines if "): 48, " in x and "double bit" in x)
    remap = next(x for x in lines if "): 64, " in x)
    rminit = next(x for x in lines if "RmInitAdapter failed" in x)
    verdict = most_significant(e.c for e in explain_lines([dbe, remap, rminit], "kernel"))
    assert verdict is not None and (verdict.rule, verdict.action) == ("xid.64", "evict_node")


def test_a_hung_task_inside_the_nvidia_driver_is_the_machine_not_storage(tmp_path: Path) -> None:
    """A task blocked in nvidia_uvm on one node: that machine's GPU driver (stop-time checks there), never
    folded into a job-wide storage stall and never a hung-task notify."""
    block = [ln for ln in (FIXTURES / "kernel" / "families" / "input.log").read_text().splitlines()
             if ln.startswith("[  721.0")]
    assert [e.c.rule for e in explain_lines(block, "kernel") if e.c.rule][0] == "kernel.hung_task.nvidia"
    spec = Spec("uvm_hang", Expect(), stop_at=200,
                kernel=[("gpu-a03", at(199) + i * 1e-6, ln.split("] ", 1)[1]) for i, ln in enumerate(block)])
    _, incidents, actions = _diagnose(spec, tmp_path)
    assert ("run_diagnostics", ("gpu-a03",)) in _strong(actions)
    assert not [i for i in incidents if i.kind == "storage"]


def test_hung_tasks_spread_over_a_dozen_nodes_are_one_storage_stall() -> None:
    """Twelve nodes report a blocked task 30 s apart (khungtaskd checks every 120 s, a stall reaches nodes
    at different times), steps stop: one job-wide storage incident and a notification, no per-node checks,
    and the nodes that report after it went quiet are its symptoms too."""
    nodes = [f"n{i:02d}" for i in range(12)]
    engine = DiagnosisEngine(Config(), batch=True)
    engine.set_topology({"job": "j", "tp": 1, "pp": 1, "dp": 12, "cp": 1,
                         "ranks": {str(i): {"node": n, "gpu": 0} for i, n in enumerate(nodes)}})
    t0 = 1_700_000_000.0
    out = []
    for s in range(120):
        for r, n in enumerate(nodes):
            out += engine.observe(schema.StepTiming(ts=t0 + s, job="j", rank=r, node=n, step=s, duration_s=1.0))
    hung = "INFO: task python3:23101 blocked for more than 120 seconds."
    late = {n: 1300.0 for n in nodes[-2:]}  # two nodes report long after the others
    for i, n in enumerate(nodes):
        ts = t0 + 200 + 30 * i + late.get(n, 0.0)
        rec = next(iter(KernelParser(year=2024).parse([f"[{ts - t0:.1f}] {hung}"])))
        out += engine.tick(ts - 1)
        out += engine.observe(schema.replace(rec, ts=ts, node=n))
    for k in range(60):
        out += engine.tick(t0 + 1600 + 20 * k)
    out += engine.tick(t0 + 3000, final=True)
    acts = [o for o in out if isinstance(o, schema.Action)]
    assert [a.type for a in acts] == ["notify"], [(a.type, a.nodes, a.reason[:80]) for a in acts]
    storage = [i for i in engine.incidents() if i.kind == "storage"]
    assert len(storage) == 1 and len(storage[0].suspects) == 0
