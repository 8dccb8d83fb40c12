"""The engine end to end on handcrafted records built from real log lines (real-logs/)."""

import dataclasses

from faultlens.config import Config, GuardConfig
from faultlens.diagnosis.batch import diagnose_records
from faultlens.diagnosis.engine import Detector, DiagnosisEngine, run_records
from faultlens.diagnosis.nodehealth import NodeHealth
from faultlens.schema import (
    Command,
    Finding,
    GpuSample,
    GpuState,
    JobTopology,
    KernelEvent,
    NcclEvent,
    StackDump,
    StepTiming,
)
from faultlens.stream.topology import Topology

from .conftest import FIXTURES

T0 = 1_700_000_000.0
TOPO = Topology.packed(tp=8, pp=2, dp=2, gpus_per_node=8, job="j1")  # 32 ranks on n001..n004
JOB = JobTopology(ts=T0, job="j1", **{k: v for k, v in TOPO.to_job_dict().items() if k != "job"})
XID79 = "[ 1843.3] NVRM: Xid (PCI:0000:3b:00): 79, pid=1797828, name=pt_main_thread, GPU has fallen off the bus."
WATCHDOG = ("[rank{r}]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] [Rank {r}] Watchdog caught collective "
            "operation timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE, NumelIn=466119168, NumelOut=466119168, "
            "Timeout(ms)=600000) ran for 600060 milliseconds before timing out.")
LINK_DOWN = "mlx5_core 0000:ab:00.0 mlx5_5: Port: 1 Link DOWN"
LINK_UP = "mlx5_core 0000:ab:00.0 mlx5_5: Port: 1 Link ACTIVE"
IB_COMPLETION = ("hostname-test:984:1357 [4] ib_plugin.c:1615 NCCL WARN NET/IB : Got completion from peer "
                 "172.36.143.59<44206> with status=12 opcode=129 len=65536 vendor err 129 (Recv)")


def steps(t_from, t_to, *, skip=(), loss=2.0, ranks=range(32)):
    out, step, t = [], int(t_from - T0), t_from
    while t < t_to:
        out += [StepTiming(ts=t, job="j1", rank=r, node=TOPO.node_of(r), step=step, duration_s=1.0, loss=loss)
                for r in ranks if r not in skip]
        step, t = step + 1, t + 1.0
    return out


def gpu_samples(t_from, t_to, every=10.0):
    out, t = [], t_from
    while t < t_to:
        out += [GpuSample(ts=t, node=n, gpus=[GpuState(index=i, sm_clock_mhz=1980) for i in range(8)]) for n in TOPO.nodes]
        t += every
    return out


def kernel(ts, node, raw, kind="other", xid=None):
    return KernelEvent(ts=ts, node=node, kind=kind, raw=raw, xid=xid)


def diagnose(records, config=None, **kw):
    return diagnose_records(JOB, sorted(records, key=lambda r: r.ts), config or Config(), **kw)


def test_xid79_evicts_its_node_and_mutes_every_ranks_watchdog_timeout():
    recs = steps(T0, T0 + 300) + gpu_samples(T0, T0 + 1200)
    recs.append(kernel(T0 + 300.5, "n002", XID79, "xid", 79))
    recs.append(kernel(T0 + 300.6, "n002", "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.", "fell_off_bus"))
    recs += [NcclEvent(ts=T0 + 900 + r / 100, node=TOPO.node_of(r), kind="watchdog_timeout", rank=r,
                       raw=WATCHDOG.format(r=r)) for r in range(32)]
    incidents, actions = diagnose(recs)
    assert [(a.type, a.nodes, a.dry_run) for a in actions] == [("evict_nodes", ["n002"], True)]
    lost = [i for i in incidents if i.kind == "gpu_lost"]
    assert len(lost) == 1 and len(lost[0].evidence) == 2  # Xid 79 + fallen off the bus: one incident
    assert lost[0].suspects[0]["node"] == "n002" and lost[0].confidence >= 0.9
    rules = {m["by_rule"] for m in lost[0].muted}
    assert rules == {"machine_fault_mutes_collective_symptoms"} and sum(m["count"] for m in lost[0].muted) >= 30
    assert len(lost[0].muted) <= 8  # counted by kind and node, not one entry per symptom
    assert not [i for i in incidents if i.kind == "hang" and i.status == "open"]


