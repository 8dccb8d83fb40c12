"""DiagnosisEngine: records in, incidents, actions and commands out.

One code path for online and batch: the online service feeds it records from
the bus and calls ``tick`` every second of wall time; the batch path feeds a
directory's records in time order and calls ``tick`` on event time. Time is
always the records' own timestamps, never the clock, so a replay of the same
records gives the same incidents.

Pipeline per record: rules (NVML counters here; log lines via diagnosis.classify
when it is installed, and the policy's signal matchers) and pluggable detectors
turn records into findings; the policy's matcher turns findings into signals of
an incident kind; the IncidentBook groups them (bursts, inhibition); the policy
decides; the guard rails filter; node health remembers.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from faultlens.config import Config
from faultlens.diagnosis.guard import Guard
from faultlens.diagnosis.incidents import IncidentBook, OpenIncident, Signal
from faultlens.diagnosis.inhibit import Inhibitor
from faultlens.diagnosis.nodehealth import NodeHealth
from faultlens.diagnosis.policy import Decision, Policy, SignalMatcher, load_policy
from faultlens.diagnosis.rules import CounterRules
from faultlens.diagnosis.stacks import StackAggregator, StackVerdict
from faultlens.records import LastKnown
from faultlens.stream.schema import (
    Action,
    Command,
    Finding,
    GpuSample,
    Incident,
    JobTopology,
    KernelEvent,
    NcclEvent,
    StackDump,
    StepTiming,
)
from faultlens.stream.topology import Topology

log = logging.getLogger(__name__)

Output = Incident | Action | Command


@runtime_checkable
class Detector(Protocol):
    """What a detector (models/) must offer to plug into the engine."""

    name: str

    def set_topology(self, topology: Topology) -> None: ...

    def observe(self, record: Any) -> list[Finding]: ...

    def tick(self, now: float) -> list[Finding]: ...


# Exceptions that say the infrastructure failed, not the user's code: never rolled back.
INFRA_EXCEPTION_RE = re.compile(
    r"NCCL|DistBackendError|ProcessGroup|Watchdog|ncclRemoteError|ncclSystemError|ncclInternalError|"
    r"CUDA error: (?:an illegal|unspecified launch|uncorrectable ECC|ECC)|uncorrectable ECC|Xid|"
    r"Connection (?:reset|refused|closed)|Broken pipe|BrokenPipeError|TCPStore|SIGKILL|Signals?\.SIGKILL|"
    r"ChildFailedError|timed out|timeout", re.IGNORECASE)
EXCEPTION_LINE_RE = re.compile(r"^\s*(?:\[rank\d+\]:\s*)?(?P<exc>[A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\b:?.*)$")
_NUM_RE = re.compile(r"0x[0-9a-fA-F]+|\d+")


def exception_fingerprint(record: NcclEvent) -> str | None:
    """The normalised final exception line of a traceback record, or None."""
    text = record.exception
    if not text:
        if record.kind not in ("exception", "traceback", "python_exception") and "Traceback" not in record.raw:
            return None
        lines = [m["exc"] for m in map(EXCEPTION_LINE_RE.match, record.raw.splitlines()) if m]
        if not lines:
            return None
        text = lines[-1]
    return _NUM_RE.sub("#", text.strip())[:300]


@dataclass
class _Job:
    name: str
    topology: Topology | None = None
    last_step_ts: float | None = None
    last_step: int = -1
    durations: deque = field(default_factory=lambda: deque(maxlen=256))
    step_ranks: set[int] = field(default_factory=set)
    stacks: dict[int, StackDump] = field(default_factory=dict)
    hang_open: str | None = None
    loss_ranks: set[int] = field(default_factory=set)
    nan_signals: int = 0

    @property
    def nodes(self) -> list[str]:
        return self.topology.nodes if self.topology else []


class DiagnosisEngine:
    """Records -> incidents, actions, commands. ``batch=True``: stacks come with the input, no commands."""

    def __init__(self, config: Config, *, detectors: Sequence[Detector] = (), node_health: NodeHealth | None = None,
                 batch: bool = False, classify: Any = "auto", source: str = "/faultlens/diagnosis"):
        self.config = config
        self.batch = batch
        self.source = source
        d = config.diagnosis
        self.catalog = load_policy(network_alerts_to_evict=d.network_alerts_to_evict, network_window_s=d.network_window_s)
        self.matcher = SignalMatcher(self.catalog.signals)
        self.policy = Policy(self.catalog)
        self.counters = CounterRules()
        self.detectors = list(detectors)
        self.node_health = node_health
        self.book = IncidentBook(
            burst_gap_s=d.burst_gap_s, inhibitor=Inhibitor(),
            prior_blames=node_health.prior_blames if node_health else None,
            join_window_s={"ib_link": d.network_window_s},
        )
        self.guard = Guard(config.guard)
        self.aggregator = StackAggregator()
        self.steps_cfg = {"hang_step_multiple": 20.0, "hang_min_silence_s": 60.0, "hang_grace_s": 180.0,
                          "stacks_wait_s": 30.0, "notify_delay_s": 300.0, **self.catalog.steps}
        self._jobs: dict[str, _Job] = {}
        self._node_job: dict[str, str] = {}
        self._outputs: list[Output] = []
        self._evicted: dict[str, set[str]] = {}  # job -> machines this engine had evicted
        self._classify = _load_classify() if classify == "auto" else classify
        self.now = 0.0
        self._final = False  # set by tick(final=True): decide now, nothing more will come
        self.counts: dict[str, int] = {"records": 0, "signals": 0, "bad_records": 0, "findings": 0}
        self._last_known = LastKnown()  # a null GPU field (N/A) reads as unchanged

    # ------------------------------------------------------------------ input

    def observe(self, record: Any) -> list[Output]:
        """Take one record; returns what it caused (incidents updated, actions, commands)."""
        self.counts["records"] += 1
        record = self._last_known.fill(record)
        ts = getattr(record, "ts", None)
        if isinstance(ts, (int, float)) and ts > self.now:
            self.now = float(ts)
        try:
            self._observe(record)
        except Exception:  # a bad record is counted and skipped; it never stops the service
            self.counts["bad_records"] += 1
            log.exception("diagnosis skipped a record it could not handle: %r", type(record).__name__)
        for det in self.detectors:
            try:
                for f in det.observe(record):
                    self._file_finding(f)
            except Exception:
                self.counts["bad_records"] += 1
                log.exception("detector %s failed on a record", getattr(det, "name", det))
        return self._drain()

    def _observe(self, record: Any) -> None:
        if isinstance(record, JobTopology):
            self.set_topology(record)
        elif isinstance(record, GpuSample):
            for f in self.counters.observe(record):
                self._file_finding(f)
        elif isinstance(record, KernelEvent):
            self._on_line(record, self.job_of_node(record.node))
        elif isinstance(record, NcclEvent):
            self._on_line(record, record.job or self.job_of_node(record.node))
        elif isinstance(record, StepTiming):
            self._on_step(record)
        elif isinstance(record, StackDump):
            job = self._job(record.job)
            if record.rank is not None:
                job.stacks[record.rank] = record

    def add_stacks(self, dumps: Iterable[StackDump]) -> int:
        """Stack dumps known up front (a batch directory's snapshot); they do not move event time."""
        n = 0
        for d in dumps:
            if d.rank is not None:
                self._job(d.job).stacks[d.rank] = d
                n += 1
        return n

    def set_topology(self, job: JobTopology | dict[str, Any]) -> Topology:
        topo = Topology.from_job(job)
        state = self._job(topo.job)
        state.topology = topo
        for n in topo.nodes:
            self._node_job[n] = topo.job
        for det in self.detectors:
            det.set_topology(topo)
        return topo

    def _job(self, name: str) -> _Job:
        job = self._jobs.get(name)
        if job is None:
            job = self._jobs[name] = _Job(name)
        return job

    def job_of_node(self, node: str) -> str:
        return self._node_job.get(node, "unknown")

    def _on_line(self, record: KernelEvent | NcclEvent, job: str) -> None:
        finding = None
        if self._classify is not None:
            try:
                finding = self._classify(record)
            except Exception:
                log.debug("classify failed on a line", exc_info=True)
        if isinstance(record, NcclEvent):
            fp = exception_fingerprint(record)
            if fp is not None and not INFRA_EXCEPTION_RE.search(fp):
                self._on_exception(record, job, fp)
                return
        signal = self.matcher.match_record(record, job, finding=finding)
        if signal is None and finding is not None and finding.severity == "critical" and finding.action == "evict_node":
            signal = Signal(ts=record.ts, job=job, kind="unclassified", role="cause",
                            confidence=min(finding.confidence, 0.8), rule=f"classify:{finding.rule}",
                            source=finding.source, text=record.raw, node=record.node, rank=record.rank,
                            category=finding.category, severity=finding.severity)
        if signal is None:
            return
        if finding is not None:
            signal.figures.setdefault("meaning", getattr(finding, "text", "")[:300])
            signal.category = finding.category
        _mark_estimated(signal, record)
        if signal.kind == "hang":
            signal.role = "job"  # a watchdog timeout says the job hangs, not where
        self._file(signal)

    def _on_exception(self, record: NcclEvent, job: str, fp: str) -> None:
        sig = Signal(ts=record.ts, job=job, kind="user_exception", role="job", confidence=0.5,
                     rule="engine:python_exception", source="nccl", text=record.raw, node=record.node,
                     rank=record.rank)
        _mark_estimated(sig, record)
        inc = self._file(sig, decide=False)
        if inc is None:
            return
        ranks = inc.state.setdefault("exception_ranks", {})
        ranks.setdefault(fp, set()).add(record.rank if record.rank is not None else hash((record.node, record.pid)))
        self._decide(inc)

    def _on_step(self, rec: StepTiming) -> None:
        job = self._job(rec.job)
        if job.last_step_ts is None or rec.ts > job.last_step_ts:
            job.last_step_ts = rec.ts
        if rec.step > job.last_step:
            job.last_step = rec.step
            job.durations.append(rec.duration_s)
        nan = rec.loss is not None and (math.isnan(rec.loss) or math.isinf(rec.loss))
        if rec.loss is not None and not nan:
            job.loss_ranks.add(rec.rank)
        elif rec.loss is None and rec.grad_norm is None and rec.rank in job.loss_ranks:
            nan = True  # JSON has no NaN: a loss that turns null where it was a number is one
        if nan and job.nan_signals < 8:
            job.nan_signals += 1
            self._file(Signal(ts=rec.ts, job=rec.job, kind="nan_loss", role="job", confidence=0.8,
                              rule="engine:nan_loss", source="steps", text=f"loss={rec.loss} at step {rec.step} "
                              f"(rank {rec.rank} on {rec.node})", rank=rec.rank, figures={"step": rec.step}))

    def _file_finding(self, f: Finding) -> None:
        self.counts["findings"] += 1
        job = f.job or (self.job_of_node(f.node) if f.node else "unknown")
        signal = self.matcher.match_finding(f, job)
        if signal is not None:
            self._file(signal)

    def _file(self, signal: Signal, *, decide: bool = True) -> OpenIncident | None:
        self.counts["signals"] += 1
        inc = self.book.add(signal)
        if inc is not None and decide:
            self._decide(inc)
        return inc

    # ------------------------------------------------------------------ time

    def tick(self, now: float | None = None, *, final: bool = False) -> list[Output]:
        """Advance time: detectors' periodic work, hang checks, stack workflow, closing quiet incidents."""
        if now is not None and now > self.now:
            self.now = now
        now = self.now
        self._final = final
        for det in self.detectors:
            try:
                for f in det.tick(now):
                    self._file_finding(f)
            except Exception:
                log.exception("detector %s failed on tick", getattr(det, "name", det))
        for job in list(self._jobs.values()):
            self._check_progress(job, now)
        for inc in self.book.open_incidents():
            if inc.kind == "hang":
                self._hang_workflow(inc, now, final=final)
            elif not inc.decided and inc.kind != "user_exception":
                self._decide(inc)
            held = inc.state.get("notify")
            closing = now - inc.updated_ts > self.book.join_gap(inc.kind)
            if held is not None and not inc.decided and (final or closing or now - inc.opened_ts >= self.steps_cfg["notify_delay_s"]):
                if held.nodes and set(held.nodes) <= self._evicted.get(inc.job, set()):
                    inc.state.pop("notify")  # those machines are already evicted: nothing left for a person here
                    inc.summary = f"{inc.kind} on machines already evicted by this job's other incident"
                    inc.dirty = True
                else:
                    self._act(inc, held)
        self.book.close_idle(now if not final else now + 1e9)
        self.book.inhibitor.forget_before(now)
        return self._drain()

    def _check_progress(self, job: _Job, now: float) -> None:
        if job.last_step_ts is None or job.hang_open is not None:
            return
        median = statistics.median(job.durations) if job.durations else 1.0
        threshold = min(self.config.diagnosis.hang_no_progress_s,
                        max(self.steps_cfg["hang_min_silence_s"], self.steps_cfg["hang_step_multiple"] * median))
        silence = now - job.last_step_ts
        if silence < threshold:
            return
        inc = self.book.job_incident(
            job.name, "hang", job.last_step_ts + threshold, confidence=0.6, rule="engine:no_step_progress",
            text=f"no step progress for {silence:.0f} s (last step {job.last_step}; median step {median:.2f} s)",
            figures={"silence_s": round(silence, 1), "last_step": job.last_step, "median_step_s": round(median, 3)})
        if inc is not None:
            job.hang_open = inc.id

    def _hang_workflow(self, inc: OpenIncident, now: float, *, final: bool) -> None:
        """Hang: ask for stacks (online), wait for an explicit cause, then demarcate from stacks."""
        if inc.decided:
            return
        job = self._job(inc.job)
        st = inc.state
        st.setdefault("pending", "hang")
        if not self.batch and "command" not in st:
            cmd = Command(id=_id("cmd", inc.id, "dump_stacks"), ts=now, kind="dump_stacks", job=inc.job,
                          params={"incident_id": inc.id, "reason": "hang"})
            st["command"] = cmd.id
            st["requested_ts"] = now
            self._outputs.append(cmd)
        ready_at = inc.opened_ts + self.steps_cfg["hang_grace_s"]
        if not self.batch:
            ready_at = max(ready_at, st.get("requested_ts", now) + self.steps_cfg["stacks_wait_s"])
        if now < ready_at and not final:
            return
        verdict: StackVerdict | None = None
        dumps = list(job.stacks.values())
        if self.batch and not final:
            dumps = [d for d in dumps if d.ts <= now + 1e-6] or dumps
        if dumps and job.topology is not None:
            verdict = self.aggregator.aggregate(dumps, job.topology)
            inc.evidence.append({"ts": now, "source": "stacks", "rule": "stacks:aggregate",
                                 "text": f"{len(verdict.groups)} stack group(s); outliers {verdict.outliers[:32]}; "
                                         f"no answer from {verdict.missing[:32]}",
                                 "figures": {"groups": [[fp.split(chr(10), 1)[0], len(r)] for fp, r in verdict.groups[:8]],
                                             "outliers": verdict.outliers[:256]}})
            for r in verdict.outliers[:64]:
                node = job.topology.placement.get(r, (None, None))[0]
                if node:
                    inc.suspect(node, 0.9 if verdict.demarcation else 0.5, verdict.reasons.get(r, "outlier stack"), rank=r)
        st.pop("pending", None)
        g = self.config.guard
        job_nodes = max(1, len(job.nodes))
        allowed = min(g.max_evictions_per_job_per_hour, max(1, math.floor(g.max_evicted_fraction * job_nodes)))
        decision = self.policy.decide_hang(inc, verdict, stacks_expected=not self.batch, max_nodes=allowed)
        inc.confidence = max(inc.confidence, decision.confidence)
        self._act(inc, decision)

    # ------------------------------------------------------------------ decisions

    def _decide(self, inc: OpenIncident) -> None:
        if inc.status != "open" or inc.kind == "hang":
            return
        world = None
        job = self._jobs.get(inc.job)
        if job and job.topology:
            world = job.topology.world_size
        decision = self.policy.decide(inc, self.now, world_size=world)
        if decision is not None and decision.type == "evict_nodes" and inc.kind in ADAPTABLE_KINDS:
            decision = self._adapt_or_evict(inc, decision)
        if decision is None or decision.type in inc.decided:
            return
        if decision.type == "notify":
            if not inc.decided:
                inc.state["notify"] = decision  # held back: a stronger signal may still arrive
            return
        self._act(inc, decision)

    def _adapt_or_evict(self, inc: OpenIncident, decision: Decision) -> Decision:
        """A slow (not dead) machine: ask the adaptation planner whether keeping the job
        running on a new plan beats evicting it, by predicted goodput over the horizon.

        Needs the job's topology and a measured slowdown (the fail-slow detector's
        figures in the evidence); without them the explicit rule's eviction stands, and
        when the planner finds that nothing pays off the eviction stands too (the
        machine is faulty; a person can still choose to keep it)."""
        job = self._jobs.get(inc.job)
        if not self.config.adaptation.enabled or job is None or job.topology is None:
            return decision
        if inc.decided & {"evict_nodes", "adapt_parallelism"}:
            return None  # one remedy per incident
        measured = next((e for e in reversed(inc.evidence)
                         if str(e.get("source", "")).startswith("model:") and "slowdown" in (e.get("figures") or {})), None)
        if measured is None:
            # ByteRobust confirms a throttling gray failure against the job's throughput before
            # acting: wait a while for the step-time detector to measure the slowdown.
            waited = self.now - inc.opened_ts
            return decision if (self._final or waited >= self.config.adaptation.confirm_wait_s) else None
        from faultlens.diagnosis.adaptation import choose_remediation

        finding = Finding(ts=float(measured.get("ts", self.now)), kind="fail_slow", category=inc.category,
                          severity="critical", action="evict_node", confidence=decision.confidence,
                          source=str(measured.get("source")), rule=str(measured.get("rule", "")),
                          text=str(measured.get("text", "")), node=measured.get("node"), job=inc.job,
                          gpu=measured.get("gpu"), rank=measured.get("rank"), figures=dict(measured["figures"]))
        try:
            action = choose_remediation(finding, job.topology, config=self.config, incident_id=inc.id, now=self.now)
        except (ValueError, KeyError) as exc:
            log.warning("adaptation planner could not plan for %s: %s", inc.id, exc)
            return decision
        if action.type == "adapt_parallelism":
            return Decision("adapt_parallelism", tuple(decision.nodes), action.reason, decision.confidence, plan=action.plan)
        return Decision(decision.type, decision.nodes, decision.reason, decision.confidence, plan=action.plan)

    def _act(self, inc: OpenIncident, decision: Decision) -> None:
        job = self._jobs.get(inc.job)
        job_nodes = len(job.nodes) if job and job.nodes else max(1, len(decision.nodes))
        verdict = self.guard.check(decision, job=inc.job, now=self.now, job_nodes=job_nodes)
        inc.decided.add(decision.type)
        if verdict.decision is None:
            return
        d = verdict.decision
        if verdict.storm:
            inc.summary = f"fabric-level storm: {'; '.join(verdict.notes)}"
        inc.decided.add(d.type)
        suspects = [s for s in inc.record().suspects]
        action = Action(
            # Deterministic (incident, type): an incident takes each action type once, and a replay or a
            # restored instance re-derives the same id, which the runner executes at most once.
            id=_id("act", inc.id, d.type), incident_id=inc.id, job=inc.job, ts=self.now, type=d.type,
            nodes=list(d.nodes), suspects=suspects, evidence=list(inc.evidence[:20]), confidence=round(d.confidence, 4),
            dry_run=self.config.guard.dry_run, reason=d.reason + (f" [guard: {'; '.join(verdict.notes)}]" if verdict.notes else ""),
            plan=d.plan,
        )
        inc.actions.append(action.id)
        inc.dirty = True
        if d.type in ("evict_nodes", "restart_job", "rollback_code", "run_diagnostics"):
            inc.summary = inc.summary or d.reason
        self._outputs.append(action)
        if d.type != "notify":
            self.book.promote_cause(inc)
        if d.type == "evict_nodes":
            self._evicted.setdefault(inc.job, set()).update(d.nodes)
        if self.node_health is not None:
            for node in d.nodes:
                self.node_health.record_blame(node, incident_id=inc.id, job=inc.job, kind=inc.kind, ts=self.now)
                if d.type == "evict_nodes":
                    self.node_health.record_eviction(node, incident_id=inc.id, job=inc.job, kind=inc.kind,
                                                     reason=d.reason[:200], ts=self.now)

    def _drain(self) -> list[Output]:
        out = [i.record() for i in self.book.dirty()]
        out.extend(self._outputs)
        self._outputs = []
        return out

    # ------------------------------------------------------------------ views

    def incidents(self) -> list[Incident]:
        return [i.record() for i in sorted(self.book.incidents.values(), key=lambda i: (i.opened_ts, i.id))]

    def detector_names(self) -> list[str]:
        return [getattr(d, "name", type(d).__name__) for d in self.detectors]


def _mark_estimated(signal: Signal, record: KernelEvent | NcclEvent) -> None:
    """A log time the batch reader estimated (boot-relative dmesg, an untimed line) says so in the evidence."""
    if record.fields.get("ts_estimated"):
        signal.figures["ts_estimated"] = True
        signal.figures["ts_anchor"] = record.fields.get("ts_anchor", "")


# Incident kinds where a machine is slow rather than dead: the planner may keep it.
ADAPTABLE_KINDS = frozenset({"fail_slow", "thermal_throttle", "pcie_degradation"})


def _id(prefix: str, *parts: Any) -> str:
    return f"{prefix}-" + hashlib.sha1("|".join(str(p) for p in parts).encode()).hexdigest()[:12]


def _load_classify() -> Any:
    """diagnosis.classify.to_finding when that module is present (log-line meaning), else None."""
    try:
        from faultlens.diagnosis import classify
    except ImportError:
        return None
    return getattr(classify, "to_finding", None)


def default_detectors() -> list[Detector]:
    """The models/ detectors that are installed (fail-slow, peer comparison); empty when none are."""
    out: list[Detector] = []
    try:
        from faultlens.models.failslow import FailSlowDetector

        out.append(FailSlowDetector())
    except ImportError:
        pass
    try:
        from faultlens.models.peer import PeerDetector

        out.append(PeerDetector())
    except ImportError:
        pass
    return out


def run_records(engine: DiagnosisEngine, records: Iterable[Any], *, tick_every_s: float = 10.0,
                progress: Callable[[int], None] | None = None, progress_every: int = 20_000) -> list[Output]:
    """Feed time-ordered records, ticking on event time; a final tick settles what is pending.

    ``progress(n)`` is called every ``progress_every`` records with the count so far.
    """
    outputs: list[Output] = []
    next_tick: float | None = None
    for n, rec in enumerate(records, 1):
        if progress is not None and n % progress_every == 0:
            progress(n)
        ts = getattr(rec, "ts", None)
        if isinstance(ts, (int, float)):
            if next_tick is None or ts - next_tick > 100 * tick_every_s:
                if next_tick is not None:  # a long silence in the input: one tick covers it
                    outputs.extend(engine.tick(next_tick))
                next_tick = ts + tick_every_s
            while ts >= next_tick:
                outputs.extend(engine.tick(next_tick))
                next_tick += tick_every_s
        outputs.extend(engine.observe(rec))
    outputs.extend(engine.tick(engine.now))
    outputs.extend(engine.tick(engine.now, final=True))
    return outputs
