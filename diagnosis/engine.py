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

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from faultlens.config import Config
from faultlens.diagnosis.detectors import (
    Detector,
    default_detectors,
    load_classify,
    new_classify_context,
)
from faultlens.diagnosis.exceptions import exception_fingerprint, user_exception
from faultlens.diagnosis.guard import Guard
from faultlens.diagnosis.incidents import IncidentBook, OpenIncident, Signal
from faultlens.diagnosis.inhibit import Inhibitor
from faultlens.diagnosis.jobwide import JobWideCorrelator, JobWideRule
from faultlens.diagnosis.modes import BATCH, ONLINE, Mode, output_id
from faultlens.diagnosis.nanloss import NanWatch, rank_named_in
from faultlens.diagnosis.nodehealth import NodeHealth
from faultlens.diagnosis.notes import NOTE, attach_pending, file_note
from faultlens.diagnosis.policy import (
    Decision,
    Hold,
    Policy,
    SignalMatcher,
    load_policy,
    unmatched_but_actionable,
)
from faultlens.diagnosis.progress import JobProgress, check_hang
from faultlens.diagnosis.remedy import ADAPTABLE_KINDS, adapt_or_evict, decide_nan
from faultlens.diagnosis.replay import run_records
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
from faultlens.vocabulary import ActionType, IncidentKind

log = logging.getLogger(__name__)

Output = Incident | Action | Command
# Re-exported: callers import these from the engine (the split kept their names here).
__all__ = ["DiagnosisEngine", "Detector", "JobState", "Output", "default_detectors", "exception_fingerprint",
           "run_records"]


@dataclass
class JobState:
    """What the engine knows about one job: topology, progress (steps, liveness), NaN watch, stacks at hand."""

    name: str
    topology: Topology | None = None
    progress: JobProgress = field(default_factory=JobProgress)
    nan: NanWatch = field(default_factory=NanWatch)
    stacks: dict[int, StackDump] = field(default_factory=dict)
    notes: list[Signal] = field(default_factory=list)  # notes waiting for an incident (diagnosis.notes)

    @property
    def nodes(self) -> list[str]:
        return self.topology.nodes if self.topology else []


