"""Implicit faults from the evidence a real job leaves, through the batch path (`faultlens diagnose DIR`).

The directories are written here in a shape faultlens's simulator does not use (4 GPUs a
node, 7.3 s and 31 s steps, 5 s NVML samples as integers, syslog-prefixed kernel lines, no
NCCL watchdog line), so the engine is tested on the fault, not on the simulator's
rendering: a hang whose only evidence is that the steps stop while the GPUs stay busy
(py-spy dumps of every rank in stacks/), a job that simply finished, a storage stall with
hung tasks on every node, NaN loss with and without a culprit rank.
"""

from __future__ import annotations

import json
from datetime import UTC
from pathlib import Path

from faultlens.collectors.batch import read_batch_dir
from faultlens.config import Config
from faultlens.diagnosis.batch import diagnose_records
from faultlens.diagnosis.engine import DiagnosisEngine, default_detectors
from faultlens.diagnosis.modes import ONLINE
from faultlens.schema import Command, StackDump

from .conftest import FIXTURES

T0 = 1_732_000_000.0
NODES = ["gpu-a07", "gpu-a11", "gpu-b02"]
GPUS = 4
TP, DP = 4, 3  # ranks 0-3 on gpu-a07, 4-7 on gpu-a11, 8-11 on gpu-b02
STACKS = FIXTURES / "stacks" / "eval_dataloader_hang"
# The kernel's hung-task report, as syslog writes it (a real line's shape: tests/fixtures/kernel/real).
HUNG = ["{stamp} {node} kernel: [{up:.6f}] INFO: task python3:{pid} blocked for more than 120 seconds.",
        "{stamp} {node} kernel: [{up:.6f}]       Not tainted 5.15.0-122-generic #132-Ubuntu",
        '{stamp} {node} kernel: [{up:.6f}] "echo 0 > /proc/sys/kernel/hung_task_timeout_secs" disables this message.',
        "{stamp} {node} kernel: [{up:.6f}] task:python3         state:D stack:0     pid:{pid} ppid:1 flags:0x00004002",
        "{stamp} {node} kernel: [{up:.6f}] Call Trace:",
        "{stamp} {node} kernel: [{up:.6f}]  rpc_wait_bit_killable+0x25/0xb0 [sunrpc]",
        "{stamp} {node} kernel: [{up:.6f}]  nfs_wait_on_request+0x3e/0x50 [nfs]"]