def test_network_alert_tolerated_once_evicted_when_repeated():
    base = steps(T0, T0 + 600) + gpu_samples(T0, T0 + 600)
    flap = base + [kernel(T0 + 100, "n003", LINK_DOWN, "ib_link_down"), kernel(T0 + 104, "n003", LINK_UP, "ib_link_up"),
                   NcclEvent(ts=T0 + 101, node="n001", kind="warn", rank=3, raw=IB_COMPLETION)]
    _, actions = diagnose(flap)
    assert actions == []
    repeated = flap + [kernel(T0 + 250, "n003", LINK_DOWN, "ib_link_down")]
    incidents, actions = diagnose(repeated)
    assert [(a.type, a.nodes) for a in actions] == [("evict_nodes", ["n003"])]
    assert "2 network alerts" in actions[0].reason
    ib = next(i for i in incidents if i.kind == "ib_link" and i.suspects and i.suspects[0]["node"] == "n003")
    assert any(m["by_rule"] == "machine_fault_mutes_collective_symptoms" for m in ib.muted)  # the peer's NCCL error


def test_same_exception_on_every_rank_rolls_back_and_never_evicts():
    tb = ("[rank{r}]: Traceback (most recent call last):\n[rank{r}]:   File \"train.py\", line 88, in <module>\n"
          "[rank{r}]: IndexError: index 4096 is out of bounds for dimension 0 with size 4096")
    recs = steps(T0, T0 + 200) + gpu_samples(T0, T0 + 900)
    recs += [NcclEvent(ts=T0 + 200 + r / 50, node=TOPO.node_of(r), kind="traceback", rank=r, raw=tb.format(r=r))
             for r in range(32)]
    incidents, actions = diagnose(recs)
    assert [a.type for a in actions] == ["rollback_code"]
    assert actions[0].nodes == [] and "IndexError" in actions[0].reason and "never evict" in actions[0].reason
    assert not [i for i in incidents if i.kind == "hang" and i.status == "open"]


def test_a_traceback_from_one_rank_per_node_still_rolls_back():
    """Launchers kill the other ranks once one fails: a real log often holds one traceback per node."""
    tb = ("[rank{r}]: Traceback (most recent call last):\n[rank{r}]:   File \"train.py\", line 160, in train_step\n"
          "[rank{r}]: KeyError: 'attention_mask'")
    recs = steps(T0, T0 + 200) + gpu_samples(T0, T0 + 900)
    recs += [NcclEvent(ts=T0 + 200 + r / 50, node=TOPO.node_of(r), kind="traceback", rank=r, raw=tb.format(r=r))
             for r in range(0, 32, 8)]
    incidents, actions = diagnose(recs)
    assert [a.type for a in actions] == ["rollback_code"] and actions[0].nodes == []
    assert not [i for i in incidents if i.kind == "hang" and i.status == "open"]


def test_infra_exception_is_not_rolled_back():
    raw = "[rank3]: torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3763, remote process exited"
    recs = [NcclEvent(ts=T0 + r, node=TOPO.node_of(r), kind="traceback", rank=r, raw=raw) for r in range(32)]
    _, actions = diagnose(recs + gpu_samples(T0, T0 + 100))
    assert "rollback_code" not in [a.type for a in actions]


def _hang_records(with_stacks: bool):
    healthy = (FIXTURES / "stacks" / "eval_dataloader_hang" / "healthy.txt").read_text()
    stuck = (FIXTURES / "stacks" / "eval_dataloader_hang" / "stuck.txt").read_text()
    recs = steps(T0, T0 + 300) + gpu_samples(T0, T0 + 1500)
    if with_stacks:
        recs += [StackDump(ts=T0 + 700, job="j1", node=TOPO.node_of(r), rank=r, pid=100 + r,
                           text=stuck if r == 19 else healthy) for r in range(32)]
    return recs


