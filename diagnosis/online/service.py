"""The online diagnosis service: telemetry in, incidents/actions/commands out; scales out by job.

Every instance runs two stages in one thread (DESIGN.md, "Signals and topics"):

1. the repartitioner (diagnosis.online.repartition): a member of the group
   ``<group_id>-repartition`` over the node-keyed input topics; it re-keys every
   record by job onto ``diag-repartition``, node -> job from the jobs topic;
2. diagnosis: a member of the group ``<group_id>`` over ``diag-repartition``.
   It owns the jobs of its partitions, one DiagnosisEngine per job
   (diagnosis.online.state), so everything that reasons across a job's nodes stays
   whole. Nodes outside any job share one engine per partition (job "unknown",
   node-local rules only). Jobs move between instances only when the group
   rebalances: the old owner checkpoints and lets go, the new owner restores the
   jobs of its new partitions from ``diag-changelog`` and replays from the
   partition's checkpoint marker.

Effects in order, per round: apply records -> checkpoint the jobs that changed
(state and the outputs they decided, then a marker) -> send the outputs ->
commit below the marker. A crash anywhere in that order loses nothing: a
restored owner re-sends the outbox under the same ids (the runner executes an
id once; an incident is keyed by its id) and never decides an action again
that its checkpoint says it took.

Time is each partition's stream time (diagnosis/online/clocks.py); engines tick
once a second of wall time.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from faultlens import decode as wire
from faultlens.config import Config
from faultlens.diagnosis.engine import Detector, DiagnosisEngine
from faultlens.diagnosis.guardlog import GuardLog, KafkaGuardLog
from faultlens.diagnosis.nodehealth import NodeHealth
from faultlens.diagnosis.online.alerts import LagWatch, OutputAlerts
from faultlens.diagnosis.online.clocks import PartitionClocks
from faultlens.diagnosis.online.membership import MemberConsumer, default_member_id, membership_mode
from faultlens.diagnosis.online.record_headers import forwarded_headers
from faultlens.diagnosis.online.repartition import UNJOBBED_PREFIX, Repartitioner
from faultlens.diagnosis.online.resend import OutputResend, resend_if_lost
from faultlens.diagnosis.online.restorer import BackgroundRestorer
from faultlens.diagnosis.online.state import (
    MARK_KEY,
    ChangelogReader,
    CheckpointError,
    EngineFactory,
    JobState,
    Restored,
    changelog_context,
    mark_value,
    restore,
    snapshot,
)
from faultlens.errors import BusError, SchemaError
from faultlens.schema import DeadLetter
from faultlens.stream import topics
from faultlens.stream.bus import Consumer, Message, Producer, ensure_topics
from faultlens.stream.bus.consume_loop import ConsumeLoop, close_quietly
from faultlens.stream.bus.librdkafka_consumer import consumer_backend, group_consumer
from faultlens.stream.bus.librdkafka_producer import make_producer
from faultlens.stream.bus.replay_log import QueuedRebalance, topic_partitions
from faultlens.stream.signing import Keyring, seal

log = logging.getLogger(__name__)
INPUT_KINDS = ("jobs", "gpu", "kernel", "nccl", "steps", "stacks", "action-status")
REPARTITION = "diag-repartition"


class _FleetView:
    """What callers of the single-engine service read (``service.engine.job_of_node``)."""

    def __init__(self, service: DiagnosisService):
        self._service = service

    def job_of_node(self, node: str) -> str:
        r = self._service.repartitioner
        return r.job_of_node(node) if r is not None else "unknown"


class DiagnosisService:
    """Run with ``serve()`` (blocking) or ``start()`` / ``stop()`` (a thread, for tests and the demo)."""

    def __init__(self, config: Config, *, bootstrap: str | None = None, detectors: Sequence[Detector] = (),
                 node_health: NodeHealth | None = None, tick_interval_s: float = 1.0, poll_timeout_ms: int = 100,
                 from_beginning: bool = False, unknown_hold_s: float = 3.0, metrics: Any = None,
                 checkpoint_interval_s: float = 5.0, lookback_s: float = 60.0, guard_log: GuardLog | None = None):
        self.config = config
        # The caps' log shared by every instance (diagnosis.guardlog): the topic diag-guard, opened by serve()
        # unless one is given (tests).
        self.guard_log = guard_log
        self.metrics = metrics  # faultlens.metrics.ServiceMetrics, or None
        self.alerts = OutputAlerts(config.diagnosis, metrics, self.open_incidents)  # metrics and the webhook
        self.lag = LagWatch(config.diagnosis.max_evidence_age_s, metrics)
        self.keyring = Keyring.for_signer(config.keys, "diagnosis")  # actions and commands; a bad key fails here
        self.bootstrap = bootstrap
        self.detectors = list(detectors)  # prototypes: each job's engine gets copies of its own
        self.node_health = node_health
        self.tick_interval_s = tick_interval_s
        self.poll_timeout_ms = poll_timeout_ms
        self.from_beginning = from_beginning
        self.unknown_hold_s = unknown_hold_s
        self.checkpoint_interval_s = checkpoint_interval_s
        self.lookback_s = lookback_s
        self.engine = _FleetView(self)
        self.rep_topic = topics.topic(REPARTITION, config.bus.topic_prefix)
        self.repartitioner: Repartitioner | None = None
        self.states: dict[str, JobState] = {}
        # Jobs of a newly taken partition whose checkpoint is read but not yet decoded: key -> (checkpoint,
        # partition, changelog offset). A job is decoded when its first record arrives, and the rest a few
        # at a time between rounds: a Xid on a moved job waits for that job's state, not its partition's.
        self._undecoded: dict[str, tuple[bytes, int, int]] = {}
        self.partitions: set[int] = set()
        d = config.diagnosis
        self.clocks = PartitionClocks(max_skew_s=config.time.max_clock_skew_s, idle_after_s=d.idle_clock_after_s,
                                      idle_max_s=d.idle_clock_max_s)
        self.stream_time = self.clocks.times  # partition -> stream time
        self._applied: dict[int, int] = {}  # partition -> next offset after the last record applied
        self._marked: dict[int, int] = {}  # partition -> offset of its last checkpoint marker
        self._last_checkpoint = 0.0
        self._last_tick = 0.0
        self.decode_errors = 0
        self.applied = 0  # repartitioned records applied to an engine
        self.skipped = 0  # repartitioned records already applied (a replay after a handover, a forward made twice)
        self.produced = 0
        self.checkpoints = 0
        self.restores: list[dict[str, Any]] = []  # one entry per partition restored (for the benchmark)
        self.restore_failures = 0  # partitions whose changelog could not be read (their jobs started afresh)
        self.unreadable_checkpoints = 0  # job checkpoints and markers that did not read (started afresh)
        self.unverified_changelog = 0  # of those, records without diagnosis's seal (forged, unsigned): dead-lettered
        self._producer: Producer | None = None
        self._rep_consumer: Consumer | None = None
        self._diag_loop: ConsumeLoop | None = None
        self._restorer: BackgroundRestorer | None = None  # reads changelogs off this thread
        self._paused: set[int] = set()  # partitions paused until their restore is installed
        self._factory: EngineFactory | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()
        self._events: queue.Queue[tuple[str, list[int]]] = queue.Queue()
        self._owns_guard_log = False
        self.resend = OutputResend()  # outputs sent again after the broker lost them (diagnosis.online.resend)
        self._acks: list[Any] = []  # this round's send results, for resend's offset watch

    # ------------------------------------------------------------------ engines and state

    def make_engine(self, key: str = "") -> DiagnosisEngine:
        """A job's engine (detectors: copies of the prototypes, so each job has its own baselines)."""
        if self._factory is None:
            self._factory = EngineFactory(lambda: DiagnosisEngine(
                self.config, detectors=[copy.deepcopy(d) for d in self.detectors], node_health=self.node_health,
                batch=False, guard_log=self.guard_log, on_suppressed=self._on_suppressed, wall_clock_dwell=True))
        return self._factory(key)

    def _on_suppressed(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.actions_suppressed.labels(reason=reason).inc()

    def _open_guard_log(self) -> None:
        """The shared guard log, before any engine is made (engines share it as a static part)."""
        if self.guard_log is None:
            g = self.config.guard
            self.guard_log = KafkaGuardLog(g, self.config.bus, self.bootstrap, backup_path=g.state_path)
            self._owns_guard_log = True
            # resets by a person and the other instances' claims, read off the diagnosis thread
            self.guard_log.start_refresher(min(1.0, self.tick_interval_s))
        self._factory = None
        for st in self.states.values():
            st.engine.guard_log = self.guard_log

    def _state(self, key: str, partition: int) -> JobState:
        st = self.states.get(key)
        if st is None and key in self._undecoded:
            st = self._decode(key)
        if st is None:
            st = self.states[key] = JobState(key, partition, self.make_engine(key))
        return st

    def _decode(self, key: str) -> JobState | None:
        """The job's checkpoint from the changelog into a JobState; None (counted) when it does not read."""
        value, p, offset = self._undecoded.pop(key)
        try:
            st = restore(value, p, self.make_engine, key)
        except CheckpointError as exc:
            self._unreadable("checkpoint", key, p, offset, str(exc))
            return None
        except Exception as exc:  # noqa: BLE001 - one bad checkpoint costs that job's memory, not the service
            self._unreadable("checkpoint", key, p, offset, repr(exc))
            return None
        self.states[key] = st
        self.resend.restored(st.engine.book.open_incidents())  # resent too if the broker loses them later
        return st

    def _decode_some(self, budget_s: float | None) -> None:
        """Decode waiting checkpoints for at most ``budget_s`` (None: all), so that jobs without records
        (a silent job is a fault too) tick within a few rounds of their partition's move."""
        deadline = None if budget_s is None else time.monotonic() + budget_s
        while self._undecoded and (deadline is None or time.monotonic() < deadline):
            self._decode(next(iter(self._undecoded)))

    def _rebalanced(self) -> None:
        """Apply the group's queued rebalance events (revocations first, as they came), then install
        the partitions whose changelog the background restorer has read."""
        while True:
            try:
                what, parts = self._events.get_nowait()
            except queue.Empty:
                break
            if what in ("revoke", "release"):
                self._on_revoked(parts, checkpoint=what == "release")
            else:
                self._on_assigned(parts)
        if self._restorer is not None:
            for p, result, asked in self._restorer.done():
                self._install(p, result, asked)

    def _on_revoked(self, partitions: list[int], *, checkpoint: bool = False) -> None:
        """Let partitions go; ``checkpoint``: they are still this instance's until it says so
        (membership "members"), so their jobs are checkpointed first and the next owner replays less."""
        if self._restorer is not None:
            for p in partitions:
                self._restorer.cancel(p)
        self._paused.difference_update(partitions)  # a new assignment starts unpaused
        gone = set(partitions) & self.partitions
        if not gone:
            return
        # Nothing else to write: every round ends checkpointed or with its changes still
        # unsent, and the next owner replays those from the partition's marker.
        if checkpoint and self._producer is not None:
            self._checkpoint(self._producer, gone)
        for key in [k for k, st in self.states.items() if st.partition in gone]:
            del self.states[key]
        for key in [k for k, (_, p, _) in self._undecoded.items() if p in gone]:
            del self._undecoded[key]  # still the newest checkpoint of its job on the changelog
        for p in gone:
            self.clocks.forget(p)
            self._applied.pop(p, None)
            self._marked.pop(p, None)
        self.partitions -= gone
        if self._diag_loop is not None:
            name = topics.topic(REPARTITION, self.config.bus.topic_prefix)
            self._diag_loop.forget([(name, p) for p in gone])
        log.info("diagnosis: gave up partitions %s", sorted(gone))

    def _on_assigned(self, partitions: list[int]) -> None:
        """New partitions: their changelog is read in the background (diagnosis.restorer); the jobs this
        instance already has keep running meanwhile, and these partitions' records wait (_refetch)."""
        if self._restorer is None:
            self._restorer = BackgroundRestorer(lambda: ChangelogReader(self.config, self.bootstrap, self.keyring))
        for p in sorted(set(partitions) - self.partitions):
            self._restorer.submit(p)

    def _install(self, p: int, result: Restored | BusError, started: float) -> None:
        """A partition's jobs from what its changelog held; from then on its records apply."""
        if isinstance(result, BusError):
            # A changelog the broker cannot hand over (a memory-only broker restarted and lost it,
            # or it times out): the partition's jobs start afresh rather than the service stopping.
            # Their open incidents are forgotten; action ids are deterministic and the runner's
            # ledger executes an id once, so a re-decided action is not run twice.
            log.error("diagnosis: changelog partition %d unreadable (%s): its jobs start afresh", p, result)
            self.restore_failures += 1
            result = Restored({}, None, 0, time.monotonic() - started)
        restored = result
        installing = time.monotonic()
        keys = 0
        for offset, why in restored.bad_marks:
            self._unreadable("marker", MARK_KEY, p, offset, why)
        for key, offset, why, head in restored.unverified:  # forged or unsigned: never obeyed
            self._unreadable("marker" if key == MARK_KEY else "checkpoint", key, p, offset, why, head,
                             reason="unverified")
        for key, value in restored.values.items():
            if key in self._undecoded:  # the same job key on two partitions (a repartitioned topic): as before,
                self._decode(key)  # the last partition installed wins, each checkpoint read once
            self.states.pop(key, None)
            self._undecoded[key] = (value, p, restored.offsets.get(key, -1))
            keys += 1
        mark = restored.mark or {}
        start = int(mark.get("next_offset", 0))
        self.clocks.restore(p, float(mark.get("stream_time", 0.0)))
        self._applied[p] = self._marked[p] = start
        # No seek: the committed offset never passes the marker (hold_back), so the group
        # resumes at or before it, and what the checkpoints already hold is skipped.
        self.partitions.add(p)
        self._resume(p)
        self.restores.append({"partition": p, "keys": keys, "records_read": restored.records_read,
                              "seconds": round(time.monotonic() - started, 3), "from_offset": start,
                              "wall": time.time()})
        log.info("diagnosis: took partition %d: %d job(s) to restore from %d changelog record(s) in %.2f s (read "
                 "%.2f s, installed %.2f s; each job decoded at its first record), replaying from offset %d",
                 p, keys, restored.records_read, time.monotonic() - started, restored.seconds,
                 time.monotonic() - installing, start)
        self.ready.set()

    def _resume(self, p: int) -> None:
        """Fetch a partition whose state is in: a MemberConsumer starts fetching it only now; a group
        consumer resumes it if _refetch paused it while its state was being read."""
        if isinstance(self._rep_consumer, MemberConsumer):
            self._rep_consumer.ready(topic_partitions(self.rep_topic, [p]))
            return
        if p not in self._paused or self._rep_consumer is None:
            return
        self._paused.discard(p)
        try:
            self._rep_consumer.raw.resume(*topic_partitions(self.rep_topic, [p]))
        except Exception as exc:  # noqa: BLE001 - revoked meanwhile: its next owner reads it
            log.debug("diagnosis: cannot resume partition %d: %r", p, exc)

    def _unreadable(self, what: str, key: str, partition: int, offset: int, why: str, payload: bytes = b"",
                    *, reason: str = "unreadable") -> None:
        """A checkpoint or marker that did not read or verify: counted, logged with where it is and
        dead-lettered; the job starts afresh (or from an older checkpoint that verifies)."""
        self.unreadable_checkpoints += 1
        if reason == "unverified":
            self.unverified_changelog += 1
        topic = topics.topic("diag-changelog", self.config.bus.topic_prefix)
        log.error("diagnosis: %s of %s at %s[%d]@%d is %s (%s): %s", what, key, topic, partition, offset, reason,
                  why[:300], "that job starts afresh" if what == "checkpoint" else "the last marker that reads stands")
        if self.metrics is not None:
            self.metrics.checkpoints_unreadable.labels(what=what).inc()
            self.metrics.dead_letters.labels(topic=topic, reason=reason).inc()
        if self._producer is not None:
            letter = DeadLetter(ts=time.time(), topic=topic, partition=partition, offset=offset, reason=reason,
                                detail=f"{what}: {why}"[:2000], key=key,
                                payload=payload.decode("utf-8", "backslashreplace"), size=len(payload))
            try:
                self._producer.send(letter)
            except BusError as exc:
                log.error("diagnosis: dead-lettering %s[%d]@%d failed: %s", topic, partition, offset, exc)

    # ------------------------------------------------------------------ records

    def _apply(self, batch: Sequence[Message]) -> None:
        """ConsumeLoop handler for the repartition topic: apply, then checkpoint and send."""
        self._rebalanced()
        unowned: dict[int, int] = {}
        for m in batch:
            p = m.partition
            if p not in self.partitions:
                unowned[p] = min(unowned.get(p, m.offset), m.offset)
                continue
            if m.offset < self._marked.get(p, 0):
                self.skipped += 1
                continue  # already in a finished checkpoint round
            key = m.key or "unknown"
            if key.startswith(UNJOBBED_PREFIX):
                key = f"~nodes/{p}"
            st = self._state(key, p)
            if m.offset < st.next_offset:
                self.skipped += 1
                continue  # this job's checkpoint already holds it (a round that did not finish its marker)
            st.next_offset = m.offset + 1
            st.dirty = True
            self._applied[p] = max(self._applied.get(p, 0), m.offset + 1)
            kind, source_key, source_offset, ctype = forwarded_headers(m)
            if source_offset >= 0 and st.seen(kind, source_key, source_offset):
                self.skipped += 1
                continue  # forwarded twice by a repartitioner that crashed before its commit
            if kind == "jobs":
                if st.topology == m.value:
                    self.skipped += 1
                    continue
                st.topology = m.value
            try:
                # a columnar GPU sample stays columnar (faultlens.decode.GpuColumns): the engine builds its
                # GpuStates only when its counters changed
                record = wire.decode(kind, m.value, content_type=ctype, columnar=True)
            except (SchemaError, ValueError) as exc:
                self.decode_errors += 1
                if self._diag_loop is not None:
                    self._diag_loop.dead_letter(m, getattr(exc, "reason", "undecodable"), str(exc))
                continue
            ts = getattr(record, "ts", None) if kind != "action-status" else None  # the runner's wall clock
            self.clocks.heard(p, ts)
            self.applied += 1
            if kind == "action-status":
                self.resend.status(record)
            st.outbox.extend(st.engine.observe(record))
        if unowned:
            self._refetch(unowned)
        self._tick()
        self._flush()

    def _refetch(self, first: dict[int, int]) -> None:
        """Records of a partition this instance is assigned but has not restored yet (its rebalance
        event came after the fetch): seek back so they come again once the state is in."""
        if self._rep_consumer is None:
            return
        name = topics.topic(REPARTITION, self.config.bus.topic_prefix)
        assigned = {tp.partition for tp in self._rep_consumer.raw.assignment()}
        for p, off in first.items():
            if p in assigned:
                self._rep_consumer.raw.seek(topic_partitions(name, [p])[0], off)
                if self._restorer is not None and p in self._restorer.pending and p not in self._paused:
                    self._rep_consumer.raw.pause(*topic_partitions(name, [p]))  # fetched again once restored
                    self._paused.add(p)

    def _tick(self, *, force: bool = False) -> None:
        if self._undecoded and not force:
            self._decode_some(0.02)  # a moved partition's other jobs, between rounds
        now = time.monotonic()
        if not force and now - self._last_tick < self.tick_interval_s:
            return
        self._last_tick = now
        if self.guard_log is not None:
            self.guard_log.refresh()  # resets by a person, claims of the other instances
            if self.metrics is not None:
                book = self.guard_log.book
                self.metrics.guard_breakers_open.labels(scope="fleet").set(int(book.fleet_breaker is not None))
                self.metrics.guard_breakers_open.labels(scope="job").set(len(book.job_breakers))
        self.lag.observe([t for p, t in self.stream_time.items() if t and p in self.partitions])
        for st in self.states.values():
            # Event time only (NVML samples keep it moving), so replayed data is judged on its own clock.
            out = st.engine.tick(self.clocks.now(st.partition, now))
            if out:
                st.outbox.extend(out)
                st.dirty = True

    def _flush(self, *, force: bool = False) -> None:
        """Checkpoint what changed (with its outbox and a marker per partition), then send the outbox.

        A partition is checkpointed every ``checkpoint_interval_s``, and at once when one of its jobs
        has outputs to send (an output never leaves before the state that decided it)."""
        producer = self._producer
        if producer is None:
            return
        pending = [st for st in self.states.values() if st.outbox]
        if force or time.monotonic() - self._last_checkpoint >= self.checkpoint_interval_s:
            due = set(self.partitions)
            self._last_checkpoint = time.monotonic()
        else:
            due = {st.partition for st in pending}
        if due:
            self._checkpoint(producer, due)
        for st in pending:
            for out in st.outbox:
                self._acks.append(producer.send(out))
                self.resend.sent(out)
                self.produced += 1
                self.alerts.observe(out)
        if pending:
            producer.flush(30.0)
        for st in pending:
            st.outbox = []
            st.dirty = True  # the emptied outbox is checkpointed next round
        acks, self._acks = self._acks, []
        resend_if_lost(self.resend, producer, acks, self.states, self._rep_consumer)

    def _sealed(self, partition: int, key: str, value: bytes) -> bytes:
        """A changelog record signed with diagnosis's key for its place, when [keys] are configured:
        a new owner obeys only what diagnosis wrote (diagnosis.online.state.ChangelogReader)."""
        return seal(self.keyring, value, changelog_context(partition, key)) if self.keyring else value

    def _checkpoint(self, producer: Producer, partitions: set[int]) -> None:
        """Every changed job of ``partitions``, then each partition's marker, flushed."""
        dirty = [st for st in self.states.values() if st.dirty and st.partition in partitions]
        moved = {p for p in partitions if self._applied.get(p, 0) > self._marked.get(p, 0)}
        if not dirty and not moved:
            return
        marked = {st.partition for st in dirty} | moved
        try:
            for st in dirty:
                self._acks.append(producer.send_raw("diag-changelog", st.key, self._sealed(
                    st.partition, st.key, snapshot(st)), partition=st.partition))
            for p in marked:
                mark = mark_value(self._applied.get(p, 0), self.stream_time.get(p, 0.0))
                self._acks.append(producer.send_raw("diag-changelog", MARK_KEY, self._sealed(p, MARK_KEY, mark),
                                                    partition=p))
            producer.flush(30.0)
        except BusError as exc:
            # The changelog is not there to write (a memory-only broker restarted without it): the
            # markers stay where they were, so committed offsets hold back and nothing is skipped;
            # the topics are made again and the next round checkpoints.
            log.warning("diagnosis: checkpoint not written (%s); retrying next round", exc)
            self.resend.suspect()  # its outputs went with it: resent next round (diagnosis.online.resend)
            try:
                ensure_topics(self.config.bus, self.bootstrap)
            except BusError as again:
                log.warning("diagnosis: cannot make the topics again: %s", again)
            return
        self.resend.checkpointed()
        for st in dirty:
            st.dirty = False
        for p in marked:
            self._marked[p] = max(self._marked.get(p, 0), self._applied.get(p, 0))
        self.checkpoints += 1

    def _hold_back(self) -> dict[tuple[str, int], int]:
        name = topics.topic(REPARTITION, self.config.bus.topic_prefix)
        caps = {(name, p): self._marked.get(p, 0) for p in self.partitions}
        if self._rep_consumer is not None:
            for tp in self._rep_consumer.raw.assignment():
                if tp.topic == name:
                    caps.setdefault((tp.topic, tp.partition), -1)  # assigned, not restored yet
        return caps

    # ------------------------------------------------------------------ outputs

    def open_incidents(self) -> list[Any]:
        self._decode_some(None)
        return [i for st in self.states.values() for i in st.engine.book.open_incidents()]

    # ------------------------------------------------------------------ the loop

    def serve(self, *, max_seconds: float | None = None) -> None:
        bus = self.config.bus
        gid = self.config.diagnosis.group_id
        ensure_topics(bus, self.bootstrap)
        self._open_guard_log()
        self.make_engine()  # the engine prototype (catalogs, classifier imports) before any record waits on it
        # Every round ends in a flush, so lingering only batches sends within a round.
        producer = self._producer = make_producer(bus, self.bootstrap, backend=self.config.diagnosis.producer,
                                                  keyring=self.keyring, linger_ms=20)
        # A new group reads the input from the start and skips what is older than a short lookback:
        # "latest" would lose what arrives while the group is still joining (seconds on Tansu).
        not_before = 0 if self.from_beginning else int((time.time() - self.lookback_s) * 1000)
        self.repartitioner = Repartitioner(producer, unknown_hold_s=self.unknown_hold_s, not_before_ms=not_before)
        jobs_reader = consumer = None
        try:
            jobs_reader = Consumer(bus, ["jobs"], group_id=None, bootstrap=self.bootstrap, from_beginning=True)
            consumer = self._rep_consumer = self._consumer(gid)
            repartitioner = self.repartitioner

            def handle(batch: Sequence[Message]) -> None:
                inputs = [m for m in batch if m.kind != REPARTITION]
                if inputs:
                    repartitioner.handle(inputs)
                rep = [m for m in batch if m.kind == REPARTITION]
                if rep or not inputs:
                    self._apply(rep)

            loop = self._diag_loop = ConsumeLoop(consumer, handle, producer=producer, name="diagnosis",
                                                 hold_back=lambda: {**repartitioner.hold_back(), **self._hold_back()},
                                                 metrics=self.metrics)
            repartitioner.dead_letter = loop.dead_letter  # a job topology that does not decode
            self.alerts.start(self._stop)
            started = time.monotonic()
            while not self._stop.is_set():
                self._rebalanced()
                topologies = jobs_reader.poll(0)
                for m in topologies:
                    repartitioner.on_topology(m)
                if repartitioner.release() or topologies:
                    producer.flush(30.0)
                if not loop.step(timeout_ms=0 if topologies or repartitioner.held else self.poll_timeout_ms):
                    repartitioner.try_settle()  # idle: the last round's forwards, so their offsets commit
                    self._tick()
                    self._flush()
                if max_seconds is not None and time.monotonic() - started > max_seconds:
                    break
            self._tick(force=True)
            self._flush(force=True)
            repartitioner.try_settle()
            loop.commit()
        finally:
            close_quietly(consumer, jobs_reader, self._restorer)
            self._restorer = None
            if self._owns_guard_log and isinstance(self.guard_log, KafkaGuardLog):
                self.guard_log.close()
                self.guard_log, self._owns_guard_log = None, False
            producer.close()

    def _consumer(self, gid: str) -> Any:
        """One consumer for both stages: the input topics (repartitioned) and the repartition topic
        (diagnosed): two groups per process made the embedded broker's joins slow. Its partitions are decided
        by the members topic (membership.py: no group join) or by the consumer group: kafka-python (eager
        rebalances) or confluent-kafka (cooperative-sticky, stream/bus/librdkafka_consumer.py)."""
        d, bus = self.config.diagnosis, self.config.bus
        kinds = [*(k for k in INPUT_KINDS if k != "jobs"), REPARTITION]
        # The changelog reader is opened now, not at the first assignment (a client's start-up is slow).
        self._restorer = self._restorer or BackgroundRestorer(lambda: ChangelogReader(self.config, self.bootstrap, self.keyring),
                                                              eager=True)
        if membership_mode(d.membership, self.bootstrap or bus.bootstrap_servers) == "members":
            return MemberConsumer(bus, kinds, group_id=gid, bootstrap=self.bootstrap, listener=QueuedRebalance(self._events, self.rep_topic),
                                  member_id=d.instance_id or default_member_id(), restore_kinds=[REPARTITION],
                                  heartbeat_s=d.member_heartbeat_s, keyring=self.keyring,
                                  timeout_s=d.member_timeout_s, fetch_max_wait_ms=self.poll_timeout_ms,
                                  backend=consumer_backend(d.consumer, bus, self.bootstrap))
        return group_consumer(bus, kinds, backend=d.consumer, group_id=gid, bootstrap=self.bootstrap,
                              listener=QueuedRebalance(self._events, self.rep_topic), instance_id=d.instance_id,
                              fetch_max_wait_ms=self.poll_timeout_ms)  # a Xid must not wait out Kafka's 500 ms

    def start(self) -> DiagnosisService:
        self._thread = threading.Thread(target=self.serve, name="faultlens-diagnosis", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
