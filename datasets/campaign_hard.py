"""Hard renders of a campaign failure (issue 35 item 7): the clean slice render, then its evidence made as a
real fleet makes it.

A clean render (campaign_render) shows every signal a fault leaves. A real fleet loses some and adds others:

* **hangs with partial evidence** (``HANG_KINDS``): some ranks' py-spy dumps never come (every rank of 1-2
  nodes that do not answer, or a random 10-30% of ranks, the stuck one included), no Flight Recorder dump
  (the simulator writes none), and for a hung task, with probability ``KERNEL_LINE_LOST_P``, the kernel's
  "blocked for more than 120 seconds" record lost, so the stacks alone must decide;
* **cascades** (``CASCADE_KINDS``): the fault's symptoms spreading over the job: on every other node one
  rank's NET/IB completion error and ncclRemoteError naming the culprit, arriving after the NCCL timeout
  (beside the watchdog aborts); a benign transient on another node in the same window (an IB link flap that
  recovers, or a burst of corrected PCIe AER records, on a machine no other fault of the render touches); the culprit's own later lines (its Xid burst again,
  pid unknown once the process is gone; the IB link going down once more). Fail-slow kinds (thermal, PCIe)
  stop nothing, so they get the transient only.

Every added line comes from the simulator's own signal functions (signal_kernel, signal_nccl) through the
scenario's effects, so the renderer writes it in the node's kernel-log format and the real parser reads it;
every dropped dump is a file removed from the batch directory. Kinds outside ``HARD`` keep their clean
render. Deterministic per (kind, i): the seed and noise are ``sample_noise``'s, the hardening's draws
``default_rng([seed, 35])``. Scored by campaign_render's ``score`` against the same truth.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from faultlens.config import Config
from faultlens.datasets import signal_kernel as k
from faultlens.datasets import signal_nccl as nc
from faultlens.datasets.campaign_render import (
    Decision,
    Noise,
    SliceLayout,
    _slow_speed,
    diagnose_rendered,
    render_duration_s,
    replan_on_job,
    score,
    slice_spec,
)
from faultlens.datasets.cluster import GPU_PCI_DEVICE_ID
from faultlens.datasets.scenario import Scenario, ScenarioSpec
from faultlens.stream.topology import Topology
from faultlens.vocabulary import ActionType, FaultKind

A = ActionType
F = FaultKind
HANG_KINDS: tuple[str, ...] = (F.HANG_STUCK_RANK, F.HUNG_TASK)
CASCADE_KINDS: tuple[str, ...] = (F.GPU_LOST, F.ECC_UNCORRECTABLE, F.ROW_REMAP_FAILURE, F.NVLINK_ERROR,
                                  F.IB_LINK_PERSISTENT, F.HOST_OOM, F.THERMAL_THROTTLE, F.PCIE_DEGRADATION)
HARD: tuple[str, ...] = HANG_KINDS + CASCADE_KINDS
KERNEL_LINE_LOST_P = 0.3  # a hung task whose khungtaskd record the agent missed
NODES_SILENT_P = 0.5  # a hang render loses whole nodes' dumps (else a random share of ranks)
RANKS_LOST = (0.10, 0.30)  # the share of ranks whose dump never comes
REPEATING = (F.GPU_LOST, F.ECC_UNCORRECTABLE, F.ROW_REMAP_FAILURE, F.NVLINK_ERROR, F.IB_LINK_PERSISTENT)
_PID = re.compile(r"pid=\d+, name=[^,]+,")
_HEADER = ("NVRM: GPU at PCI:", "NVRM: GPU Board Serial Number:")


def hard_digest() -> str:
    """A digest of this file: a cache of hard decisions is keyed by it beside the engine's."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:8]


@dataclass
class Hardening:
    """What a hard render changed in the clean one (for the test and the report)."""

    family: str = "clean"  # hang | cascade | clean
    dumps_dropped: list[int] = field(default_factory=list)  # ranks whose stack dump file was removed
    silent_nodes: list[str] = field(default_factory=list)  # nodes none of whose dumps came
    kernel_line_lost: bool = False
    peer_errors: dict[str, int] = field(default_factory=dict)  # node -> rank given a late NCCL error
    transient: str = ""  # "ib_flap <node>" | "aer_burst <node>"
    repeats: int = 0  # culprit kernel records rendered again later

    def text(self) -> str:
        if self.family == "hang":
            where = f"nodes {','.join(self.silent_nodes)} silent" if self.silent_nodes else "random ranks"
            return (f"{len(self.dumps_dropped)} dumps missing ({where}), no Flight Recorder"
                    + (", kernel hung-task line lost" if self.kernel_line_lost else ""))
        if self.family == "cascade":
            return (f"late NCCL errors on {len(self.peer_errors)} peer nodes, {self.transient or 'no transient'}, "
                    f"{self.repeats} culprit records repeated")
        return "clean render"


