"""DiagnosisEngine: records in, incidents, actions and commands out.

One code path for online and batch: the online service feeds it records from
the bus and calls ``tick`` every second of wall time; the batch path feeds a
directory's records in time order and calls ``tick`` on event time. Time is
always the records' own timestamps, never the clock, so a replay of the same
records gives the same incidents; but it never runs ahead of the wall clock by
more than ``time.max_clock_skew_s``: one record stamped 2100 must not move a
job's clock (its actions would be dated 2100 and its incidents close at once).

Pipeline per record: rules (NVML counters here; log lines via diagnosis.classify
when it is installed, and the policy's signal matchers) and pluggable detectors
turn records into findings; the policy's matcher turns findings into signals of
an incident kind; the IncidentBook groups them (bursts, inhibition); the policy
decides; the guard rails filter; node health remembers.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from faultlens import flightrec
from faultlens.collectors.signatures import classify
from faultlens.config import Config
from faultlens.decode import GpuColumns
from faultlens.diagnosis import hangroot
from faultlens.diagnosis.decision import Decision, Hold
from faultlens.diagnosis.detectors import (
    Detector,
    default_detectors,
    load_classify,
    new_classify_context,
)
from faultlens.diagnosis.exceptions import exception_fingerprint, user_exception
from faultlens.diagnosis.guard import Guard, job_level, retry_after_reset
from faultlens.diagnosis.guardlog import GuardLog, LocalGuardLog
from faultlens.diagnosis.incidents import IncidentBook, OpenIncident, Signal
from faultlens.diagnosis.inhibit import Inhibitor
from faultlens.diagnosis.jobwide import JobWideCorrelator, JobWideRule
from faultlens.diagnosis.modes import BATCH, ONLINE, Mode, output_id
from faultlens.diagnosis.nanloss import NanWatch, rank_named_in
from faultlens.diagnosis.nodehealth import NodeHealth
from faultlens.diagnosis.notes import NOTE, attach_pending, file_note
from faultlens.diagnosis.policy import (
    Policy,
    SignalMatcher,
    load_policy,
    unmatched_but_actionable,
)
from faultlens.diagnosis.progress import JobProgress, check_hang
from faultlens.diagnosis.remedy import (
    ADAPTABLE_KINDS,
    NAN_MACHINE_KINDS,
    adapt_or_evict,
    decide_nan,
)
from faultlens.diagnosis.replay import run_records
from faultlens.diagnosis.rules import CounterRules
from faultlens.diagnosis.stacks import StackAggregator, StackVerdict
from faultlens.records import LastKnown
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
    ``BATCH`` takes the stacks that came with the input (``batch=True`` is the old spelling of it)."""

    def __init__(self, config: Config, *, detectors: Sequence[Detector] = (), node_health: NodeHealth | None = None,
                 mode: Mode | None = None, batch: bool | None = None, classify: Any = "auto",
                 source: str = "/faultlens/diagnosis", guard_log: GuardLog | None = None,
                 on_suppressed: Callable[[str], None] | None = None):
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
        # The caps' shared log (diagnosis.guardlog): every job of the fleet claims its evictions there.
        self.guard_log: GuardLog = guard_log if guard_log is not None else LocalGuardLog(config.guard,
                                                                                          config.guard.state_path)
        self.on_suppressed = on_suppressed  # a metrics hook: called with each suppression's reason
        self.aggregator = StackAggregator()
        self.steps_cfg = {"hang_step_multiple": 20.0, "hang_min_silence_s": 60.0, "hang_grace_s": 180.0,
                          "hang_gap_multiple": 1.5, "end_min_silence_s": 30.0, "end_step_multiple": 5.0,
                          "end_gap_multiple": 1.2, "nan_settle_s": 15.0,
                          "stacks_wait_s": 30.0, "notify_delay_s": 300.0, **self.catalog.steps}
        self.jobwide = JobWideCorrelator(self.catalog.jobwide)
        self._jobs: dict[str, JobState] = {}
        self._node_job: dict[str, str] = {}
        self.routed_job: str | None = None  # online: the job key this engine serves (diagnosis.state.EngineFactory)
        # online: a silence must stay a hang this long in wall time before it is called ([diagnosis]
        # hang_dwell_s: a backlog's steps reach the service seconds after its GPU samples, whatever their times)
        self.hang_dwell_s = 0.0
        self._outputs: list[Output] = []
        self._evicted: dict[str, set[str]] = {}  # job -> machines this engine had evicted
        # job -> slow machine -> (the remedy it got, the incident): one decision per slow machine
        self._node_gpus: dict[str, set[int]] = {}  # node -> the GPU indexes the job's topology places on it
        self._quarantined: set[tuple[str, int]] = set()  # (node, GPU index) entries already reported
        self._slow_remedy: dict[str, dict[str, tuple[str, str]]] = {}
        self._classify = load_classify() if classify == "auto" else classify
        # the same context rules as explain (repeats, derived Xids); a caller-given classify gets none
        self._classify_ctx = new_classify_context() if classify == "auto" else None
        self.now = 0.0
        self._final = False  # set by tick(final=True): decide now, nothing more will come
        self.counts: dict[str, int] = {"records": 0, "signals": 0, "bad_records": 0, "findings": 0}
        self._last_known = LastKnown()  # a null GPU field (N/A) reads as unchanged

    # ------------------------------------------------------------------ input

    def observe(self, record: Any) -> list[Output]:
        """Take one record; returns what it caused (incidents updated, actions, commands).

        A GPU sample may come as ``GpuColumns`` (online: stream.decode with ``columnar=True``): one that
        repeats its node's counters is taken without a GpuState built (``_steady_gpu``); any other is read
        as its record."""
        columns = None
        if type(record) is GpuColumns:
            if self._steady_gpu(record):
                return self._drain()
            columns, record = record, record.record()
        self.counts["records"] += 1
        record = self._last_known.fill(record)
        ts = getattr(record, "ts", None) if not isinstance(record, ActionStatus) else None  # the runner's clock
        if isinstance(ts, (int, float)) and ts > self.now:
            self._advance(float(ts))
        try:
            self._observe(record, columns)
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

    def _observe(self, record: Any, columns: GpuColumns | None = None) -> None:
        if isinstance(record, JobTopology):
            self.set_topology(record)
        elif isinstance(record, GpuSample):
            sample = self._known_gpus_only(record)
            for f in self.counters.observe(sample):
                self._file_finding(f)
            job = self._jobs.get(self._node_job.get(sample.node, ""))
            if job is not None:
                job.progress.observe_gpu(sample)
                _gpu_since_last_step(job, sample)
            if columns is not None and sample is record and not self.detectors:
                self.counters.begin_run(columns, sample)  # the next samples like this one take the steady path
        elif isinstance(record, KernelEvent):
            self._on_line(record, self.job_of_node(record.node))
        elif isinstance(record, NcclEvent):
            self._on_line(record, record.job or self.job_of_node(record.node))
        elif isinstance(record, StepTiming):
            self._on_step(record)
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
        inc.record_suppression("runner_refused", status.detail or "refused by the runner", ts=self.now,
                               type_="", nodes=(), keep=self.config.guard.suppressions_kept)
        inc.suppressed[-1]["action"] = status.action_id
        self.counts["suppressed_runner_refused"] = self.counts.get("suppressed_runner_refused", 0) + 1
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
        if self.detectors or not self.counters.steady(columns):
            return False
        self.counts["records"] += 1
        self._last_known.note(columns)  # no null in it: its GPUs are the last known ones
        ts = columns.ts
        if ts > self.now:
            self._advance(ts)
        job = self._jobs.get(self._node_job.get(columns.node, ""))
        if job is None:
            return True
        progress = job.progress
        last = progress.last_step_ts
        if last is not None:  # a run has GPUs: progress.observe_gpu and _gpu_since_last_step, on the columns
            grace = max(5.0, 2.0 * progress.median_step_s())
            utils = columns.floats("util")
            progress.observe_gpu_means(ts, utils, [m for m in columns.floats("mem_used_mb") if m], grace)
            if ts > last + grace:
                _gpu_figures_since_last_step(job, columns.node, last, zip(columns.ints("index"), utils,
                                                                           columns.floats("power_w"), strict=True))
        return True

    def _known_gpus_only(self, sample: GpuSample) -> GpuSample:
        """A GPU entry whose index the node does not have (negative, or outside the GPUs the job's topology
        places on that node) is quarantined: counted and logged, never read as a GPU that came or was lost."""
        known = self._node_gpus.get(sample.node)
        bad = [g for g in sample.gpus if g.index < 0 or (known is not None and g.index not in known)]
        if not bad:
            return sample
        self.counts["quarantined_gpu_entries"] = self.counts.get("quarantined_gpu_entries", 0) + len(bad)
        for g in bad:
            if (sample.node, g.index) not in self._quarantined:
                self._quarantined.add((sample.node, g.index))
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
        job = self._job(d.job)
        if d.text.startswith(flightrec.MARKER):
            summary = flightrec.from_text(d.text)
            if summary is not None:
                job.flight[d.rank] = summary
            return True  # a Flight Recorder record (a failed read carries its error): never the rank's stack
        job.stacks[d.rank] = d
        return True

    def set_topology(self, job: JobTopology | dict[str, Any]) -> Topology:
        topo = Topology.from_job(job)
        state = self._job(topo.job)
        state.topology = topo
        for n in topo.nodes:
            self.counters.end_run(n)  # the node's known GPUs may change: its next sample is read in full
            self._node_job[n] = topo.job
            ranks = topo.ranks_on(n)
            gpus = {topo.placement[r][1] for r in ranks}
            if len(gpus) == len(ranks):  # the topology names each rank's GPU: those are the node's known GPUs
                self._node_gpus[n] = gpus
            else:
                self._node_gpus.pop(n, None)
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
        classified = False  # the catalog read this line (None then means: nothing to act on)
        if self._classify is not None:
            try:
                finding = self._classify(record, self._classify_ctx) if self._classify_ctx is not None \
                    else self._classify(record)
                classified = True
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
        if signal is not None and finding is None and classified and signal.role != "info" \
                and _catalog_says_benign(record):
            # One verdict: the catalog found nothing to act on in this line (an informational entry such as
            # Xid 63, a row marked for remapping), so it opens no incident here either (explain says none).
            self.counts["benign_lines"] = self.counts.get("benign_lines", 0) + 1
            if signal.node and signal.kind in NAN_MACHINE_KINDS:
                kept = self._job(job).machine_evidence
                kept.append((signal.ts, signal.node, signal.kind, record.raw[:300]))
                del kept[:-64]
            return
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
        if "rollback_code" in inc.decided:
            # decided at the first traceback; the ranks that raised it since are counted on the incident
            job_state = self._jobs.get(job)
            world = job_state.topology.world_size if job_state and job_state.topology else None
            again = self.policy.decide(inc, self.now, world_size=world)
            if isinstance(again, Decision) and again.type == "rollback_code":
                inc.summary, inc.confidence, inc.dirty = again.reason, max(inc.confidence, again.confidence), True

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
        # A job-level line with a node (an NFS server not responding, seen from one host) counts towards its
        # job-wide rule too: hung tasks on a few hosts plus such lines on most is one shared stall.
        rule = self.jobwide.rule_for(signal.kind, signal.source) \
            if signal.node and not signal.rule.startswith("jobwide:") else None
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
            self._advance(now)
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
            elif not inc.decided:
                self._decide(inc)
            retry = retry_after_reset(inc, self.guard_log, now)  # a person reset the breaker that refused it
            if retry is not None:
                self._act(inc, retry[0], retry=retry[1])
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

    def _advance(self, ts: float) -> None:
        """Event time moves to ``ts``; online, never past the wall clock plus ``time.max_clock_skew_s``
        (a recorded directory replays its own time, whatever date it was stamped with)."""
        latest = time.time() + self.config.time.max_clock_skew_s
        if ts > latest and self.mode.name == "online":
            n = self.counts["future_records"] = self.counts.get("future_records", 0) + 1
            if n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th...: seen, never a flood
                log.warning("a record stamped %.0f is %.0f s ahead of the wall clock: event time stops at the "
                            "clock + time.max_clock_skew_s", ts, ts - latest + self.config.time.max_clock_skew_s)
            ts = latest
        self.now = max(self.now, ts)

    def _check_progress(self, job: JobState, now: float, *, final: bool = False) -> None:
        """Steps stopped while the hosts are alive (diagnosis.progress): open (or join) the job's hang."""
        call = check_hang(job.progress, now, self.steps_cfg, self.config.diagnosis.hang_no_progress_s, final=final,
                          stacks=job.stacks.values())
        if call is None:
            job.progress.hang_pending_since = None
            return
        if self.hang_dwell_s > 0 and not final:
            wall = time.time()
            since = job.progress.hang_pending_since
            if since is None or since > wall:
                job.progress.hang_pending_since = wall
                return
            if wall - since < self.hang_dwell_s:
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
        st.pending = None
        g = self.config.guard
        job_nodes = max(1, len(job.nodes))
        allowed = min(g.max_evictions_per_job_per_hour, max(1, math.floor(g.max_evicted_fraction * job_nodes)))
        ranking = self._rank_hang(inc, job, dumps, verdict, now, allowed) if job.topology is not None else None
        lagging = tuple(s["node"] for s in inc.top_suspects() if any("stopped before" in x for x in s["reasons"]))
        if ranking is not None and ranking.roots and self._explained_by_host(inc, ranking.roots):
            return  # the root machine's own incident (its hung task) decides; the hang is muted into it
        if ranking is not None and ranking.roots:
            decision = _evict_roots(ranking, verdict)
        else:
            decision = self.policy.decide_hang(inc, verdict, stacks_expected=self.mode.stacks_expected,
                                               max_nodes=allowed, lagging_nodes=lagging if len(lagging) <= allowed else ())
            decision = _never_left_hung(decision, ranking, inc, allowed)
        inc.confidence = max(inc.confidence, decision.confidence)
        if decision.nodes:
            inc.summary = decision.reason
        taken = self._act(inc, decision)
        if taken is not None and taken.type == "notify" and decision.type == "evict_nodes":
            # the guard rails refused the eviction: the job must not stay hung on a notification alone
            named = tuple(ranking.best(allowed)) if ranking is not None and ranking.best(allowed) else decision.nodes[:allowed]
            self._act(inc, Decision("run_diagnostics", named, f"hang: eviction refused by the guard rails; restart with "
                                    f"stop-time diagnostics on {', '.join(named) or 'the job'}", 0.6))

    def _explained_by_host(self, hang: OpenIncident, roots: Sequence[str]) -> bool:
        """A hang rooted on a machine whose kernel reported a hung task (a process blocked in I/O) is that
        machine's stall, not a second fault: the hung task, weak while it waited for the job's other nodes,
        is confirmed as the cause and mutes the hang; its own route decides (stop-time diagnostics), instead
        of an eviction on the hang's evidence and a second action on the same machine."""
        for other in self.book.open_incidents(hang.job):
            if other.kind in _HOST_STALL_KINDS and other.node in roots and not other.state.folded_into:
                self.book.confirm_cause(other)
                return hang.status == "resolved"
        return False

    def _rank_hang(self, inc: OpenIncident, job: JobState, dumps: list[StackDump], verdict: StackVerdict | None,
                   now: float, allowed: int) -> hangroot.RootRanking | None:
        """Score every machine as the root of the hang (diagnosis.hangroot) and file them as the suspects."""
        topo = job.topology
        assert topo is not None
        catalog = hangroot.load_frames()
        by_rank = {d.rank: d for d in dumps if d.rank is not None}
        states: dict[int, hangroot.RankState] = {}
        if by_rank:
            for r in range(topo.world_size):
                d = by_rank.get(r)
                states[r] = hangroot.rank_state(r, d.text, catalog, error=d.error) if d is not None else \
                    hangroot.RankState(r, "missing", frame="no stack answered")
        majority = verdict.groups[0][1] if verdict is not None and verdict.groups else []
        flight = flightrec.wavefront(job.flight) if job.flight else {}
        if flight:
            inc.evidence.append({"ts": now, "source": "flight_recorder", "rule": "flight_recorder:wavefront",
                                 "text": "; ".join(w for whys in list(flight.values())[:4] for w in whys[:1]),
                                 "figures": {"ranks": sorted(flight)[:64], "dumps": len(job.flight)}})
        ev = catalog.evidence
        means = {k: (v[1] / v[0], v[2] / v[0]) for k, v in job.gpu_after.items() if v[0] > 0}
        gpu = hangroot.gpu_outliers(means, topo, util_gap=ev["gpu_util_gap"], power_ratio=ev["gpu_power_ratio"],
                                    max_share=ev["gpu_max_share"]) if job.gpu_epoch is not None else {}
        machine = self._machine_faults(job, inc, float(ev["window_s"]), set(ev["machine_fault_kinds"]))
        if not (states or flight or gpu or machine):
            return None
        ranking = hangroot.rank_roots(states, topo, majority=majority, flight=flight, gpu=gpu, machine=machine,
                                      allowed=allowed, catalog=catalog)
        for s in ranking.suspects[:32]:
            for i, why in enumerate(s.reasons or ["ranked"]):
                inc.suspect(s.node, s.score, why, rank=s.ranks[i] if i < len(s.ranks) else None,
                            gpu=s.gpus[i] if i < len(s.gpus) else None)
        inc.evidence.append({"ts": now, "source": "stacks", "rule": "hangroot:rank",
                             "text": ("root: " + ", ".join(ranking.roots)) if ranking.roots else
                                     f"no single root: {ranking.why_not}",
                             "figures": {"suspects": [[s.node, s.score] for s in ranking.suspects[:8]],
                                         "states": dict(Counter(x.category for x in states.values()))}})
        return ranking

    def _machine_faults(self, job: JobState, inc: OpenIncident, window_s: float, kinds: set[str]) -> dict[str, str]:
        """Explicit machine faults of the job's machines near the hang: node -> what."""
        out: dict[str, str] = {}
        nodes = set(job.nodes)
        for other in self.book.incidents.values():
            if other is inc or other.job != job.name or other.node not in nodes or other.kind not in kinds:
                continue
            if other.state.severity not in (None, "critical"):
                continue  # a warning (a non-fatal NVSwitch error, a corrected-error burst) breaks no collective
            if abs(other.opened_ts - inc.opened_ts) <= window_s:
                out.setdefault(str(other.node), f"{other.kind} on {other.node} ({other.summary or other.id})"[:200])
        return out

    # ------------------------------------------------------------------ decisions

    def _decide(self, inc: OpenIncident) -> None:
        if inc.status != "open" or inc.kind == "hang":
            return
        job = self._jobs.get(inc.job)
        rule = self.jobwide.rule_for(inc.kind) if inc.node is not None else None
        if rule is not None and rule.hold_s > 0 and job is not None and len(job.nodes) >= rule.min_nodes \
                and not self._final and self.now - inc.opened_ts < rule.hold_s:
            inc.state.waiting = f"waiting {rule.hold_s:.0f} s for the job's other nodes ({rule.name})"
            inc.state.pending = inc.state.pending or _JOBWIDE_HOLD  # not closed as quiet while it waits
            return  # the job's other nodes may report the same within the hold: then it is one shared cause
        if inc.state.pending == _JOBWIDE_HOLD:
            inc.state.pending = None
        if inc.kind == "nan_loss":
            self._decide_nan(inc, job)
            return
        settle = self.steps_cfg.get("exception_settle_s", 10.0)
        if inc.kind == "user_exception" and not self._final and self.now - inc.opened_ts < settle:
            inc.state.waiting = f"waiting {settle:.0f} s for the other ranks' tracebacks"
            return  # the other ranks' tracebacks arrive within seconds: count them before deciding
        world = job.topology.world_size if job and job.topology else None
        decision: Decision | Hold | None = self.policy.decide(inc, self.now, world_size=world)
        if isinstance(decision, Decision) and decision.type == "evict_nodes" and inc.kind in ADAPTABLE_KINDS:
            if self._one_slow_decision(inc, decision):
                return
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

    def _one_slow_decision(self, inc: OpenIncident, decision: Decision) -> bool:
        """A slow machine gets one decision, adapt or evict: a second incident on it (the step-time model's
        fail_slow beside the throttle counters' thermal_throttle) joins the one already decided. True: joined."""
        taken = self._slow_remedy.get(inc.job, {})
        earlier = [taken[n] for n in decision.nodes if n in taken and taken[n][1] != inc.id]
        if not decision.nodes or len(earlier) < len(decision.nodes):
            return False
        action, host_id = earlier[0]
        host = self.book.incidents.get(host_id)
        inc.decided.add(decision.type)
        inc.status, inc.state.folded_into, inc.state.waiting, inc.dirty = "resolved", host_id, None, True
        inc.summary = (f"the same slow machine as incident {host_id}, which already took {action}: one decision per "
                       "slow machine")
        if host is not None:
            host.note_muted(inc.kind, f"incident {inc.id} ({inc.kind})", "one_decision_per_slow_machine",
                            inc.opened_ts, node=inc.node)
        return True

    def _decide_nan(self, inc: OpenIncident, job: JobState | None) -> None:
        if job is None:
            return
        settle = max(self.steps_cfg["nan_settle_s"], 3.0 * job.progress.median_step_s())
        decision = decide_nan(inc, job, self.policy, self.book.incidents.values(), self._evicted.get(inc.job, set()),
                              wait_s=0.0 if self._final else settle - (self.now - inc.opened_ts))
        if decision is not None:
            self._act(inc, decision)

    def _act(self, inc: OpenIncident, decision: Decision, *, retry: str = "") -> Decision | None:
        """Through the guard rails and out as an action; returns what was taken (None: suppressed)."""
        job = self._jobs.get(inc.job)
        job_nodes = len(job.nodes) if job and job.nodes else max(1, len(decision.nodes))
        inc.decided.add(decision.type)
        decision = job_level(decision)  # no node-targeted action with no node (diagnosis.guard)
        newest = max((float(e.get("ts") or 0.0) for e in inc.evidence), default=None)  # online: its age on the wall clock
        verdict = self.guard.check(decision, job=inc.job, now=self.now, job_nodes=job_nodes, log=self.guard_log,
                                   claim_id=output_id("act", inc.id, decision.type), retry=retry,
                                   evidence_age_s=time.time() - newest if newest and self.mode.name == "online" else None,
                                   max_evidence_age_s=self.config.diagnosis.max_evidence_age_s)
        inc.decided.add(decision.type)
        for reason, text in verdict.suppressed:
            inc.record_suppression(reason, text, ts=self.now, type_=decision.type, nodes=decision.nodes,
                                   keep=self.config.guard.suppressions_kept)
            self.counts[f"suppressed_{reason}"] = self.counts.get(f"suppressed_{reason}", 0) + 1
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
        if d.type == "rollback_code":
            inc.confidence = max(inc.confidence, d.confidence)  # the share of ranks that raised it
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
            self.book.confirm_cause(inc)
        if d.type == "restart_job":
            self.book.note_action_cause(inc, "restart_job")
        if d.type == "evict_nodes":
            self._evicted.setdefault(inc.job, set()).update(d.nodes)
        if d.type in (ActionType.EVICT_NODES, ActionType.ADAPT_PARALLELISM) and inc.kind in ADAPTABLE_KINDS:
            for node in d.nodes:
                self._slow_remedy.setdefault(inc.job, {}).setdefault(node, (d.type, inc.id))
        if self.node_health is not None and d.blame:
            for node in d.nodes:
                self.node_health.record_blame(node, incident_id=inc.id, job=inc.job, kind=inc.kind, ts=self.now)
                if d.type == "evict_nodes":
                    self.node_health.record_eviction(node, incident_id=inc.id, job=inc.job, kind=inc.kind,
                                                     reason=d.reason[:200], ts=self.now)
        return d

    def _drain(self) -> list[Output]:
        out: list[Output] = [i.record() for i in self.book.dirty()]
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