def test_hang_with_stacks_evicts_the_demarcated_group():
    incidents, actions = diagnose(_hang_records(True))
    assert [(a.type, a.nodes) for a in actions] == [("evict_nodes", ["n003"])]
    assert actions[0].plan["outliers"] == [19]
    hang = next(i for i in incidents if i.kind == "hang")
    assert hang.suspects[0]["node"] == "n003"


def test_hang_without_stacks_in_batch_runs_diagnostics_rather_than_guessing():
    # No machine named: never run_diagnostics on no node (the runner refuses that, issue 24), but a
    # job-level restart with stop-time diagnostics requested on its machines.
    _, actions = diagnose(_hang_records(False))
    assert [(a.type, a.nodes) for a in actions] == [("restart_job", [])]
    assert actions[0].plan["diagnostics_requested"] is True
    assert "stop-time diagnostics" in actions[0].reason


def test_online_hang_asks_for_stacks_first():
    engine = DiagnosisEngine(Config(), batch=False)
    engine.set_topology(JOB)
    outputs = run_records(engine, sorted(steps(T0, T0 + 60) + gpu_samples(T0, T0 + 400), key=lambda r: r.ts))
    commands = [o for o in outputs if isinstance(o, Command)]
    assert [(c.kind, c.job) for c in commands] == [("dump_stacks", "j1")]


def test_nan_loss_without_culprit_runs_diagnostics():
    recs = steps(T0, T0 + 100) + steps(T0 + 100, T0 + 105, loss=float("nan")) + gpu_samples(T0, T0 + 300)
    _, actions = diagnose(recs)
    assert [a.type for a in actions] == ["run_diagnostics"]


def test_counter_rule_flows_into_an_eviction():
    recs = gpu_samples(T0, T0 + 100)
    bad = GpuSample(ts=T0 + 105, node="n004", gpus=[GpuState(index=3, ecc_dbe=0)])
    worse = GpuSample(ts=T0 + 115, node="n004", gpus=[GpuState(index=3, ecc_dbe=2)])
    _, actions = diagnose(recs + [bad, worse])
    assert [(a.type, a.nodes) for a in actions] == [("evict_nodes", ["n004"])]
    assert actions[0].suspects[0]["gpu"] == 3


def test_storm_across_many_nodes_becomes_one_fabric_notify():
    topo = Topology.packed(tp=8, pp=4, dp=4, gpus_per_node=8, job="big")  # 16 nodes
    job = JobTopology(ts=T0, job="big", **{k: v for k, v in topo.to_job_dict().items() if k != "job"})
    recs = [kernel(T0 + i, n, XID79, "xid", 79) for i, n in enumerate(topo.nodes[:10])]
    cfg = Config(guard=GuardConfig(storm_nodes=8, max_evictions_per_job_per_hour=100, max_evicted_fraction=1.0))
    _, actions = diagnose_records(job, recs, cfg)
    evicted = [n for a in actions if a.type == "evict_nodes" for n in a.nodes]
    assert len(evicted) == 7  # the eighth blamed node is the storm
    assert any(a.type == "notify" and "fabric-level storm" in a.reason for a in actions)
    assert all(a.type != "evict_nodes" for a in actions[actions.index(next(a for a in actions if a.type == "notify")):])


def test_blast_radius_cap_and_breaker_needs_a_person():
    recs = [kernel(T0 + 10 * i, n, XID79, "xid", 79) for i, n in enumerate(["n001", "n002"])]
    cfg = Config(guard=GuardConfig(max_evictions_per_job_per_hour=1))
    engine = DiagnosisEngine(cfg, batch=True)
    engine.set_topology(JOB)
    outputs = run_records(engine, recs)
    types = [(o.type, o.nodes) for o in outputs if type(o).__name__ == "Action"]
    assert types[0] == ("evict_nodes", ["n001"]) and types[1][0] == "notify"
    book = engine.guard_log.book
    assert JOB.job in book.job_breakers
    engine.guard_log.reset("job", job=JOB.job, by="tester", reason="checked n002")
    assert JOB.job not in book.job_breakers and book.resets[-1]["by"] == "tester"