def _culprit(sc: Scenario) -> tuple[str, int | None, float]:
    f = sc.truth()["faults"][0]
    ranks = f.get("ranks") or []
    node = f["nodes"][0] if f["nodes"] else sc.topology.node_of(ranks[0])
    return node, (int(ranks[0]) if ranks else None), float(f["onset_ts"])


def harden_hang(sc: Scenario, kind: str, rng: np.random.Generator) -> Hardening:
    """Partial evidence of a hang: which dumps to drop, and (hung_task) the kernel line taken out of the effects."""
    node, _, _ = _culprit(sc)
    h = Hardening("hang")
    others = [n for n in sc.cluster.node_names if n != node]
    if others and rng.random() < NODES_SILENT_P:
        h.silent_nodes = sorted(str(n) for n in rng.choice(others, min(len(others), int(rng.integers(1, 3))),
                                                           replace=False))
        h.dumps_dropped = sorted(r for n in h.silent_nodes for r in sc.topology.ranks_on(n))
    else:
        world = sc.topology.world_size
        share = float(rng.uniform(*RANKS_LOST))
        h.dumps_dropped = sorted(int(r) for r in rng.choice(world, max(1, round(share * world)), replace=False))
    if kind == F.HUNG_TASK and rng.random() < KERNEL_LINE_LOST_P:
        fx = sc.effects
        starts = [ts for n, ts, lines in fx.kernel if n == node and lines[0].startswith("INFO: task ")
                  and "blocked for more than" in lines[0]]
        if starts:
            at = min(starts)
            fx.kernel[:] = [e for e in fx.kernel if not (e[0] == node and at <= e[1] < at + 0.001)]
            h.kernel_line_lost = True
    return h


def harden_cascade(sc: Scenario, kind: str, rng: np.random.Generator) -> Hardening:
    """A cascade: late peer NCCL errors naming the culprit, a benign transient elsewhere, the culprit's repeats."""
    fx = sc.effects
    node, rank, onset = _culprit(sc)
    h = Hardening("cascade")
    c, topo, procs = sc.cluster, sc.topology, sc.procs
    gpu = topo.gpu_of(rank) if rank is not None else 0
    # late peer errors: one rank per other node (the culprit's rail peer when it waits), after its watchdog
    culprit_ip = c.node_ip(node)
    port = int(rng.integers(32768, 60999))
    for w in fx.watchdogs:
        for n in c.node_names:
            if n == node or n in h.peer_errors:
                continue
            waiting = [r for r in w.ranks if topo.node_of(r) == n]
            if not waiting:
                continue
            q = procs[next((r for r in waiting if topo.gpu_of(r) == gpu), waiting[0])]
            ts = w.fire_ts + 0.0013 * (q.rank % 97) + float(rng.uniform(0.01, 0.2))
            if ts >= sc.end_ts:
                continue
            for t_, line in nc.ib_completion_error(q, ts, culprit_ip, port + len(h.peer_errors), 12, 129, "Recv"):
                fx.nccl.append((q.rank, t_, line))
            last = (f"NET/IB : Got completion from peer {culprit_ip}<{port + len(h.peer_errors)}> with status=12 "
                    f"opcode=129 len=0 vendor err 129 (Recv) localGid ::ffff:{q.ip} remoteGids::ffff:{culprit_ip}")
            for i, line in enumerate(nc.dist_backend_error(q, last)):
                fx.nccl.append((q.rank, ts + 0.2 + 0.0001 * i, line))
            h.peer_errors[n] = q.rank
    # a benign transient in the same window on a machine no other fault of the render touches (a second flap
    # within 5 min on the machine of the noise's flap is the persistent-link signature, not a benign one)
    busy = {n for f in sc.truth()["faults"] for n in f["nodes"]}
    others = [n for n in c.node_names if n != node and n not in busy]
    if others:
        other = str(others[int(rng.integers(0, len(others)))])
        t = max(sc.train_start_ts + 5.0, onset + float(rng.uniform(-60.0, 120.0)))
        g = int(rng.integers(0, c.gpus_per_node))
        if rng.random() < 0.5:
            outage = float(rng.uniform(1.5, 5.0))  # as fault_ib_flap_transient renders it
            fx.kernel.append((other, t, [k.ib_link(c.nic_pci(g), c.nic_name(g), "DOWN")]))
            fx.kernel.append((other, t + outage - 0.5, [k.ib_link(c.nic_pci(g), c.nic_name(g), "INIT")]))
            fx.kernel.append((other, t + outage, [k.ib_link(c.nic_pci(g), c.nic_name(g), "ACTIVE")]))
            h.transient = f"ib_flap {other}"
        else:
            dev = f"{c.gpu_pci(g)}.0"
            root = f"0000:{int(dev[5:7], 16) - 2:02x}:01.0"  # as fault_pcie_degradation names the root port
            for j in range(int(rng.integers(2, 5))):
                for i, rec in enumerate(k.aer_corrected(root, dev, GPU_PCI_DEVICE_ID,
                                                        "BadDLLP" if rng.random() < 0.7 else "BadTLP")):
                    fx.kernel.append((other, t + 0.4 * j + 0.00002 * i, rec))
            h.transient = f"aer_burst {other}"
    # the culprit's own later lines: its first burst again (the process gone: pid unknown)
    if kind in REPEATING:
        burst = [(ts, lines) for n, ts, lines in fx.kernel
                 if n == node and onset - 0.5 <= ts <= onset + 15.0 and not lines[0].startswith(_HEADER)]
        for _ in range(int(rng.integers(1, 3)) if burst else 0):
            shift = float(rng.uniform(20.0, 120.0))
            for ts, lines in burst:
                fx.kernel.append((node, ts + shift, [_PID.sub("pid='<unknown>', name=<unknown>,", x) for x in lines]))
                h.repeats += 1
    return h