def node_of(rank: int) -> str:
    return NODES[rank // GPUS]


def write_dir(root: Path, *, step_s: float, steps_until: float, gpu_until: float, busy_after: bool = True,
              idle_ranks: tuple[int, ...] = (), memory_after: bool = True, stacks: dict[int, str] | None = None,
              loss=None, kernel: dict[str, list[str]] | None = None, nccl: dict[str, list[str]] | None = None) -> Path:
    """A batch directory (DESIGN.md "Batch path") of one 12-rank job."""
    root.mkdir(parents=True)
    ranks = {str(r): {"node": node_of(r), "gpu": r % GPUS} for r in range(TP * DP)}
    (root / "job.json").write_text(json.dumps({"job": "llm-7b", "tp": TP, "pp": 1, "dp": DP, "cp": 1,
                                               "order": "tp-cp-dp-pp", "ranks": ranks}))
    lines, step, t = [], 0, T0
    while t < steps_until:
        for r in range(TP * DP):
            rec = {"v": 1, "ts": round(t + 0.01 * r, 3), "job": "llm-7b", "rank": r, "node": node_of(r), "step": step,
                   "duration_s": step_s, "n_seqs": 64, "sum_len": 262144, "sum_len_sq": 1.3e9, "tokens": 262144}
            value = loss(step, r) if loss else 2.5 - 0.001 * step
            rec["loss"] = value
            rec["grad_norm"] = 0.8 if value is not None else None
            lines.append(json.dumps(rec))
        step, t = step + 1, t + step_s
    (root / "steps").mkdir()
    (root / "steps" / "train.jsonl").write_text("\n".join(lines) + "\n")
    for n, node in enumerate(NODES):
        nd = root / "nodes" / node
        nd.mkdir(parents=True)
        out, t = [], T0 - 20 + n * 0.7
        while t < gpu_until:
            stepping = t < steps_until
            gpus = []
            for g in range(GPUS):
                rank = n * GPUS + g
                busy = stepping or (busy_after and rank not in idle_ranks)
                held = stepping or memory_after
                gpus.append({"index": g, "uuid": f"GPU-{node}-{g}", "pci_bus": f"0000:{0x1b + g:02x}:00.0",
                             "util": 98 if busy else 0, "mem_used_mb": 71234 if held else 3, "temp_c": 61 if busy else 38,
                             "power_w": 540.5 if busy else 69.0, "sm_clock_mhz": 1980 if busy else 210,
                             "throttle_reasons": 0, "ecc_sbe": 0, "ecc_dbe": 0, "retired_pages": 0,
                             "remap_pending": False, "pcie_replay": 0, "nvlink_errors": 0})
            out.append(json.dumps({"v": 1, "ts": round(t, 3), "node": node, "gpus": gpus}))
            t += 5.0
        (nd / "gpu.jsonl").write_text("\n".join(out) + "\n")
        (nd / "kernel.log").write_text("\n".join((kernel or {}).get(node, [])) + "\n")
        if nccl and node in nccl:
            (nd / "nccl").mkdir()
            (nd / "nccl" / "rank.log").write_text("\n".join(nccl[node]) + "\n")
    if stacks:
        (root / "stacks").mkdir()
        for r, text in stacks.items():
            (root / "stacks" / f"{r}.txt").write_text(text)
    return root


def diagnose(root: Path):
    data = read_batch_dir(root)
    return diagnose_records(data.job, list(data.records()), Config(), detectors=default_detectors())


def feed(engine: DiagnosisEngine, records) -> list:
    """Online: records in event-time order, a tick every 10 s of it, never a final tick."""
    out, next_tick = [], None
    for rec in records:
        next_tick = rec.ts if next_tick is None else next_tick
        while rec.ts >= next_tick:
            out += engine.tick(next_tick)
            next_tick += 10.0
        out += engine.observe(rec)
    return out


def every_rank_stacks(odd: int) -> dict[int, str]:
    healthy, stuck = (STACKS / "healthy.txt").read_text(), (STACKS / "stuck.txt").read_text()
    return {r: stuck if r == odd else healthy for r in range(TP * DP)}


# ---------------------------------------------------------------------------- 1. hang without a watchdog line

def test_silent_hang_with_stacks_evicts_the_odd_ranks_group(tmp_path):
    root = write_dir(tmp_path / "hang", step_s=7.3, steps_until=T0 + 900, gpu_until=T0 + 1800, idle_ranks=(6,),
                     stacks=every_rank_stacks(6))
    incidents, actions = diagnose(root)
    hang = [i for i in incidents if i.kind == "hang"]
    assert len(hang) == 1 and hang[0].evidence[0]["rule"] == "engine:no_step_progress"
    assert "hosts are alive" in hang[0].evidence[0]["text"]
    assert [(a.type, a.nodes) for a in actions] == [("evict_nodes", ["gpu-a11"])]
    assert actions[0].plan["outliers"] == [6]


def test_silent_hang_at_the_inputs_end_with_slow_steps(tmp_path):
    # 31 s steps: the full threshold (20 steps, capped at 600 s) is not reached before the input ends;
    # the busy GPUs after the last step and the stacks still make it a hang.
    root = write_dir(tmp_path / "slow", step_s=31.0, steps_until=T0 + 1500, gpu_until=T0 + 1500 + 240,
                     stacks=every_rank_stacks(9))
    incidents, actions = diagnose(root)
    hang = next(i for i in incidents if i.kind == "hang")
    assert hang.evidence[0]["figures"]["end_of_input"] is True
    assert [(a.type, a.nodes) for a in actions] == [("evict_nodes", ["gpu-b02"])]


def test_finished_job_is_not_a_hang(tmp_path):
    # Steps end, every GPU goes idle and releases the job's memory: the job finished.
    root = write_dir(tmp_path / "done", step_s=7.3, steps_until=T0 + 900, gpu_until=T0 + 2400, busy_after=False,
                     memory_after=False)
    incidents, actions = diagnose(root)
    assert actions == [] and not [i for i in incidents if i.kind == "hang"]


def test_input_that_ends_with_the_last_step_is_not_a_hang(tmp_path):
    root = write_dir(tmp_path / "cut", step_s=7.3, steps_until=T0 + 900, gpu_until=T0 + 905)
    incidents, actions = diagnose(root)
    assert actions == [] and not [i for i in incidents if i.kind == "hang"]


def test_online_silent_hang_asks_the_agents_for_stacks_then_demarcates(tmp_path):
    root = write_dir(tmp_path / "online", step_s=7.3, steps_until=T0 + 600, gpu_until=T0 + 1200, idle_ranks=(2,))
    data = read_batch_dir(root)
    engine = DiagnosisEngine(Config(), mode=ONLINE)
    engine.set_topology(data.job)
    records = list(data.records())
    asked = T0 + 600 + 60 + 146 + 10  # after the silence threshold (20 median steps) and the next tick
    outputs = feed(engine, [r for r in records if r.ts < asked])
    commands = [o for o in outputs if isinstance(o, Command)]
    assert [(c.kind, c.job) for c in commands] == [("dump_stacks", "llm-7b")]
    assert not [o for o in outputs if type(o).KIND == "actions"]
    # the agents answer within seconds: every rank's dump, rank 2's apart
    for r, text in every_rank_stacks(2).items():
        engine.observe(StackDump(ts=commands[0].ts + 3, job="llm-7b", node=node_of(r), rank=r, pid=4000 + r, text=text))
    later = feed(engine, [r for r in records if r.ts >= asked])
    actions = [o for o in later if type(o).KIND == "actions"]
    assert [(a.type, a.nodes) for a in actions] == [("evict_nodes", ["gpu-a07"])]


# ---------------------------------------------------------------------------- 2. job-wide storage stall

def _hung_on(node: str, at: float, pid: int) -> list[str]:
    from datetime import datetime

    stamp = datetime.fromtimestamp(at, UTC).strftime("%b %d %H:%M:%S")
    return [h.format(stamp=stamp, node=node, up=at - T0 + 86400.0, pid=pid) for h in HUNG]


def test_hung_tasks_on_every_node_are_one_storage_incident_with_notify(tmp_path):
    kernel = {node: _hung_on(node, T0 + 700 + 9 * n, 31000 + n) for n, node in enumerate(NODES)}
    root = write_dir(tmp_path / "storage", step_s=7.3, steps_until=T0 + 1500, gpu_until=T0 + 1500, kernel=kernel)
    incidents, actions = diagnose(root)
    assert [(a.type, a.nodes) for a in actions] == [("notify", [])]
    assert "job-wide storage" in actions[0].reason and "no machine is at fault" in actions[0].reason
    shared = [i for i in incidents if i.kind == "storage"]
    assert len(shared) == 1 and not shared[0].suspects  # no machine is at fault
    assert "3/3 nodes" in shared[0].summary
    folded = [i for i in incidents if i.kind == "hung_task"]
    assert folded and all(i.status == "resolved" and shared[0].id in i.summary for i in folded)


def test_hung_task_on_one_node_stays_that_nodes_incident(tmp_path):
    root = write_dir(tmp_path / "one", step_s=7.3, steps_until=T0 + 1500, gpu_until=T0 + 1500,
                     kernel={"gpu-a11": _hung_on("gpu-a11", T0 + 700, 31001)})
    _, actions = diagnose(root)
    assert [(a.type, a.nodes) for a in actions] == [("run_diagnostics", ["gpu-a11"])]


# ---------------------------------------------------------------------------- 3. NaN loss

def test_nan_on_every_rank_at_once_checks_every_machine_of_the_job(tmp_path):
    root = write_dir(tmp_path / "nan", step_s=7.3, steps_until=T0 + 900, gpu_until=T0 + 900,
                     loss=lambda step, r: None if step >= 80 else 2.5 - 0.001 * step)  # JSON: NaN became null
    incidents, actions = diagnose(root)
    assert [(a.type, sorted(a.nodes)) for a in actions] == [("run_diagnostics", sorted(NODES))]
    assert "no machine to blame" in actions[0].reason
    assert next(i for i in incidents if i.kind == "nan_loss").status != "open"


def test_nan_on_one_rank_first_names_its_machine(tmp_path):
    def loss(step: int, r: int):
        if step >= 81 or (step == 80 and r == 10):
            return None  # NaN: JSON has none, the writer leaves it null
        return 2.5 - 0.001 * step

    root = write_dir(tmp_path / "nan1", step_s=7.3, steps_until=T0 + 900, gpu_until=T0 + 900, loss=loss)
    incidents, actions = diagnose(root)
    assert [(a.type, a.nodes) for a in actions] == [("run_diagnostics", ["gpu-b02"])]
    assert "diverged first at step 80" in actions[0].reason
    nan = next(i for i in incidents if i.kind == "nan_loss")
    assert nan.suspects[0]["node"] == "gpu-b02" and 10 in nan.suspects[0]["ranks"]


def test_nan_named_by_a_ranks_own_log_line(tmp_path):
    line = ("[rank5]: RuntimeError: Rank 5: found NaN in local grad norm in backward pass before data-parallel "
            "communication collective. Device: 1, node: gpu-a11")
    root = write_dir(tmp_path / "nan2", step_s=7.3, steps_until=T0 + 600, gpu_until=T0 + 700,
                     nccl={"gpu-a11": [f"2024-11-19T07:10:01.123456+00:00 {line}"]})
    _, actions = diagnose(root)
    assert ("run_diagnostics", ["gpu-a11"]) in [(a.type, a.nodes) for a in actions]
    assert "rollback_code" not in [a.type for a in actions]


# Xid lines as syslog writes the kernel's line (the messages of real ones: datasets/conformance
# shipped-014, gpud's dmesg-time-format-iso.log: "NVRM: Xid (PCI:0000:19:00): 48, ..." and ": 63, ...").
XID = "{stamp} {node} kernel: [{up:.6f}] NVRM: Xid (PCI:0000:1c:00): {msg}"
XID48 = ("48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error (DBE) has been detected on GPU in "
         "the framebuffer at physAddr 0x12bac1c3e0 partition 2, subpartition 1.")
XID63 = ("63, pid='<unknown>', name=<unknown>, Row Remapper: New row (0x00000012bac1c3e0) marked for remapping, reset "
         "gpu to activate.")


def _xid_on(node: str, at: float, msg: str) -> list[str]:
    from datetime import datetime

    return [XID.format(stamp=datetime.fromtimestamp(at, UTC).strftime("%b %d %H:%M:%S"), node=node,
                       up=at - T0 + 86400.0, msg=msg)]


def _nan_from(first_bad_step: int):
    return lambda step, r: None if step >= first_bad_step else 2.5 - 0.001 * step


def test_nan_after_an_uncorrectable_ecc_error_is_explained_by_that_machines_eviction(tmp_path):
    # gpu-a11 printed an Xid 48 a minute before every rank's loss went bad at once: the machine is
    # evicted for its ECC error, and the NaN incident's machine search names it and says the eviction
    # explains it (no second action, no checks on the whole job).
    root = write_dir(tmp_path / "nan_xid48", step_s=7.3, steps_until=T0 + 900, gpu_until=T0 + 900,
                     loss=_nan_from(80), kernel={"gpu-a11": _xid_on("gpu-a11", T0 + 80 * 7.3 - 60, XID48)})
    incidents, actions = diagnose(root)
    assert [(a.type, a.nodes) for a in actions] == [("evict_nodes", ["gpu-a11"])]
    nan = next(i for i in incidents if i.kind == "nan_loss")
    assert [s["node"] for s in nan.suspects] == ["gpu-a11"]
    assert "explained by the eviction of gpu-a11" in nan.summary and "ecc_uncorrectable" in nan.summary


def test_nan_with_ecc_evidence_in_the_window_names_that_machine(tmp_path):
    # Every rank's loss goes bad at once (no rank first), and gpu-a11 printed an Xid 63 (a row marked for
    # remapping: ECC evidence that evicts nothing by itself) a minute before: the machine search finds
    # it and the stop-time checks go there, not to the whole job.
    root = write_dir(tmp_path / "nan_xid63", step_s=7.3, steps_until=T0 + 900, gpu_until=T0 + 900,
                     loss=_nan_from(80), kernel={"gpu-a11": _xid_on("gpu-a11", T0 + 80 * 7.3 - 60, XID63)})
    incidents, actions = diagnose(root)
    nan = next(i for i in incidents if i.kind == "nan_loss")
    # Xid 63 is informational (explain: info/none): no incident of its own, but evidence on its machine
    assert not [i for i in incidents if i.kind == "row_remap_failure"]
    assert [s["node"] for s in nan.suspects] == ["gpu-a11"]
    mine = [a for a in actions if a.incident_id == nan.id]
    assert [(a.type, a.nodes) for a in mine] == [("run_diagnostics", ["gpu-a11"])]
    assert "row_remap_failure evidence on gpu-a11 in the window" in mine[0].reason and "Xid" in mine[0].reason


def test_nan_with_ecc_evidence_long_before_checks_the_whole_job(tmp_path):
    # The same Xid 63, but 20 minutes before the NaN (outside the 15-minute window): no culprit.
    root = write_dir(tmp_path / "nan_old_xid", step_s=7.3, steps_until=T0 + 1800, gpu_until=T0 + 1800,
                     loss=_nan_from(220), kernel={"gpu-a11": _xid_on("gpu-a11", T0 + 220 * 7.3 - 1200, XID63)})
    incidents, actions = diagnose(root)
    nan = next(i for i in incidents if i.kind == "nan_loss")
    mine = [a for a in actions if a.incident_id == nan.id]
    assert [(a.type, sorted(a.nodes)) for a in mine] == [("run_diagnostics", sorted(NODES))]
    assert "no machine to blame" in mine[0].reason


def test_online_nan_without_a_culprit_is_never_no_action(tmp_path):
    # Online, no final tick: the NaN incident still decides once every rank reported (nan_settle_s).
    root = write_dir(tmp_path / "nan_online", step_s=7.3, steps_until=T0 + 900, gpu_until=T0 + 900,
                     loss=_nan_from(80))
    data = read_batch_dir(root)
    engine = DiagnosisEngine(Config(), mode=ONLINE)
    engine.set_topology(data.job)
    outputs = feed(engine, list(data.records()))
    actions = [o for o in outputs if type(o).KIND == "actions"]
    assert [(a.type, sorted(a.nodes)) for a in actions] == [("run_diagnostics", sorted(NODES))]
    assert actions[0].dry_run and "no machine to blame" in actions[0].reason
    assert actions[0].ts < T0 + 80 * 7.3 + 60  # within a minute of the first bad step