def _gpu_since_last_step(job: JobState, sample: GpuSample) -> None:
    """Per-GPU utilisation and power since the job's last step (what hangroot compares during a hang)."""
    last = job.progress.last_step_ts
    if last is None or sample.ts <= last + max(5.0, 2.0 * job.progress.median_step_s()):
        return
    _gpu_figures_since_last_step(job, sample.node, last, ((g.index, g.util, g.power_w) for g in sample.gpus))


def _gpu_figures_since_last_step(job: JobState, node: str, last: float,
                                 figures: Iterable[tuple[int, float | None, float | None]]) -> None:
    """_gpu_since_last_step on (GPU index, utilisation, power) of a sample after the grace."""
    if job.gpu_epoch != last:
        job.gpu_after, job.gpu_epoch = {}, last
    for index, util, power in figures:
        if util is None and power is None:
            continue
        acc = job.gpu_after.setdefault((node, index), [0.0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += util if util is not None else -1.0
        acc[2] += power or 0.0


def _evict_roots(ranking: hangroot.RootRanking, verdict: StackVerdict | None) -> Decision:
    """Evict the machine(s) the evidence singles out as the root of the hang."""
    roots = ranking.roots
    top = {s.node: s for s in ranking.suspects}
    why = "; ".join(f"{n} (score {top[n].score:.2f}: {'; '.join(top[n].reasons[:3])})" for n in roots)
    nxt = next((s for s in ranking.suspects if s.node not in roots), None)
    runner_up = f"; next {nxt.node} at {nxt.score:.2f}" if nxt is not None else ""
    return Decision("evict_nodes", tuple(roots), f"hang rooted at {', '.join(roots)}: {why}{runner_up}"[:900],
                    0.95, plan={"roots": list(roots), "scores": {s.node: s.score for s in ranking.suspects[:8]},
                                "root_ranks": sorted(r for n in roots for r in top[n].ranks)[:64],
                                "outliers": verdict.outliers[:256] if verdict else [],
                                "missing": verdict.missing[:256] if verdict else []})


def _never_left_hung(decision: Decision, ranking: hangroot.RootRanking | None, inc: OpenIncident,
                     allowed: int) -> Decision:
    """The group decision, kept within the blast radius and never a bare notification."""
    best = tuple(ranking.best(allowed)) if ranking is not None else ()
    why_not = f" (no single root: {ranking.why_not})" if ranking is not None and ranking.why_not else ""
    if decision.type == "evict_nodes":
        if len(decision.nodes) <= allowed:
            ordered = tuple(sorted(decision.nodes, key=lambda n: (-inc.suspects.get(n, {}).get("score", 0.0), n)))
            return Decision("evict_nodes", ordered, f"hang in the {(decision.plan or {}).get('group', '')} group of "
                            f"{ordered[0]}: {decision.reason}{why_not}", decision.confidence, decision.plan)
        named = best or decision.nodes[:allowed]
        return Decision("run_diagnostics", named, f"hang: the group holding every outlier is {len(decision.nodes)} "
                        f"machines, over the blast radius ({allowed}); restart with stop-time diagnostics on the "
                        f"best-ranked {', '.join(named)}{why_not}", 0.6, decision.plan)
    if decision.type == "notify":
        cats = Counter(s.category for s in ranking.states.values()) if ranking is not None else Counter()
        common = cats.most_common(1)[0] if cats else ("", 0)
        if common[0] in ("input", "storage") and common[1] >= 0.5 * sum(cats.values()):
            # every rank waits on data or storage together: the shared input/storage, not a machine or a restart
            return Decision("notify", (), f"hang with every rank waiting on {common[0]} ({common[1]} of "
                            f"{sum(cats.values())} ranks): a job-wide {common[0]} stall, no machine to blame", 0.5)
        return Decision("run_diagnostics", best, f"hang with no machine singled out{why_not}: restart with stop-time "
                        f"diagnostics{' on ' + ', '.join(best) if best else ''}", 0.5)
    if decision.type == "run_diagnostics" and not decision.nodes and best:
        return Decision("run_diagnostics", best, f"{decision.reason}; best-ranked: {', '.join(best)}", decision.confidence)
    return decision
# Machine incidents that explain a hang rooted on their machine (engine._explained_by_host).
_HOST_STALL_KINDS = frozenset({"hung_task"})
_JOBWIDE_HOLD = "jobwide_hold"  # IncidentState.pending while a node's incident waits for the job's other nodes


def _catalog_says_benign(record: KernelEvent | NcclEvent) -> bool:
    """The signature catalog has an entry for this line and it says there is nothing to act on (explain's
    info/none verdict), as opposed to a line the catalog does not know (the policy's own patterns decide)."""

    c = classify(record)  # stateless: a repeat that escalates already gave a finding
    return c.rule is not None and (c.benign or c.category == "none")


def _mark_estimated(signal: Signal, record: KernelEvent | NcclEvent) -> None:
    """A log time the batch reader estimated (boot-relative dmesg, an untimed line) says so in the evidence."""
    if record.fields.get("ts_estimated"):
        signal.figures["ts_estimated"] = True
        signal.figures["ts_anchor"] = record.fields.get("ts_anchor", "")
