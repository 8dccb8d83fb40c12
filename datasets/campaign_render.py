"""What faultlens decides about one campaign failure: its signals rendered on a slice of the job, diagnosed.

A campaign (datasets/campaign.py) has hundreds of failures on a 1,200-machine job;
rendering the whole job for each would take hours and tell the engine nothing
more, because every rule and detector reasons inside the culprit's parallel
groups. So each failure is rendered on a *slice*: the culprit's pipeline
replica plus enough peer replicas for the peer and stack comparisons (same TP,
PP, layers and micro-batches as the job; DP cut to ``slice_dp``), with the
job's own NCCL timeout. The slice is written as a batch directory by the
simulator (datasets/scenario.py and the fault modules), read back with the
real parser (collectors.batch) and diagnosed by ``diagnosis.batch.diagnose_records``
— the code ``faultlens diagnose`` and the online service run. From the actions:
detection delay (first incident), decision delay (the decisive action), what it
did, which machines it named, and whether that was right against truth.json.

``decide_online`` sends the same records through the embedded broker to the
online ``DiagnosisService`` and returns its decision, so a sample of the cached
batch decisions is checked against the bus path.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import numpy as np

from faultlens import schema
from faultlens.collectors.batch import read_batch_dir
from faultlens.config import BusConfig, Config
from faultlens.datasets.cluster import ClusterSpec
from faultlens.datasets.scenario import FaultSpec, Scenario, ScenarioSpec
from faultlens.datasets.scenario_files import write_batch_dir
from faultlens.diagnosis.adaptation import shape_from_finding, speeds_from_finding
from faultlens.diagnosis.batch import diagnose_records
from faultlens.diagnosis.detectors import default_detectors
from faultlens.diagnosis.online import DiagnosisService
from faultlens.models.planner import AdaptationPlanner
from faultlens.schema import Action, Command, Finding, Incident, StackDump
from faultlens.stream.bus import Consumer, Producer, ensure_topics
from faultlens.stream.topology import Topology
from faultlens.vocabulary import ActionType

A = ActionType
# The strongest action a decision contains wins (as benchmarks/diagnosis.py scores it).
PRIORITY: tuple[str, ...] = (A.EVICT_NODES, A.ADAPT_PARALLELISM, A.ROLLBACK_CODE, A.RESTART_JOB,
                             A.RUN_DIAGNOSTICS, A.NOTIFY)
ONSET_S = 240.0  # healthy history before the fault: the step-time baselines need a few minutes
POST_S = 600.0  # seconds rendered after the onset (hangs: the NCCL timeout + 5 min, see render_duration_s)


@dataclass(frozen=True)
class SliceLayout:
    """The part of the job a failure is rendered on (the culprit's replica and its peers)."""

    gpus_per_node: int
    tp: int
    pp: int
    dp: int
    num_layers: int
    microbatches: int

    @property
    def nodes(self) -> int:
        return self.tp * self.pp * self.dp // self.gpus_per_node

    @property
    def key(self) -> str:
        return f"g{self.gpus_per_node}-tp{self.tp}-pp{self.pp}-dp{self.dp}-l{self.num_layers}-m{self.microbatches}"


@dataclass(frozen=True)
class Decision:
    """faultlens's answer to one rendered failure, measured against its ground truth."""

    kind: str
    bucket: int
    seed: int
    expected_action: str
    action: str  # the decisive action type, "none" when the engine emitted nothing decisive
    detect_s: float | None  # first incident opened - onset (None: nothing opened)
    decide_s: float  # decisive action - first incident (0 with no action)
    named: int  # machines the decisive action names (evicted or adapted around)
    culprit_named: bool
    extra_machines: int  # healthy machines named
    right: bool
    adapt_ratio: float | None  # adapt_parallelism: the chosen plan's predicted throughput / fault-free
    adapt_pause_s: float  # adapt_parallelism: the chosen plan's predicted pause
    slow_speed: float  # measured in the rendered steps: healthy median step / faulty median step (1.0: not slow)
    records: int
    render_s: float
    diagnose_s: float
    path: str = "batch"  # batch | bus
    slice_adapt_ratio: float | None = None  # the plan's ratio on the slice, before re-planning on the job
    job_plan: str = ""  # the option the planner chose on the whole job ("" when not re-planned)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Noise:
    """What else a failure's render carries besides its fault: a step-time jitter, benign kernel lines, and
    (``flap_node``) a link flap of the fleet on another machine that recovers by itself."""

    onset_s: float = ONSET_S
    step_noise: float = 0.01
    kernel_noise_per_hour: float = 12.0
    flap: bool = False


def render_duration_s(fault_class: str, nccl_timeout_s: float, onset_s: float = ONSET_S) -> float:
    """Seconds to render: hangs need the whole NCCL timeout so a watchdog-only decision can show."""
    post = nccl_timeout_s + 300.0 if fault_class == "hang" else POST_S
    return onset_s + post


def slice_spec(kind: str, layout: SliceLayout, seed: int, fault_class: str, nccl_timeout_s: float,
               noise: Noise | None = None) -> ScenarioSpec:
    """The scenario of one failure on the slice (seeded: the same key renders the same bytes).

    The fault draws its own machine and severity from ``seed``; ``noise`` sets the onset and what else
    the render carries (the first fault of the truth is always the one decided)."""
    noise = noise or Noise()
    cluster = ClusterSpec(nodes=layout.nodes, gpus_per_node=layout.gpus_per_node, tp=layout.tp, pp=layout.pp,
                          dp=layout.dp, microbatches=layout.microbatches, num_layers=layout.num_layers,
                          job=f"campaign-{kind}-{seed}")
    faults = [FaultSpec(kind=kind, id="f1", onset_s=noise.onset_s)]
    if noise.flap and kind != "ib_flap_transient":
        faults.append(FaultSpec(kind="ib_flap_transient", id="noise-flap", onset_s=max(30.0, noise.onset_s - 90.0)))
    return ScenarioSpec(name=f"campaign-{kind}-s{seed}", seed=seed, cluster=cluster,
                        duration_s=render_duration_s(fault_class, nccl_timeout_s, noise.onset_s),
                        faults=tuple(faults), watchdog_timeout_s=nccl_timeout_s, step_noise=noise.step_noise,
                        kernel_noise_per_hour=noise.kernel_noise_per_hour)


def _slow_speed(sc: Scenario, onset_ts: float) -> float:
    """Healthy median iteration / median iteration after the onset (what a slow machine costs the job)."""
    steps = sc.steps
    before = steps.duration[(steps.start < onset_ts) & (steps.start > sc.train_start_ts)]
    after = steps.duration[steps.start >= onset_ts + 30.0]
    if len(before) < 3 or len(after) < 3:
        return 1.0
    return float(min(1.0, np.median(before) / np.median(after)))


def score(actions: Sequence[Action], incidents: Sequence[Incident], truth: dict[str, Any]) -> dict[str, Any]:
    """The decisive action of a diagnosis and how it compares with the fault's truth."""
    fault = truth["faults"][0]
    onset = float(fault["onset_ts"])
    culprits = set(fault["nodes"])
    expected = str(fault["expected_action"])
    types = {a.type for a in actions}
    action = next((t for t in PRIORITY if t in types), "none")
    chosen = next((a for a in actions if a.type == action), None)
    named = set(chosen.nodes) if chosen is not None else set()
    opened = [i.opened_ts for i in incidents if i.opened_ts >= onset - 5.0]
    first_seen = min(opened) if opened else (chosen.ts if chosen is not None else None)
    detect = None if first_seen is None else max(0.0, first_seen - onset)
    decide = 0.0 if chosen is None or first_seen is None else max(0.0, chosen.ts - first_seen)
    if expected == A.EVICT_NODES:
        right = action in (A.EVICT_NODES, A.ADAPT_PARALLELISM) and culprits <= named
    elif expected in ("none", A.NOTIFY):
        right = action in ("none", A.NOTIFY)
    else:
        right = action == expected
    ratio, pause = None, 0.0
    if chosen is not None and action == A.ADAPT_PARALLELISM and chosen.plan:
        opts = {o.get("name"): o for o in chosen.plan.get("options", [])}
        best = opts.get(chosen.plan.get("chosen"), {})
        ratio = float(best.get("ratio_to_healthy", 1.0))
        pause = float(best.get("pause_s", 0.0))
    return {"action": action, "detect_s": detect, "decide_s": decide, "named": len(named),
            "culprit_named": bool(culprits) and culprits <= named, "extra_machines": len(named - culprits),
            "right": right, "adapt_ratio": ratio, "adapt_pause_s": pause, "expected_action": expected}


def replan_on_job(action: Action, slice_topology: Any, job_dp: int, config: Config, *,
                  gpus_per_node: int = 8) -> dict[str, Any] | None:
    """faultlens's planner on the whole job for a fail-slow decision made on the slice.

    The slice has 2 replicas, so rebalancing micro-batches across DP looks far worse there than on
    the job's DP; the engine on the real job would plan on its real topology. Same finding, same
    shape (per replica), the slow ranks mapped to the same coordinates in the job's layout; returns
    the plan dict (options with ``ratio_to_healthy`` and ``pause_s``) or None when the action
    carries no finding to re-plan from.
    """

    ev = next((e for e in action.evidence if (e.get("figures") or {}).get("slowdown") is not None
               or (e.get("figures") or {}).get("speeds")), None)
    if ev is None:
        return None
    finding = Finding(ts=float(ev.get("ts", action.ts)), kind="fail_slow", category="performance",
                      severity="warning", action="notify", confidence=action.confidence,
                      source=str(ev.get("source", "steps")), rule="campaign-replan", text=str(ev.get("text", "")),
                      node=ev.get("node"), rank=ev.get("rank"), figures=dict(ev.get("figures") or {}))
    try:
        speeds = speeds_from_finding(finding, slice_topology)
        shape = shape_from_finding(finding, slice_topology, config.adaptation)
    except (ValueError, KeyError):
        return None
    t = slice_topology
    full = Topology.packed(tp=t.tp, pp=t.pp, dp=job_dp, cp=t.cp, gpus_per_node=gpus_per_node, order=t.order, job=t.job)
    speeds_full = {full.rank_of(**t.coords(r)): v for r, v in speeds.items()}
    plan = AdaptationPlanner(config.adaptation).plan(full, shape, speeds_full)
    return plan.to_dict()


class Rendered(NamedTuple):
    """A decided failure with what it was decided on (for the bus check)."""

    decision: Decision
    records: list[Any]
    job: Any  # faultlens.schema.JobTopology of the slice
    truth: dict[str, Any]


def diagnose_rendered(sc: Scenario, config: Config, *, workdir: Path | None = None,
                      edit: Callable[[Path], None] | None = None) -> tuple[Any, list[Any], dict[str, Any], Any, Any,
                                                                           float, float]:
    """Write a rendered scenario as a batch directory (``edit`` may change it first: a hard render drops
    files), read it back as the batch contract says and diagnose it: (data, records, truth, incidents,
    actions, render end, diagnosis end) with perf_counter times. Every campaign render goes through here."""
    tmp = Path(tempfile.mkdtemp(prefix="faultlens-campaign-", dir=workdir))
    try:
        out = write_batch_dir(sc, tmp / "batch")
        if edit is not None:
            edit(out)
        data = read_batch_dir(out)
        records = list(data.records())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    truth = sc.truth()
    t1 = time.perf_counter()
    incidents, actions = diagnose_records(data.job, records, config, detectors=default_detectors())
    return data, records, truth, incidents, actions, t1, time.perf_counter()


def decide(kind: str, layout: SliceLayout, seed: int, bucket: int, *, fault_class: str, nccl_timeout_s: float,
           config: Config | None = None, workdir: Path | None = None, job_dp: int | None = None,
           noise: Noise | None = None) -> Rendered:
    """Render one failure on the slice and diagnose it in batch.

    ``job_dp``: the whole job's DP degree; a fail-slow decision's plan is then re-made on the job's
    layout (``replan_on_job``) and its ratio and pause replace the slice's.
    """
    config = config or Config()
    t0 = time.perf_counter()
    sc = Scenario(slice_spec(kind, layout, seed, fault_class, nccl_timeout_s, noise))
    data, records, truth, incidents, actions, t1, t2 = diagnose_rendered(sc, config, workdir=workdir)
    s = score(actions, incidents, truth)
    if job_dp and job_dp > layout.dp and s["action"] == A.ADAPT_PARALLELISM:
        chosen = next(a for a in actions if a.type == A.ADAPT_PARALLELISM)
        plan = replan_on_job(chosen, Topology.from_job(data.job), job_dp, config, gpus_per_node=layout.gpus_per_node)
        if plan is not None:
            best: dict[str, Any] = next((o for o in plan.get("options", []) if o.get("name") == plan.get("chosen")), {})
            s["slice_adapt_ratio"] = s["adapt_ratio"]
            s["job_plan"] = str(plan.get("chosen"))
            s["adapt_ratio"] = float(best.get("ratio_to_healthy", s["adapt_ratio"] or 1.0))
            s["adapt_pause_s"] = float(best.get("pause_s", 0.0))
    slow = _slow_speed(sc, float(truth["faults"][0]["onset_ts"])) if fault_class == "fail_slow" else 1.0
    decision = Decision(kind=kind, bucket=bucket, seed=seed, slow_speed=slow, records=len(records),
                        render_s=t1 - t0, diagnose_s=t2 - t1, **s)
    return Rendered(decision, records, data.job, truth)


def decide_online(rendered: Rendered, *, bootstrap: str, config: Config | None = None, settle_s: float = 5.0,
                  max_s: float = 300.0, speed: float = 20.0) -> Decision:
    """The same records through the bus: produce them to the embedded broker, let the online
    DiagnosisService decide, and score its actions like the batch ones (on stream time, so the
    delays compare). Records are sent at ``speed`` x real time; the rendered stack dumps answer the
    engine's dump_stacks command, as an agent would. The service's wall-clock waits (the hang dwell, the
    idle clock) are divided by ``speed`` so they last what they would on the job's own clock: undivided, a
    30 s dwell held a hang 600 s of stream time. Returns the bus decision (``path="bus"``)."""
    from dataclasses import replace

    batch = rendered.decision
    job = rendered.job
    prefix = f"ettr{batch.seed}{batch.kind.replace('_', '')}"
    bus = BusConfig(bootstrap_servers=bootstrap, topic_prefix=prefix, linger_ms=5)
    base = (config or Config()).diagnosis
    diag = replace(base, group_id=f"{prefix}-diag", max_evidence_age_s=0, hang_dwell_s=base.hang_dwell_s / speed,
                   idle_clock_after_s=base.idle_clock_after_s / speed)
    cfg = replace(config or Config(), bus=bus, diagnosis=diag)
    ensure_topics(bus, bootstrap)
    t0 = time.perf_counter()
    service = DiagnosisService(cfg, bootstrap=bootstrap, detectors=default_detectors(), from_beginning=True).start()
    consumer = Consumer(bus, ["actions", "incidents", "commands"], group_id=None, bootstrap=bootstrap)
    actions: list[Action] = []
    incidents: dict[str, Incident] = {}
    # Stack dumps are answers: a live agent dumps py-spy stacks when the engine sends dump_stacks, so
    # the rendered dumps are held back and sent, stamped with the stream time, when it asks.
    held = [r for r in rendered.records if isinstance(r, StackDump)]
    stream = [r for r in rendered.records if not isinstance(r, StackDump)]
    now_ts = float(getattr(stream[0], "ts", 0.0)) if stream else 0.0

    def drain(producer: Any, timeout_ms: int = 0) -> bool:
        got = False
        for msg in consumer.poll(timeout_ms=timeout_ms):
            got = True
            rec = schema.decode(msg.kind, msg.value)
            if isinstance(rec, Action):
                actions.append(rec)
            elif isinstance(rec, Incident):
                incidents[rec.id] = rec
            elif isinstance(rec, Command) and rec.kind == "dump_stacks" and held:
                for dump in held:
                    producer.send(msgspec.structs.replace(dump, ts=now_ts, request_id=rec.id))
                held.clear()
                producer.flush(10)
        return got

    try:
        with Producer(bus, bootstrap) as producer:
            producer.send(job)
            producer.flush(10)
            deadline = time.monotonic() + 30
            node = rendered.truth["faults"][0]["nodes"][0] if rendered.truth["faults"][0]["nodes"] else None
            while node and service.engine.job_of_node(node) != job.job and time.monotonic() < deadline:
                time.sleep(0.05)
            # paced at ``speed`` x real time: the input topics are partitioned apart, so a flood of
            # minutes of records in a second reaches the engine out of order across kinds (GPU samples
            # far ahead of steps), which a live job never does
            target = time.monotonic()
            for rec in stream:
                ts = float(getattr(rec, "ts", now_ts))
                target += max(0.0, ts - now_ts) / speed
                now_ts = max(now_ts, ts)
                ahead = target - time.monotonic()
                if ahead > 0.05:
                    producer.flush(10)
                    drain(producer)
                    time.sleep(ahead)
                producer.send(rec)
            producer.flush(30)
            # wait until the service stops applying records and its outputs settle
            deadline = time.monotonic() + max_s
            last_new = time.monotonic()
            applied = -1
            while time.monotonic() < deadline and time.monotonic() - last_new < settle_s:
                if service.applied != applied:
                    applied, last_new = service.applied, time.monotonic()
                if drain(producer, 200):
                    last_new = time.monotonic()
    finally:
        consumer.close()
        service.stop()
    s = score(actions, list(incidents.values()), rendered.truth)
    return replace(batch, path="bus", diagnose_s=time.perf_counter() - t0, **s)