def hard_spec(kind: str, layout: SliceLayout, seed: int, fault_class: str, nccl_timeout_s: float,
              noise: Noise | None = None) -> ScenarioSpec:
    """``slice_spec``'s scenario; a job-stopping cascade is rendered past the NCCL timeout (as a hang is), so
    the peers' watchdogs and late errors are in it."""
    spec = slice_spec(kind, layout, seed, fault_class, nccl_timeout_s, noise)
    if kind in CASCADE_KINDS and fault_class != "fail_slow":
        onset = (noise or Noise()).onset_s
        spec = replace(spec, duration_s=render_duration_s("hang", nccl_timeout_s, onset))
    return spec


class HardRendered(NamedTuple):
    decision: Decision
    records: list[Any]
    truth: dict[str, Any]
    hardening: Hardening


def harden(sc: Scenario, kind: str, seed: int) -> Hardening:
    """Apply ``kind``'s hardening to the scenario's effects (deterministic per seed); dumps are dropped later."""
    rng = np.random.default_rng([seed, 35])
    if kind in HANG_KINDS:
        return harden_hang(sc, kind, rng)
    if kind in CASCADE_KINDS:
        return harden_cascade(sc, kind, rng)
    return Hardening()


def decide_hard(kind: str, layout: SliceLayout, seed: int, bucket: int, *, fault_class: str, nccl_timeout_s: float,
                noise: Noise | None = None, config: Config | None = None, job_dp: int | None = None) -> HardRendered:
    """Render one failure on the slice as ``decide`` does, harden its evidence, diagnose in batch, score."""
    config = config or Config()
    t0 = time.perf_counter()
    sc = Scenario(hard_spec(kind, layout, seed, fault_class, nccl_timeout_s, noise))
    hardening = harden(sc, kind, seed)

    def drop(out: Path) -> None:
        for r in hardening.dumps_dropped:  # the agent got no answer from py-spy for these ranks
            (out / "stacks" / f"{r}.txt").unlink(missing_ok=True)
        shutil.rmtree(out / "flight_recorder", ignore_errors=True)

    data, records, truth, incidents, actions, t1, t2 = diagnose_rendered(sc, config, edit=drop)
    s = score(actions, incidents, truth)
    # a cascade's late errors may draw a later eviction of a healthy peer: every machine any eviction or
    # adaptation names counts (score looks at the first such action only)
    culprits = set(truth["faults"][0]["nodes"])
    named = {n for a in actions if a.type in (A.EVICT_NODES, A.ADAPT_PARALLELISM) for n in a.nodes}
    if named:
        s["named"], s["extra_machines"] = len(named), len(named - culprits)
    if job_dp and job_dp > layout.dp and s["action"] == A.ADAPT_PARALLELISM:  # as decide re-plans on the job
        chosen = next(a for a in actions if a.type == A.ADAPT_PARALLELISM)
        plan = replan_on_job(chosen, Topology.from_job(data.job), job_dp, config, gpus_per_node=layout.gpus_per_node)
        if plan is not None:
            best: dict[str, Any] = next((o for o in plan.get("options", []) if o.get("name") == plan.get("chosen")), {})
            s.update(slice_adapt_ratio=s["adapt_ratio"], job_plan=str(plan.get("chosen")),
                     adapt_ratio=float(best.get("ratio_to_healthy", s["adapt_ratio"] or 1.0)),
                     adapt_pause_s=float(best.get("pause_s", 0.0)))
    slow = _slow_speed(sc, float(truth["faults"][0]["onset_ts"])) if fault_class == "fail_slow" else 1.0
    decision = Decision(kind=kind, bucket=bucket, seed=seed, slow_speed=slow, records=len(records),
                        render_s=t1 - t0, diagnose_s=t2 - t1, path="hard", **s)
    return HardRendered(decision, records, truth, hardening)


def describe(kind: str, layout: SliceLayout, seed: int, *, fault_class: str, nccl_timeout_s: float,
             noise: Noise | None = None) -> str:
    """What the hard render of (kind, seed) changed, without rendering it (for the report's mistakes)."""
    if kind not in HARD:
        return Hardening().text()
    sc = Scenario(hard_spec(kind, layout, seed, fault_class, nccl_timeout_s, noise))
    return harden(sc, kind, seed).text()
