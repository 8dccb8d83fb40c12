"""DiagnosisEngine: records in, incidents, actions and commands out, by routing to workflows.

One code path for online and batch: the online service feeds it records from
the bus and calls ``tick`` every second of wall time; the batch path feeds a
directory's records in time order and calls ``tick`` on event time. Time is
always the records' own timestamps, never the clock, so a replay of the same
records gives the same incidents; but it never runs ahead of the wall clock by
more than ``time.max_clock_skew_s``: one record stamped 2100 must not move a
job's clock (its actions would be dated 2100 and its incidents close at once).

Per record: rules (NVML counters; log lines through the signature catalog and the
policy's signal matchers) and pluggable detectors turn records into findings and
signals of an incident kind; the IncidentBook groups them (bursts, inhibition); the
workflow that owns the kind (diagnosis.workflows: machine fault, hang, NaN loss, user
exception, slow machine, job-wide event) decides; the guard rails filter; node health
remembers. Everything learnt lives in one EngineState (what a checkpoint carries).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from faultlens import flightrec
from faultlens.config import Config
from faultlens.decode import GpuColumns
from faultlens.diagnosis.decision import Decision
from faultlens.diagnosis.detectors import (
    Detector,
    default_detectors,
    load_classify,
    new_classify_context,
)
from faultlens.diagnosis.engine_state import EngineState
from faultlens.diagnosis.exceptions import exception_fingerprint
from faultlens.diagnosis.guard import Guard, retry_after_reset
from faultlens.diagnosis.guardlog import GuardLog, LocalGuardLog
from faultlens.diagnosis.incidents import IncidentBook, OpenIncident, Signal
from faultlens.diagnosis.inhibit import Inhibitor
from faultlens.diagnosis.jobwide import JobWideCorrelator
from faultlens.diagnosis.modes import BATCH, ONLINE, Mode, output_id
from faultlens.diagnosis.nanloss import NanWatch
from faultlens.diagnosis.nodehealth import NodeHealth
from faultlens.diagnosis.notes import NOTE, attach_pending, file_note
from faultlens.diagnosis.policy import Policy, SignalMatcher, load_policy
from faultlens.diagnosis.progress import JobProgress
from faultlens.diagnosis.replay import run_records
from faultlens.diagnosis.rules import CounterRules
from faultlens.diagnosis.settings import EngineSettings
from faultlens.diagnosis.workflows import HangWorkflow, MachineFaultWorkflow, Workflow, build
from faultlens.diagnosis.workflows.job_wide import file_jobwide, held_for_job
from faultlens.diagnosis.workflows.lines import line_signal
from faultlens.schema import (
    Action,
    ActionStatus,
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
from faultlens.vocabulary import ActionType

log = logging.getLogger(__name__)

Output = Incident | Action | Command
# Re-exported: callers import these from the engine.
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
    flight: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> Flight Recorder summary (flightrec)
    gpu_after: dict[tuple[str, int], list[float]] = field(default_factory=dict)  # (node, gpu) -> [n, util, power]
    gpu_epoch: float | None = None  # the last step time gpu_after counts from
    notes: list[Signal] = field(default_factory=list)  # notes waiting for an incident (diagnosis.notes)
    # informational machine lines that opened no incident (Xid 63, a row marked for remapping): the NaN
    # search still reads them as evidence on that machine (ts, node, kind, text), the latest few
    machine_evidence: list[tuple[float, str, str, str]] = field(default_factory=list)

    @property
    def nodes(self) -> list[str]:
        return self.topology.nodes if self.topology else []


class DiagnosisEngine:
    """Records -> incidents, actions, commands, in a ``mode``: ``ONLINE`` asks agents for stacks,
    ``BATCH`` takes the stacks that came with the input (``batch=True`` says the same).

    ``wall_clock_dwell``: the online service's engines wait ``[diagnosis] hang_dwell_s`` of wall time
    before they call a hang (settings.HangSettings.dwell_s)."""

    def __init__(self, config: Config, *, detectors: Sequence[Detector] = (), node_health: NodeHealth | None = None,
                 mode: Mode | None = None, batch: bool | None = None, classify: Any = "auto",
                 source: str = "/faultlens/diagnosis", guard_log: GuardLog | None = None,
                 on_suppressed: Callable[[str], None] | None = None, wall_clock_dwell: bool = False):
        # Static parts: built once, shared by every job's engine (online.state.EngineFactory).
        self.config = config
        self.mode: Mode = mode or (BATCH if batch else ONLINE)
        self.source = source
        d = config.diagnosis
        self.catalog = load_policy(network_alerts_to_evict=d.network_alerts_to_evict, network_window_s=d.network_window_s)
        self.settings = EngineSettings.from_config(config, self.catalog.steps, wall_clock_dwell=wall_clock_dwell)
        self.matcher = SignalMatcher(self.catalog.signals)
        self.policy = Policy(self.catalog)
        self.node_health = node_health
        # The caps' shared log (diagnosis.guardlog): every job of the fleet claims its evictions there.
        self.guard_log: GuardLog = guard_log if guard_log is not None else LocalGuardLog(config.guard,
                                                                                          config.guard.state_path)
        self.on_suppressed = on_suppressed  # a metrics hook: called with each suppression's reason
        self._classify = load_classify() if classify == "auto" else classify
        self.routed_job: str | None = None  # online: the job key this engine serves (online.state.EngineFactory)
        self.workflows: list[Workflow] = build(self.settings, self.catalog.jobwide)
        self._route_workflows()
        # The dynamic part: one EngineState (what a checkpoint carries).
        self.state = self._blank_state(CounterRules(), list(detectors),
                                       classify_ctx=new_classify_context() if classify == "auto" else None)

    def _blank_state(self, counters: CounterRules, detectors: list[Detector], classify_ctx: Any) -> EngineState:
        """``classify_ctx``: the signature catalog's context (the same context rules as explain: repeats,
        derived Xids); None for a caller-given classify."""
        d = self.config.diagnosis
        return EngineState(
            book=IncidentBook(burst_gap_s=d.burst_gap_s, inhibitor=Inhibitor(),
                              prior_blames=self.node_health.prior_blames if self.node_health else None,
                              join_window_s={"ib_link": d.network_window_s}),
            counters=counters, guard=Guard(self.config.guard), jobwide=JobWideCorrelator(self.catalog.jobwide),
            detectors=detectors, classify_ctx=classify_ctx)

    def _route_workflows(self) -> None:
        self._owners: dict[str, Workflow] = {k: wf for wf in reversed(self.workflows) for k in wf.kinds}
        self._default = next(wf for wf in self.workflows if isinstance(wf, MachineFaultWorkflow))
        self.hang: HangWorkflow = next(wf for wf in self.workflows if isinstance(wf, HangWorkflow))
        self._readers: dict[type, list[Workflow]] = {}
        for wf in self.workflows:
            for t in wf.reads:
                self._readers.setdefault(t, []).append(wf)

    def fork(self) -> DiagnosisEngine:
        """A new engine sharing this one's static parts, with its own (empty) state to restore into."""
        new = object.__new__(DiagnosisEngine)
        new.__dict__.update(self.__dict__)
        # the counter rules: compiled once, shared; each engine its own per-GPU memory
        new.state = self._blank_state(self.state.counters.fork(), [], classify_ctx=None)
        return new

    # The parts of the state callers read.
    @property
    def book(self) -> IncidentBook:
        return self.state.book

    @property
    def counters(self) -> CounterRules:
        return self.state.counters

    @property
    def detectors(self) -> list[Detector]:
        return self.state.detectors

    @property
    def now(self) -> float:
        return self.state.now

    @property
    def counts(self) -> dict[str, int]:
        return self.state.counts

    # ------------------------------------------------------------------ input

    def observe(self, record: Any) -> list[Output]:
        """Take one record; returns what it caused (incidents updated, actions, commands).

        A GPU sample may come as ``GpuColumns`` (online: faultlens.decode with ``columnar=True``): one that
        repeats its node's counters is taken without a GpuState built (``_steady_gpu``); any other is read
        as its record."""
        st = self.state
        columns = None
        if type(record) is GpuColumns:
            if self._steady_gpu(record):
                return self._drain()
            columns, record = record, record.record()
        st.counts["records"] += 1
        record = st.last_known.fill(record)
        ts = getattr(record, "ts", None) if not isinstance(record, ActionStatus) else None  # the runner's clock
        if isinstance(ts, (int, float)) and ts > st.now:
            self._advance(float(ts))
        try:
            self._observe(record, columns)
        except Exception:  # a bad record is counted and skipped; it never stops the service
            st.counts["bad_records"] += 1
            log.exception("diagnosis skipped a record it could not handle: %r", type(record).__name__)
        for det in st.detectors:
            try:
                for f in det.observe(record):
                    self._file_finding(f)
            except Exception:
                st.counts["bad_records"] += 1
                log.exception("detector %s failed on a record", getattr(det, "name", det))
        return self._drain()

    def _observe(self, record: Any, columns: GpuColumns | None = None) -> None:
        if isinstance(record, JobTopology):
            self.set_topology(record)
        elif isinstance(record, GpuSample):
            sample = self._known_gpus_only(record)
            counters = self.state.counters
            # Batch: a sample repeating its node's counters skips the rules (none can fire on it); the
            # detectors and workflows still read it. Online runs are of columns only (a checkpoint keeps them).
            steady = columns is None and self.mode is BATCH and counters.steady_sample(sample)
            if not steady:
                for f in counters.observe(sample):
                    self._file_finding(f)
            for wf in self._readers.get(GpuSample, ()):
                wf.observe(self, sample, "")
            if columns is not None and sample is record and not self.state.detectors:
                counters.begin_run(columns, sample)  # the next samples like this one take the steady path
            elif not steady and columns is None and self.mode is BATCH and sample is record:
                counters.begin_sample_run(sample)
        elif isinstance(record, KernelEvent):
            self._on_line(record, self.job_of_node(record.node))
        elif isinstance(record, NcclEvent):
            self._on_line(record, record.job or self.job_of_node(record.node))
        elif isinstance(record, StepTiming):
            for wf in self._readers.get(StepTiming, ()):
                wf.observe(self, record, record.job)
        elif isinstance(record, StackDump):
            self._keep_dump(record)
        elif isinstance(record, ActionStatus):
            self._on_action_status(record)

    def _on_action_status(self, status: ActionStatus) -> None:
        """The runner refused an action (a bad name, an unsupported type, too old): its incident is
        not mitigated by it; it stays open (or opens again) with the runner's reason."""
        if status.status != "refused":
            return
        inc = next((i for i in self.book.incidents.values() if status.action_id in i.actions), None)
        if inc is None or inc.suppressed_counts.get("runner_refused") and any(
                s.get("action") == status.action_id for s in inc.suppressed):
            return  # not this engine's action, or already heard
        inc.record_suppression("runner_refused", status.detail or "refused by the runner", ts=self.state.now,
                               type_="", nodes=(), keep=self.config.guard.suppressions_kept)
        inc.suppressed[-1]["action"] = status.action_id
        self.state.count("suppressed_runner_refused")
        if self.on_suppressed is not None:
            self.on_suppressed("runner_refused")
        inc.state.refused = f"action {status.action_id} refused by the runner ({status.adapter}): {status.detail[:300]}"
        inc.status = "open"
        inc.summary = f"open: {inc.state.refused}; a person decides"
        inc.dirty = True

    def _steady_gpu(self, columns: GpuColumns) -> bool:
        """Take a columnar GPU sample that repeats its node's counters (rules.CounterRules.steady) without a
        GpuState: what reading its record would do, nothing else. False: it must be read as its record (a
        detector reads every sample)."""
        st = self.state
        if st.detectors or not st.counters.steady(columns):
            return False
        st.counts["records"] += 1
        st.last_known.note(columns)  # no null in it: its GPUs are the last known ones
        if columns.ts > st.now:
            self._advance(columns.ts)
        job = st.jobs.get(st.node_job.get(columns.node, ""))
        if job is not None:
            self.hang.observe_steady(job, columns)
        return True

    def _known_gpus_only(self, sample: GpuSample) -> GpuSample:
        """A GPU entry whose index the node does not have (negative, or outside the GPUs the job's topology
        places on that node) is quarantined: counted and logged, never read as a GPU that came or was lost."""
        known = self.state.node_gpus.get(sample.node)
        bad = [g for g in sample.gpus if g.index < 0 or (known is not None and g.index not in known)]
        if not bad:
            return sample
        self.state.count("quarantined_gpu_entries", len(bad))
        for g in bad:
            if (sample.node, g.index) not in self.state.quarantined:
                self.state.quarantined.add((sample.node, g.index))
                log.warning("GPU sample of %s names GPU index %d, which the node does not have (known: %s): "
                            "entry quarantined", sample.node, g.index, sorted(known) if known else "0 and up")
        return msgspec.structs.replace(sample, gpus=[g for g in sample.gpus if g not in bad])

    def add_stacks(self, dumps: Iterable[StackDump]) -> int:
        """Stack dumps known up front (a batch directory's snapshot); they do not move event time."""
        return sum(self._keep_dump(d) for d in dumps)

    def _keep_dump(self, d: StackDump) -> bool:
        """A rank's py-spy dump, or its Flight Recorder summary (the same topic carries both)."""
        if d.rank is None:
            return False
        job = self.job(d.job)
        if d.text.startswith(flightrec.MARKER):
            summary = flightrec.from_text(d.text)
            if summary is not None:
                job.flight[d.rank] = summary
            return True  # a Flight Recorder record (a failed read carries its error): never the rank's stack
        job.stacks[d.rank] = d
        return True

    def set_topology(self, job: JobTopology | dict[str, Any]) -> Topology:
        topo = Topology.from_job(job)
        st = self.state
        self.job(topo.job).topology = topo
        for n in topo.nodes:
            st.counters.end_run(n)  # the node's known GPUs may change: its next sample is read in full
            st.node_job[n] = topo.job
            ranks = topo.ranks_on(n)
            gpus = {topo.placement[r][1] for r in ranks}
            if len(gpus) == len(ranks):  # the topology names each rank's GPU: those are the node's known GPUs
                st.node_gpus[n] = gpus
            else:
                st.node_gpus.pop(n, None)
        for det in st.detectors:
            det.set_topology(topo)
        return topo

    def job(self, name: str) -> JobState:
        """The job's state (made when first named)."""
        job = self.state.jobs.get(name)
        if job is None:
            job = self.state.jobs[name] = JobState(name)
        return job

    def job_of_node(self, node: str) -> str:
        """The job a topology puts ``node`` in; else the job this engine serves online (the
        repartitioner routed the record here by a topology), else "unknown" (node-local rules)."""
        return self.state.node_job.get(node) or self.routed_job or "unknown"

    def _on_line(self, record: KernelEvent | NcclEvent, job: str) -> None:
        finding = None
        classified = False  # the catalog read this line (None then means: nothing to act on)
        if self._classify is not None:
            try:
                ctx = self.state.classify_ctx
                finding = self._classify(record, ctx) if ctx is not None else self._classify(record)
                classified = True
            except Exception:
                log.debug("classify failed on a line", exc_info=True)
        for wf in self._readers.get(type(record), ()):
            if wf.observe(self, record, job):
                return
        signal = line_signal(self.matcher, record, job, self.job, finding, classified, self.state.counts)
        if signal is not None:
            self.file(signal)

    def _file_finding(self, f: Finding) -> None:
        self.state.counts["findings"] += 1
        job = f.job or (self.job_of_node(f.node) if f.node else "unknown")
        signal = self.matcher.match_finding(f, job)
        if signal is not None:
            self.file(signal)

    def file(self, signal: Signal, *, decide: bool = True) -> OpenIncident | None:
        """Into the incident book (notes wait for an incident; watched host-level signals count towards
        their job-wide rule); ``decide``: the workflow that owns the kind decides now."""
        self.state.counts["signals"] += 1
        if signal.role == NOTE:
            file_note(self.book, self.job(signal.job).notes, signal)
            return None
        inc = file_jobwide(self, signal)
        if inc is not None:
            return inc
        inc = self.book.add(signal)
        job = self.state.jobs.get(signal.job)
        if inc is not None and job is not None:
            attach_pending(inc, job.notes)
        if inc is not None and decide:
            self.decide(inc)
        return inc

    def workflow_for(self, kind: str) -> Workflow:
        return self._owners.get(kind, self._default)

    def decide(self, inc: OpenIncident) -> None:
        if inc.status == "open":
            self.workflow_for(inc.kind).decide(self, inc)

    def held_for_job(self, inc: OpenIncident) -> bool:
        return held_for_job(self, inc)

    # ------------------------------------------------------------------ time

    def tick(self, now: float | None = None, *, final: bool = False) -> list[Output]:
        """Advance time: detectors' periodic work, the workflows' job watches and open incidents, a held
        notification that waited long enough, closing quiet incidents."""
        st = self.state
        if now is not None and now > st.now:
            self._advance(now)
        now = st.now
        st.final = final
        for det in st.detectors:
            try:
                for f in det.tick(now):
                    self._file_finding(f)
            except Exception:
                log.exception("detector %s failed on tick", getattr(det, "name", det))
        for job in list(st.jobs.values()):
            for wf in self.workflows:
                wf.watch(self, job, now, final)
        for inc in self.book.open_incidents():
            self.workflow_for(inc.kind).on_tick(self, inc, now, final)
            retry = retry_after_reset(inc, self.guard_log, now)  # a person reset the breaker that refused it
            if retry is not None:
                self.act(inc, retry[0], retry=retry[1])
            held = inc.state.notify
            closing = now - inc.updated_ts > self.book.join_gap(inc.kind)
            if held is not None and not inc.decided and (final or closing or
                                                         now - inc.opened_ts >= self.settings.notify_delay_s):
                if held.nodes and set(held.nodes) <= st.evicted.get(inc.job, set()):
                    inc.state.notify = None  # those machines are already evicted: nothing left for a person here
                    inc.summary = f"{inc.kind} on machines already evicted by this job's other incident"
                    inc.dirty = True
                else:
                    self.act(inc, held)
        self.book.close_idle(now if not final else now + 1e9)
        self.book.inhibitor.forget_before(now)
        return self._drain()

    def _advance(self, ts: float) -> None:
        """Event time moves to ``ts``; online, never past the wall clock plus ``time.max_clock_skew_s``
        (a recorded directory replays its own time, whatever date it was stamped with)."""
        latest = time.time() + self.config.time.max_clock_skew_s
        if ts > latest and self.mode.name == "online":
            n = self.state.counts["future_records"] = self.state.counts.get("future_records", 0) + 1
            if n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th...: seen, never a flood
                log.warning("a record stamped %.0f is %.0f s ahead of the wall clock: event time stops at the "
                            "clock + time.max_clock_skew_s", ts, ts - latest + self.config.time.max_clock_skew_s)
            ts = latest
        self.state.now = max(self.state.now, ts)

    # ------------------------------------------------------------------ acting

    def act(self, inc: OpenIncident, decision: Decision, *, retry: str = "") -> Decision | None:
        """Through the guard rails and out as an action; returns what was taken (None: suppressed).
        ``retry``: an eviction refused earlier and claimed again after a guard reset."""
        st = self.state
        job = st.jobs.get(inc.job)
        job_nodes = len(job.nodes) if job and job.nodes else max(1, len(decision.nodes))
        inc.decided.add(decision.type)
        newest = max((float(e.get("ts") or 0.0) for e in inc.evidence), default=None)  # online: its age on the wall clock
        live = self.mode.name == "online" and self.settings.live
        wall = time.time()
        evidence_age_s = round(wall - newest, 3) if newest and live else None
        lag_s = round(max(0.0, wall - st.now), 3) if live and st.now else None  # event time behind the wall clock
        window_s = self.settings.max_evidence_age_s
        verdict = st.guard.check(decision, job=inc.job, now=st.now, job_nodes=job_nodes, log=self.guard_log,
                                 claim_id=output_id("act", inc.id, decision.type), retry=retry,
                                 evidence_age_s=evidence_age_s, max_evidence_age_s=window_s)
        decision = verdict.asked or decision  # made job-level when it named no machine (diagnosis.guard)
        inc.decided.add(decision.type)
        for reason, text in verdict.suppressed:
            inc.record_suppression(reason, text, ts=st.now, type_=decision.type, nodes=decision.nodes,
                                   keep=self.config.guard.suppressions_kept)
            st.count(f"suppressed_{reason}")
            if self.on_suppressed is not None:
                self.on_suppressed(reason)
        if verdict.decision is None:
            return None
        d = verdict.decision
        if d.type in _REMEDIES:
            inc.state.refused = None
        elif decision.type in _REMEDIES and verdict.suppressed:
            inc.state.refused = f"{decision.type} refused by the guard: {verdict.suppressed[-1][1]}"
            inc.summary = f"open: {inc.state.refused}; a person decides"
        if verdict.storm:
            inc.summary = f"fabric-level storm: {'; '.join(verdict.notes)}"
        inc.decided.add(d.type)
        if d.type == ActionType.ROLLBACK_CODE:
            inc.confidence = max(inc.confidence, d.confidence)  # the share of ranks that raised it
        action = Action(
            # Deterministic (incident, type): an incident takes each action type once, and a replay or a
            # restored instance re-derives the same id, which the runner executes at most once.
            id=output_id("act", inc.id, d.type), incident_id=inc.id, job=inc.job, ts=st.now, type=d.type,
            nodes=list(d.nodes), suspects=list(inc.record().suspects), evidence=list(inc.evidence[:20]),
            confidence=round(d.confidence, 4), dry_run=self.config.guard.dry_run,
            reason=d.reason + (f" [guard: {'; '.join(verdict.notes)}]" if verdict.notes else ""), plan=d.plan,
            evidence_age_s=evidence_age_s, consumer_lag_s=lag_s, evidence_window_s=window_s,
        )
        inc.actions.append(action.id)
        inc.dirty = True
        if d.type in _REMEDIES:
            inc.summary = inc.summary or d.reason
        st.outputs.append(action)
        if d.type != ActionType.NOTIFY:
            self.book.promote_cause(inc)
            self.book.confirm_cause(inc)
        if d.type == ActionType.RESTART_JOB:
            self.book.note_action_cause(inc, "restart_job")
        if d.type == ActionType.EVICT_NODES:
            st.evicted.setdefault(inc.job, set()).update(d.nodes)
        if self.node_health is not None and d.blame:
            for node in d.nodes:
                self.node_health.record_blame(node, incident_id=inc.id, job=inc.job, kind=inc.kind, ts=st.now)
                if d.type == ActionType.EVICT_NODES:
                    self.node_health.record_eviction(node, incident_id=inc.id, job=inc.job, kind=inc.kind,
                                                     reason=d.reason[:200], ts=st.now)
        return d

    def _drain(self) -> list[Output]:
        out: list[Output] = [i.record() for i in self.book.dirty()]
        out.extend(self.state.outputs)
        self.state.outputs = []
        return out

    # ------------------------------------------------------------------ views

    def incidents(self) -> list[Incident]:
        return [i.record() for i in sorted(self.book.incidents.values(), key=lambda i: (i.opened_ts, i.id))]

    def detector_names(self) -> list[str]:
        return [getattr(d, "name", type(d).__name__) for d in self.state.detectors]


# Action types that remedy (an incident's summary is the reason of the first one taken).
_REMEDIES = frozenset({ActionType.EVICT_NODES, ActionType.RESTART_JOB, ActionType.ROLLBACK_CODE,
                       ActionType.RUN_DIAGNOSTICS})