class DiagnosisEngine:
    """Records -> incidents, actions, commands, in a ``mode``: ``ONLINE`` asks agents for stacks,
    ``BATCH`` takes the stacks that came with the input (``batch=True`` is the old spelling of it)."""

    def __init__(self, config: Config, *, detectors: Sequence[Detector] = (), node_health: NodeHealth | None = None,
                 mode: Mode | None = None, batch: bool | None = None, classify: Any = "auto",
                 source: str = "/faultlens/diagnosis"):
        self.config = config
        self.mode: Mode = mode or (BATCH if batch else ONLINE)
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
                          "hang_gap_multiple": 1.5, "end_min_silence_s": 30.0, "end_step_multiple": 5.0,
                          "end_gap_multiple": 1.2, "nan_settle_s": 15.0,
                          "stacks_wait_s": 30.0, "notify_delay_s": 300.0, **self.catalog.steps}
        self.jobwide = JobWideCorrelator(self.catalog.jobwide)
        self._jobs: dict[str, JobState] = {}
        self._node_job: dict[str, str] = {}
        self.routed_job: str | None = None  # online: the job key this engine serves (diagnosis.state.EngineFactory)
        self._outputs: list[Output] = []
        self._evicted: dict[str, set[str]] = {}  # job -> machines this engine had evicted
        self._classify = load_classify() if classify == "auto" else classify
        # the same context rules as explain (repeats, derived Xids); a caller-given classify gets none
        self._classify_ctx = new_classify_context() if classify == "auto" else None
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
            job = self._jobs.get(self._node_job.get(record.node, ""))
            if job is not None:
                job.progress.observe_gpu(record)
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

    def _job(self, name: str) -> JobState:
        job = self._jobs.get(name)
        if job is None:
            job = self._jobs[name] = JobState(name)
        return job

    def job_of_node(self, node: str) -> str:
        """The job a topology puts ``node`` in; else the job this engine serves online (the
        repartitioner routed the record here by a topology), else "unknown" (node-local rules)."""
        return self._node_job.get(node) or self.routed_job or "unknown"

    def _on_line(self, record: KernelEvent | NcclEvent, job: str) -> None:
        finding = None
        if self._classify is not None:
            try:
                finding = self._classify(record, self._classify_ctx) if self._classify_ctx is not None \
                    else self._classify(record)
            except Exception:
                log.debug("classify failed on a line", exc_info=True)
        nan_re = self.catalog.nan_patterns
        if isinstance(record, NcclEvent) and nan_re is not None and nan_re.search(record.raw):
            self._on_nan_line(record, job)
            return
        if isinstance(record, NcclEvent):
            fp = user_exception(record)
            if fp is not None:
                self._on_exception(record, job, fp)
                return
        signal = self.matcher.match_record(record, job, finding=finding)
        if signal is None and finding is not None and unmatched_but_actionable(record, finding):
            # A signature no policy signal names: one unclassified incident that takes the signature's own
            # action (route action "signature"), under the route's confidence floor and the guard rails.
            signal = Signal(ts=record.ts, job=job, kind=IncidentKind.UNCLASSIFIED, role="cause",
                            confidence=finding.confidence, rule=f"classify:{finding.rule}", source=finding.source,
                            text=record.raw, node=record.node, rank=record.rank, category=finding.category,
                            severity=finding.severity, action=finding.action, signature=finding.rule)
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
        ranks = inc.state.exception_ranks
        ranks.setdefault(fp, set()).add(record.rank if record.rank is not None else hash((record.node, record.pid)))
        self._decide(inc)

    def _on_nan_line(self, record: NcclEvent, job_name: str) -> None:
        """A log line saying a rank's loss or gradients went non-finite: a NaN signal naming that rank."""
        job = self._job(job_name)
        rank = rank_named_in(record.raw, record.rank)
        if rank is not None:
            job.nan.name_rank(rank, record.raw.strip().splitlines()[0] if record.raw.strip() else record.raw)
        sig = Signal(ts=record.ts, job=job_name, kind="nan_loss", role="job", confidence=0.8, rule="engine:nan_line",
                     source="nccl", text=record.raw, node=record.node, rank=rank)
        _mark_estimated(sig, record)
        self._file(sig, decide=False)

    def _on_step(self, rec: StepTiming) -> None:
        job = self._job(rec.job)
        job.progress.observe_step(rec)
        bad = job.nan.observe(rec)
        if bad is not None and job.nan.nan_signals < 8:
            job.nan.nan_signals += 1
            self._file(Signal(ts=rec.ts, job=rec.job, kind="nan_loss", role="job", confidence=0.8,
                              rule="engine:nan_loss", source="steps", text=f"{bad} at step {rec.step} "
                              f"(rank {rec.rank} on {rec.node})", rank=rec.rank, figures={"step": rec.step}),
                       decide=False)

    def _file_finding(self, f: Finding) -> None:
        self.counts["findings"] += 1
        job = f.job or (self.job_of_node(f.node) if f.node else "unknown")
        signal = self.matcher.match_finding(f, job)
        if signal is not None:
            self._file(signal)

    def _file(self, signal: Signal, *, decide: bool = True) -> OpenIncident | None:
        self.counts["signals"] += 1
        if signal.role == NOTE:
            file_note(self.book, self._job(signal.job).notes, signal)
            return None
        rule = self.jobwide.rule_for(signal.kind) if signal.node and signal.role != "job" else None
        if rule is not None:
            inc = self._file_jobwide(signal, rule)
            if inc is not None:
                return inc
        inc = self.book.add(signal)
        job = self._jobs.get(signal.job)
        if inc is not None and job is not None:
            attach_pending(inc, job.notes)
        if inc is not None and decide:
            self._decide(inc)
        return inc

    def _file_jobwide(self, signal: Signal, rule: JobWideRule) -> OpenIncident | None:
        """A watched host-level signal (diagnosis.jobwide): the shared-cause incident, notified once opened."""
        job = self._jobs.get(signal.job)
        if job is None:
            return None
        inc, opened = self.jobwide.file(self.book, signal, rule, job.nodes)
        if inc is not None and opened:
            self._act(inc, Decision("notify", (), f"job-wide {rule.kind}: {inc.summary} (nodes "
                                    f"{', '.join(inc.state.affected_nodes[:16])})", inc.confidence, blame=False))
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
            self._check_progress(job, now, final=final)
        for inc in self.book.open_incidents():
            if inc.kind == "hang":
                self._hang_workflow(inc, now, final=final)
            elif not inc.decided and inc.kind != "user_exception":
                self._decide(inc)
            held = inc.state.notify
            closing = now - inc.updated_ts > self.book.join_gap(inc.kind)
            if held is not None and not inc.decided and (final or closing or now - inc.opened_ts >= self.steps_cfg["notify_delay_s"]):
                if held.nodes and set(held.nodes) <= self._evicted.get(inc.job, set()):
                    inc.state.notify = None  # those machines are already evicted: nothing left for a person here
                    inc.summary = f"{inc.kind} on machines already evicted by this job's other incident"
                    inc.dirty = True
                else:
                    self._act(inc, held)
        self.book.close_idle(now if not final else now + 1e9)
        self.book.inhibitor.forget_before(now)
        return self._drain()

    def _check_progress(self, job: JobState, now: float, *, final: bool = False) -> None:
        """Steps stopped while the hosts are alive (diagnosis.progress): open (or join) the job's hang."""
        call = check_hang(job.progress, now, self.steps_cfg, self.config.diagnosis.hang_no_progress_s, final=final,
                          stacks=job.stacks.values())
        if call is None:
            return
        inc = self.book.job_incident(job.name, "hang", call.ts, confidence=call.confidence,
                                     rule="engine:no_step_progress", text=call.text, figures=call.figures)
        if inc is None:
            return
        job.progress.hang_open, job.progress.hang_step = inc.id, job.progress.last_step
        for r in call.lagging_ranks[:16]:
            node = job.topology.placement.get(r, (None, None))[0] if job.topology else None
            if node:
                inc.suspect(node, 0.4, f"rank {r} stopped before the others", rank=r)

    def _hang_workflow(self, inc: OpenIncident, now: float, *, final: bool) -> None:
        """Hang: ask for stacks (online), wait for an explicit cause, then demarcate from stacks."""
        if inc.decided:
            return
        job = self._job(inc.job)
        st = inc.state
        st.pending = st.pending or "hang"
        cmd = self.mode.request_stacks(inc, now, "hang")
        if cmd is not None:
            self._outputs.append(cmd)
        ready_at = self.mode.stacks_ready_at(inc, now, grace_s=self.steps_cfg["hang_grace_s"],
                                             wait_s=self.steps_cfg["stacks_wait_s"])
        if now < ready_at and not final:
            return
        verdict: StackVerdict | None = None
        dumps = self.mode.usable_dumps(job.stacks.values(), now, final=final)
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
        st.pending = None
        g = self.config.guard
        job_nodes = max(1, len(job.nodes))
        allowed = min(g.max_evictions_per_job_per_hour, max(1, math.floor(g.max_evicted_fraction * job_nodes)))
        lagging = tuple(s["node"] for s in inc.top_suspects() if any("stopped before" in x for x in s["reasons"]))
        decision = self.policy.decide_hang(inc, verdict, stacks_expected=self.mode.stacks_expected, max_nodes=allowed,
                                           lagging_nodes=lagging if len(lagging) <= allowed else ())
        inc.confidence = max(inc.confidence, decision.confidence)
        self._act(inc, decision)

    # ------------------------------------------------------------------ decisions

    def _decide(self, inc: OpenIncident) -> None:
        if inc.status != "open" or inc.kind == "hang":
            return
        job = self._jobs.get(inc.job)
        rule = self.jobwide.rule_for(inc.kind) if inc.node is not None else None
        if rule is not None and rule.hold_s > 0 and job is not None and len(job.nodes) >= rule.min_nodes \
                and not self._final and self.now - inc.opened_ts < rule.hold_s:
            inc.state.waiting = f"waiting {rule.hold_s:.0f} s for the job's other nodes ({rule.name})"
            return  # the job's other nodes may report the same within the hold: then it is one shared cause
        if inc.kind == "nan_loss":
            self._decide_nan(inc, job)
            return
        world = job.topology.world_size if job and job.topology else None
        decision: Decision | Hold | None = self.policy.decide(inc, self.now, world_size=world)
        if isinstance(decision, Decision) and decision.type == "evict_nodes" and inc.kind in ADAPTABLE_KINDS:
            decision = adapt_or_evict(inc, decision, topology=job.topology if job else None, config=self.config,
                                      now=self.now, final=self._final)
        if isinstance(decision, Hold):
            inc.state.waiting = decision.reason
            return
        if decision is None or decision.type in inc.decided:
            return
        inc.state.waiting = None
        if decision.type == "notify":
            if not inc.decided:
                inc.state.notify = decision  # held back: a stronger signal may still arrive
            return
        self._act(inc, decision)

    def _decide_nan(self, inc: OpenIncident, job: JobState | None) -> None:
        if job is None:
            return
        settle = max(self.steps_cfg["nan_settle_s"], 3.0 * job.progress.median_step_s())
        decision = decide_nan(inc, job, self.policy, self.book.incidents.values(), self._evicted.get(inc.job, set()),
                              wait_s=0.0 if self._final else settle - (self.now - inc.opened_ts))
        if decision is not None:
            self._act(inc, decision)

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
            id=output_id("act", inc.id, d.type), incident_id=inc.id, job=inc.job, ts=self.now, type=d.type,
            nodes=list(d.nodes), suspects=suspects, evidence=list(inc.evidence[:20]), confidence=round(d.confidence, 4),
            dry_run=self.config.guard.dry_run, reason=d.reason + (f" [guard: {'; '.join(verdict.notes)}]" if verdict.notes else ""),
            plan=d.plan,
        )
        inc.actions.append(action.id)
        inc.dirty = True
        if d.type in _REMEDIES:
            inc.summary = inc.summary or d.reason
        self._outputs.append(action)
        if d.type != "notify":
            self.book.promote_cause(inc)
        if d.type == "evict_nodes":
            self._evicted.setdefault(inc.job, set()).update(d.nodes)
        if self.node_health is not None and d.blame:
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


# Action types that remedy (an incident's summary is the reason of the first one taken).
_REMEDIES = frozenset({ActionType.EVICT_NODES, ActionType.RESTART_JOB, ActionType.ROLLBACK_CODE,
                       ActionType.RUN_DIAGNOSTICS})
def _mark_estimated(signal: Signal, record: KernelEvent | NcclEvent) -> None:
    """A log time the batch reader estimated (boot-relative dmesg, an untimed line) says so in the evidence."""
    if record.fields.get("ts_estimated"):
        signal.figures["ts_estimated"] = True
        signal.figures["ts_anchor"] = record.fields.get("ts_anchor", "")
