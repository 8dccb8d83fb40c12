"""ConsumeLoop: the one consume loop of faultlens services.

poll a batch -> ``handle(batch)`` does the work *and* its effects (produces,
flushes, writes its ledger or checkpoint) -> commit the batch's offsets. A
commit therefore never runs ahead of an effect: a crash replays at most the
batch in hand, and the consumers make that replay harmless (ids on actions,
per-key offsets in the diagnosis checkpoints, the runner's ledger).

Failure handling, by phase:

* the bus fails on poll or commit (``BusError``): logged, counted, retried
  after a back-off; the loop never dies of a broker hiccup;
* the handler fails on effects (``BusError`` from a flush): nothing is
  committed and the partitions are rewound to the batch's first offsets, so the
  batch is delivered again;
* a null value (a tombstone) or an empty one never reaches the handler: no
  service's input is keyed state that a tombstone deletes, so it is a poison
  message, dead-lettered (reason ``tombstone`` / ``empty_message``) and counted;
* the handler fails on data (any other exception): the batch is retried one
  message at a time, and each message that still fails is dead-lettered
  (topic ``deadletter``, with the reason) and skipped: a poison message never
  stops a service;
* shutdown (``stop`` set, or ``max_seconds``): the batch in hand finishes and
  is committed before the consumer closes.

``hold_back()`` lets a handler that keeps records in memory (the repartitioner
holding a node's records until its job is known) cap the committed offsets
below the oldest record it has not passed on yet (a negative cap: commit nothing
there). Only partitions the consumer is assigned now are ever committed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from faultlens import schema
from faultlens.errors import BusError
from faultlens.stream.bus import Consumer, Message, Producer

log = logging.getLogger(__name__)

Handler = Callable[[Sequence[Message]], None]


@dataclass
class LoopStats:
    """What one loop did; services export these as metrics."""

    polled: int = 0
    batches: int = 0
    commits: int = 0
    bus_errors: int = 0
    handler_errors: int = 0
    dead_letters: int = 0
    rewinds: int = 0
    busy_s: float = 0.0  # time spent in the handler: records / busy_s is what one instance can do
    # CPU time of the handler's thread in it: busy_s less the waits (broker acks, other processes on
    # the same cores); what a dedicated core would take
    busy_cpu_s: float = 0.0
    by_reason: dict[str, int] = field(default_factory=dict)


class ConsumeLoop:
    """Batching, commit-after-effect, dead-letter and shutdown around one ``Consumer``."""

    def __init__(self, consumer: Consumer, handle: Handler, *, producer: Producer | None = None,
                 name: str = "consumer", max_records: int = 2000, poll_ms: int = 100,
                 hold_back: Callable[[], dict[tuple[str, int], int]] | None = None,
                 on_idle: Callable[[], None] | None = None, backoff_s: float = 1.0, metrics: Any = None):
        """``metrics``: a faultlens.metrics.ServiceMetrics; dead letters count in its ``dead_letters``."""
        self.consumer = consumer
        self.handle = handle
        self.producer = producer
        self.name = name
        self.max_records = max_records
        self.poll_ms = poll_ms
        self.hold_back = hold_back
        self.on_idle = on_idle
        self.backoff_s = backoff_s
        self.metrics = metrics
        self.stats = LoopStats()
        self._uncommitted: dict[tuple[str, int], int] = {}  # (topic, partition) -> next offset handled
        # What this loop last committed, and when: an offset held back (hold_back: online diagnosis
        # holds its offsets at the last checkpoint marker for seconds) is not committed again every
        # round, a round trip to the group coordinator each time for nothing.
        self._committed: dict[tuple[str, int], int] = {}
        self._committed_at = 0.0
        self.recommit_s = 10.0  # ... but all of them again after this long (a broker that lost them)

    # ------------------------------------------------------------------ one round

    def step(self, timeout_ms: int | None = None) -> int:
        """One poll -> handle -> commit round; returns the number of messages handled."""
        try:
            batch = self.consumer.poll(self.poll_ms if timeout_ms is None else timeout_ms, max_records=self.max_records)
        except BusError as exc:
            self.stats.bus_errors += 1
            log.error("%s: %s; retrying in %.1f s", self.name, exc, self.backoff_s)
            time.sleep(self.backoff_s)
            return 0
        if batch:
            self.stats.polled += len(batch)
            self.stats.batches += 1
            valued = self._without_empty(batch)
            if valued and not self._handle(valued):
                return 0
            for m in batch:
                self._uncommitted[(m.topic, m.partition)] = max(self._uncommitted.get((m.topic, m.partition), 0),
                                                                m.offset + 1)
        elif self.on_idle is not None:
            self.on_idle()
        self.commit()
        return len(batch)

    def _without_empty(self, batch: Sequence[Message]) -> list[Message]:
        """The batch less its null and empty values, each of those dead-lettered."""
        out = []
        for m in batch:
            if m.value:
                out.append(m)
            elif m.value is None:
                self.dead_letter(m, "tombstone", f"a null value (tombstone) on {m.topic}: no record to handle")
            else:
                self.dead_letter(m, "empty_message", f"an empty value on {m.topic}: no record to handle")
        return out

    def _handle(self, batch: Sequence[Message]) -> bool:
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            return self._handle_timed(batch)
        finally:
            self.stats.busy_s += time.perf_counter() - started
            self.stats.busy_cpu_s += time.thread_time() - cpu

    def _handle_timed(self, batch: Sequence[Message]) -> bool:
        try:
            self.handle(batch)
            return True
        except BusError as exc:
            # The effects did not reach the bus: deliver the batch again rather than commit past it.
            self.stats.bus_errors += 1
            log.error("%s: effects failed (%s); rewinding %d message(s)", self.name, exc, len(batch))
            self.rewind(batch)
            time.sleep(self.backoff_s)
            return False
        except Exception as exc:  # noqa: BLE001 - isolate the poison message below
            self.stats.handler_errors += 1
            log.warning("%s: a batch of %d failed (%r); retrying one by one", self.name, len(batch), exc)
        for m in batch:
            try:
                self.handle([m])
            except BusError as exc:
                self.stats.bus_errors += 1
                log.error("%s: effects failed (%s); rewinding", self.name, exc)
                self.rewind([x for x in batch if x.offset >= m.offset or (x.topic, x.partition) != (m.topic, m.partition)])
                return False
            except Exception as exc:  # noqa: BLE001 - one bad message must not stop the service
                log.exception("%s: %s[%d]@%d failed", self.name, m.topic, m.partition, m.offset)
                self.dead_letter(m, "handler_error", repr(exc))
        return True

    def rewind(self, batch: Sequence[Message]) -> None:
        """Seek each partition of ``batch`` back to its first offset there."""
        from kafka import TopicPartition

        first: dict[tuple[str, int], int] = {}
        for m in batch:
            key = (m.topic, m.partition)
            first[key] = min(first.get(key, m.offset), m.offset)
        self.stats.rewinds += 1
        for (t, p), off in first.items():
            try:
                self.consumer.raw.seek(TopicPartition(t, p), off)
            except Exception as exc:  # noqa: BLE001 - a revoked partition: its next owner reads it
                log.warning("%s: cannot rewind %s[%d]: %r", self.name, t, p, exc)

    def dead_letter(self, m: Message, reason: str, detail: str) -> None:
        """Keep a message that cannot be handled, with why, on the deadletter topic."""
        log.warning("%s: %s[%d]@%d dead-lettered: %s: %s", self.name, m.topic, m.partition, m.offset, reason,
                    detail[:200])
        self.stats.dead_letters += 1
        self.stats.by_reason[reason] = self.stats.by_reason.get(reason, 0) + 1
        if self.metrics is not None:
            self.metrics.dead_letters.labels(topic=m.topic, reason=reason).inc()
        if self.producer is None:
            return
        letter = schema.DeadLetter(ts=time.time(), topic=m.topic, partition=m.partition, offset=m.offset,
                                   reason=reason, detail=detail[:2000], key=m.key,
                                   payload=m.value[:schema.MAX_MESSAGE_BYTES].decode("utf-8", "backslashreplace")
                                   if m.value else "", size=len(m.value or b""))
        try:
            self.producer.send(letter)
        except BusError as exc:
            log.error("%s: dead-lettering %s[%d]@%d failed: %s", self.name, m.topic, m.partition, m.offset, exc)

    def commit(self) -> None:
        """Commit what was handled, capped by ``hold_back`` (records still held in memory)."""
        if not self._uncommitted:
            return
        try:
            owned = {(tp.topic, tp.partition) for tp in self.consumer.raw.assignment()}
        except Exception:  # noqa: BLE001 - no assignment known: commit nothing this round
            owned = set()
        # Never commit a partition a rebalance took away: its new owner's position must stand.
        offsets = {k: v for k, v in self._uncommitted.items() if k in owned}
        for k in set(self._uncommitted) - owned:
            del self._uncommitted[k]
        if self.hold_back is not None:
            for key, cap in self.hold_back().items():
                if key in offsets:
                    if cap < 0:  # the handler does not hold this partition yet: not ours to commit
                        del offsets[key]
                    else:
                        offsets[key] = min(offsets[key], cap)
        if time.monotonic() - self._committed_at < self.recommit_s:
            for key in [k for k, off in offsets.items() if self._committed.get(k) == off]:
                del offsets[key]  # committed already; _uncommitted keeps it until it moves
        if not offsets:
            return
        if self.producer is not None and self.stats.dead_letters:
            try:
                self.producer.flush(10.0)  # dead letters are effects too
            except BusError as exc:
                log.error("%s: %s", self.name, exc)
                return
        try:
            self.consumer.commit(offsets)
            self.stats.commits += 1
            if time.monotonic() - self._committed_at >= self.recommit_s:
                self._committed_at = time.monotonic()
            self._committed.update(offsets)
            for key, off in offsets.items():
                if self._uncommitted.get(key) == off:
                    del self._uncommitted[key]
        except BusError as exc:  # a rebalance took the partition: its next owner replays, harmlessly
            self.stats.bus_errors += 1
            log.warning("%s: %s", self.name, exc)
            self._uncommitted.clear()

    def forget(self, partitions: Sequence[tuple[str, int]]) -> None:
        """Partitions revoked by a rebalance: their offsets are no longer ours to commit."""
        for key in partitions:
            self._uncommitted.pop(key, None)
            self._committed.pop(key, None)

    # ------------------------------------------------------------------ the loop

    def run(self, stop: threading.Event | None = None, *, max_seconds: float | None = None) -> int:
        """Rounds until ``stop`` is set or ``max_seconds`` pass; commits, then closes the consumer."""
        stop = stop or threading.Event()
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        handled = 0
        try:
            while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
                handled += self.step()
        finally:
            self.commit()
            self.consumer.close()
        return handled


def close_quietly(*things: Any) -> None:
    """Close clients on shutdown; one failing close does not keep the others open."""
    for t in things:
        if t is None:
            continue
        try:
            t.close()
        except Exception:  # noqa: BLE001 - shutting down anyway
            log.debug("close failed", exc_info=True)