def test_dry_run_is_the_default_and_configurable():
    recs = [kernel(T0, "n001", XID79, "xid", 79)]
    _, actions = diagnose(recs)
    assert actions[0].dry_run is True
    _, actions = diagnose(recs, Config(guard=GuardConfig(dry_run=False)))
    assert actions[0].dry_run is False


def test_duplicate_actions_are_suppressed():
    recs = [kernel(T0, "n001", XID79, "xid", 79), kernel(T0 + 400, "n001", XID79, "xid", 79)]
    _, actions = diagnose(recs)
    assert len(actions) == 1


class _FakeSlowDetector:
    """A detector that names a machine on the 50th step it sees (a plug-in, not a stub of ours)."""

    name = "fake-slow"

    def __init__(self):
        self.seen = 0

    def set_topology(self, topology):
        self.topology = topology

    def observe(self, record):
        if isinstance(record, StepTiming) and record.rank == 0:
            self.seen += 1
            if self.seen == 50:
                return [Finding(ts=record.ts, kind="fail_slow", category="unknown", severity="critical",
                                action="evict_node", confidence=0.95, source="model:fake-slow", rule="fake",
                                text="rank 9 slow", node="n002", job="j1", rank=9)]
        return []

    def tick(self, now):
        return []


def test_detectors_plug_in_structurally():
    det = _FakeSlowDetector()
    assert isinstance(det, Detector)
    _, actions = diagnose(steps(T0, T0 + 100), detectors=[det])
    assert [(a.type, a.nodes) for a in actions] == [("evict_nodes", ["n002"])]


def test_prior_blame_is_remembered_in_node_health():
    health = NodeHealth(":memory:")
    diagnose([kernel(T0, "n001", XID79, "xid", 79)], node_health=health)
    assert health.prior_blames("n001") == 1 and "n001" in health.quarantined()
    incidents, _ = diagnose([kernel(T0 + 9000, "n001", XID79, "xid", 79)], node_health=health,
                            config=dataclasses.replace(Config()))
    assert "blamed in 1 earlier" in incidents[0].suspects[0]["reason"]


def test_earlier_blames_are_said_once_and_never_count_the_incident_itself():
    """A machine's only incident, with five lines on it, said "(blamed in 1 earlier incident(s))" five
    times: its own blame counted as an earlier one, once per absorbed line."""
    health = NodeHealth(":memory:")
    lines = [kernel(T0 + i, "n001", XID79, "xid", 79) for i in range(5)]
    incidents, _ = diagnose(lines, node_health=health)
    assert health.prior_blames("n001") == 1  # blamed now, by this incident
    assert [i.suspects[0]["reason"].count("blamed in") for i in incidents] == [0]
    again, _ = diagnose([kernel(T0 + 9000 + i, "n001", XID79, "xid", 79) for i in range(5)], node_health=health)
    assert [i.suspects[0]["reason"].count("blamed in 1 earlier incident(s)") for i in again] == [1]


def test_a_rank_whose_gradient_overflowed_alone_before_the_nan_is_the_suspect():
    """Rank 13's grad norm is Infinity two steps before every rank's loss goes NaN (as a JSON
    writer prints it, "Infinity"): the decoder keeps it, and NaN diagnosis names rank 13's node."""
    import json
    import math

    from faultlens import decode as decoder

    recs = gpu_samples(T0, T0 + 400)
    for step in range(300):
        for r in range(32):
            loss = math.nan if step >= 200 else 2.0
            grad = "Infinity" if (r == 13 and step >= 198) else ("NaN" if step >= 200 else 1.0)
            line = {"v": 1, "ts": T0 + step, "job": "j1", "rank": r, "node": TOPO.node_of(r), "step": step,
                    "duration_s": 1.0, "loss": "NaN" if loss != loss else loss, "grad_norm": grad}
            recs.append(decoder.decode("steps", json.dumps(line).encode()))
    _, actions = diagnose(recs)
    nan_actions = [a for a in actions if a.type == "run_diagnostics"]
    assert nan_actions and nan_actions[0].nodes == [TOPO.node_of(13)]
    assert "rank(s) [13]" in nan_actions[0].reason and "step 198" in nan_actions[0].reason
