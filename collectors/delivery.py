"""Delivery that survives broker outages: the producer, with the on-disk spool (collectors/spool.py) behind it.

``Delivery`` owns the producer: records go straight to Kafka while it answers;
once a send fails (kafka error, failed future, flush timeout) the producer is
closed (aborting what it still held, so nothing is delivered twice by its
retries), every record from the first undelivered one on goes to the spool, and
new records follow them there so order is kept. A fresh producer is tried with
backoff; on success the spool is drained, oldest first, before new records go
direct again. Delivery is at-least-once: records of a batch that Kafka took
before a later record of the same batch failed are spooled too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from faultlens.collectors.spool import Entry, Spool
from faultlens.decode import CONTENT_TYPE_HEADER, content_type_of
from faultlens.errors import BusError
from faultlens.stream.dedupe import SEQ_HEADER

log = logging.getLogger(__name__)


class Delivery:
    """Producer plus spool: ``put`` never blocks on the network; ``pump`` moves data.

    ``producer_factory()`` returns a ``stream.bus.Producer`` (or raises BusError);
    ``pump()`` is called periodically by the agent's loop.
    """

    def __init__(self, producer_factory: Callable[[], Any], spool: Spool, *, flush_timeout_s: float = 5.0,
                 batch_records: int = 5000, retry_min_s: float = 0.5, retry_max_s: float = 10.0,
                 on_sent: Callable[[str, int], None] | None = None, connect_wait_s: float = 0.5,
                 min_send_interval_s: float = 0.0, source: str | None = None, retained: Spool | None = None,
                 retain_s: float = 600.0, on_lost: Callable[[], None] | None = None,
                 fault_send_interval_s: float = 0.0):
        self.factory = producer_factory
        # Nothing lost when the broker dies (issue 24.9). With ``source`` (the node) every
        # record gets a natural key, (node, epoch, per-kind seq), sent in the SEQ_HEADER
        # header; the stream processor drops a record whose key it already committed. Each
        # record sent is also kept in ``retained`` (an on-disk Spool) for ``retain_s``; when
        # a produce answer shows a partition's offsets went back (the broker lost its log:
        # a memory-only broker restarted, an unclean leader election), everything retained
        # is sent again, and the lake keeps each record once.
        self.source = source
        self.epoch = time.time_ns() // 1000  # this process's records: seqs restart at 1 per epoch
        self._seq: dict[str, int] = {}
        self._epochs: dict[str, int] = {}  # kinds resumed from a checkpoint keep their epoch (restore_seq_state)
        self.retained = retained
        self.retain_s = retain_s
        self._high: dict[tuple[str, int], int] = {}  # (topic, partition) -> highest offset acknowledged
        # kind -> the broker's topic id when records were last acknowledged: a new id is a topic
        # created again (a memory-only broker restarted), whatever the offsets say (partitions are
        # shared: other agents' records can carry a new log's offsets past this one's old ones).
        self.topic_ids: dict[str, str] = {}
        self.on_lost = on_lost  # called when the broker lost records (the agent republishes job topologies)
        self.resends = 0  # broker losses seen (each resent the retained records)
        self.resent_records = 0
        # Each produce request costs kafka-python ~1.5 ms of CPU whatever it carries, the
        # largest part of an agent's budget. So at most one request per interval while
        # records keep coming, except that an urgent record (a fault line) goes at once
        # when no urgent record went within the interval: the first line of a fault is
        # never held behind the GPU samples, and a burst of them shares requests.
        self.min_send_interval_s = min_send_interval_s
        self._last_send = self._last_urgent = self._last_immediate = float("-inf")
        # A recognised fault line (``immediate``) goes at once when none went within this
        # interval; in a storm of them, one request per interval carries them all.
        self.fault_send_interval_s = fault_send_interval_s
        self._urgent_queued = self._immediate_queued = False
        self.spool = spool
        self.flush_timeout_s = flush_timeout_s
        self.batch_records = batch_records
        self.retry_min_s = retry_min_s
        self.retry_max_s = retry_max_s
        self.on_sent = on_sent
        self._queue: list[Entry] = []
        self._qlock = threading.Lock()
        self._producer: Any = None
        self._connector: threading.Thread | None = None
        self._connected: Any = None
        self.connect_wait_s = connect_wait_s
        self._down_since: float | None = None
        self._next_try = 0.0
        self._backoff = retry_min_s
        self.sent = 0
        self.requests = 0  # sends (each one produce request or a few: kafka-python's CPU goes by these)
        self.failures = 0
        self.last_error: str | None = None

    @property
    def connected(self) -> bool:
        return self._producer is not None and self._down_since is None

    def put(self, kind: str, key: str | None, value: bytes, *, urgent: bool = False, immediate: bool = False) -> None:
        self.put_many([(kind, key, value)], urgent=urgent, immediate=immediate)

    def put_many(self, entries: list[Entry], *, urgent: bool = False, immediate: bool = False) -> None:
        """Queue several (kind, key, value) entries at once. ``immediate``: a recognised fault
        line; it goes at the next pump unless another went within ``fault_send_interval_s``."""
        with self._qlock:
            if self.source is not None:
                seq, epochs = self._seq, self._epochs
                stamped: list[Entry] = []
                for e in entries:
                    n = seq[e[0]] = seq.get(e[0], 0) + 1
                    stamped.append((e[0], e[1], e[2], (epochs.get(e[0], self.epoch), n)))
                entries = stamped
            self._queue.extend(entries)
            self._urgent_queued = self._urgent_queued or urgent
            self._immediate_queued = self._immediate_queued or immediate

    def next_due_s(self) -> float | None:
        """Seconds until ``pump`` would send what is queued (None: nothing queued); the agent's
        loop sleeps no longer than this."""
        with self._qlock:
            if not self._queue:
                return None
            now = time.monotonic()
            due = self._last_send + self.min_send_interval_s
            if self._urgent_queued:
                due = min(due, self._last_urgent + self.min_send_interval_s)
            if self._immediate_queued:
                due = min(due, self._last_immediate + self.fault_send_interval_s)
            return max(0.0, due - now)

    def pending(self) -> int:
        with self._qlock:
            return len(self._queue)

    def pump(self, *, force: bool = False) -> None:
        """Deliver what is queued (spool first); on failure, spool it. Never raises.

        Within ``min_send_interval_s`` of the last send, queued records wait for a later
        pump, unless one is urgent and no urgent record went within that interval, or
        ``force`` (shutdown), or the spool needs replaying.
        """
        now = time.monotonic()
        due = (
            force
            or (self._immediate_queued and now - self._last_immediate >= self.fault_send_interval_s)
            or now - self._last_send >= self.min_send_interval_s
            or (self._urgent_queued and now - self._last_urgent >= self.min_send_interval_s)
        )
        if not due and self._down_since is None and self.spool.empty():
            return
        with self._qlock:
            batch, self._queue = self._queue, []
            if batch and self._urgent_queued:
                self._last_urgent = now
            if batch and self._immediate_queued:
                self._last_immediate = now
            self._urgent_queued = self._immediate_queued = False
        if self._down_since is not None or not self.spool.empty():
            self.spool.append(batch)
            batch = []
            if now < self._next_try:
                return
            if not self._ensure_producer():
                return
            while not self.spool.empty():
                entries, cursor = self.spool.peek(self.batch_records)
                if not entries:
                    break
                done = self._send(entries)
                if done < len(entries):
                    self._failed()
                    return
                self.spool.commit(cursor, len(entries))
            log.info("bus reachable again: spool replayed (%d records so far)", self.spool.replayed_records)
            self._down_since = None
            self._backoff = self.retry_min_s
            return
        if not batch:
            return
        if not self._ensure_producer():
            self.spool.append(batch)
            return
        for i in range(0, len(batch), self.batch_records):
            part = batch[i:i + self.batch_records]
            done = self._send(part)
            if done < len(part):
                self.spool.append(part[done:] + batch[i + self.batch_records:])
                self._failed()
                return

    def _ensure_producer(self) -> bool:
        """True when a producer is ready; otherwise start connecting in the background.

        Connecting (bootstrap, topic check) can take seconds against a dead broker;
        the agent's loop must go on reading logs meanwhile, so it never waits here.
        """
        if self._producer is not None:
            return True
        if self._connector is None:
            self._connected = None
            self._connector = threading.Thread(target=self._connect, name="faultlens-connect", daemon=True)
            self._connector.start()
            self._connector.join(self.connect_wait_s)
        if self._connector.is_alive():
            return False
        self._connector = None
        got, self._connected = self._connected, None
        if isinstance(got, Exception):
            self._note_error(str(got))
            self._failed()
            return False
        self._producer = got
        return got is not None

    def _connect(self) -> None:
        try:
            self._connected = self.factory()
        except Exception as exc:  # noqa: BLE001 - BusError or whatever kafka raised while bootstrapping
            self._connected = exc

    def _send(self, entries: list[Entry]) -> int:
        """Send and flush; how many leading entries are known delivered."""
        self._last_send = time.monotonic()
        self.requests += 1
        futures = []
        try:
            for e in entries:
                kind, key, value = e[0], e[1], e[2]
                if len(e) == 4:
                    epoch, seq = e[3]  # type: ignore[misc]
                    headers = [(CONTENT_TYPE_HEADER, content_type_of(value).encode()),
                               (SEQ_HEADER, f"{epoch}:{seq}:{self.source or ''}".encode())]
                    futures.append(self._producer.send_raw(kind, key, value, headers=headers))
                else:
                    futures.append(self._producer.send_raw(kind, key, value))
            self._producer.flush(self.flush_timeout_s)
        except BusError as exc:
            self._note_error(str(exc))
        except Exception as exc:  # noqa: BLE001 - kafka-python raises several families here
            self._note_error(f"{type(exc).__name__}: {exc}")
        done = 0
        acked = []
        for fut in futures:
            if fut.is_done and fut.succeeded():
                done += 1
                acked.append(fut.value)
            else:
                if fut.is_done and fut.exception is not None:
                    self._note_error(str(fut.exception))
                break
        lost = self._offsets_went_back(acked)
        if self.retained is not None and done:
            lost = self._topic_ids_changed({e[0] for e in entries[:done]}) or lost
            if lost:
                self._resend_retained()
            self.retained.append([e for e in entries[:done] if len(e) == 4])
        if self.on_sent is not None and done:
            counts: dict[str, int] = {}
            for e in entries[:done]:
                counts[e[0]] = counts.get(e[0], 0) + 1
            for kind, n in counts.items():
                self.on_sent(kind, n)
        self.sent += done
        return done

    def _offsets_went_back(self, metas: list[Any]) -> bool:
        """True when a partition's lowest offset of this round is not above its highest of an
        earlier round: the broker's log went back. Within one round offsets may come out of
        send order (a batch retried behind a later one), so only rounds are compared: every
        record of a round was sent after the previous round was acknowledged."""
        low: dict[tuple[str, int], int] = {}
        high: dict[tuple[str, int], int] = {}
        for meta in metas:
            offset = getattr(meta, "offset", -1)
            if not isinstance(offset, int) or offset < 0:
                continue
            tp = (meta.topic, meta.partition)
            low[tp] = min(offset, low.get(tp, offset))
            high[tp] = max(offset, high.get(tp, offset))
        went_back = any(tp in self._high and lo <= self._high[tp] for tp, lo in low.items())
        if went_back:
            self._high.clear()  # the new log's offsets are the baseline of every partition
        self._high.update(high)
        return went_back

    def _topic_ids_changed(self, kinds: set[str]) -> bool:
        changed = False
        getter = getattr(self._producer, "topic_id", None)
        if getter is None:
            return False
        for kind in kinds:
            try:
                tid = getter(kind)
            except Exception:  # noqa: BLE001 - a metadata look-up must never stop delivery
                tid = None
            if tid is None:
                continue
            old = self.topic_ids.get(kind)
            if old is not None and old != tid:
                changed = True
            self.topic_ids[kind] = tid
        if changed:
            self._high.clear()
        return changed

    def seq_state(self, kinds: tuple[str, ...]) -> dict[str, list[int]]:
        """``kind -> [epoch, last seq]``: saved with the followers' positions, so that an agent
        restarted there stamps the records of the lines it reads again with the same keys."""
        return {k: [self._epochs.get(k, self.epoch), self._seq[k]] for k in kinds if k in self._seq}

    def restore_seq_state(self, state: dict[str, list[int]]) -> None:
        with self._qlock:
            for kind, (epoch, seq) in state.items():
                self._epochs[kind] = int(epoch)
                self._seq[kind] = int(seq)

    def _resend_retained(self) -> None:
        """The broker lost records it had acknowledged: queue every retained record again (spool
        first, so they go before anything new); the processor drops those the lake already has."""
        assert self.retained is not None
        self.retained.drop_older_than(time.time() - self.retain_s)
        if self.on_lost is not None:
            try:
                self.on_lost()  # queues what must be published again (topologies): it goes first
            except Exception:  # noqa: BLE001 - a republish must never stop delivery
                log.exception("republishing after a broker loss failed")
        with self._qlock:
            fresh, self._queue = self._queue, []
        self.spool.append(fresh)
        n = len(fresh)
        while True:  # in chunks: the window may hold more than is wise to load at once
            chunk, cursor = self.retained.peek(self.batch_records)
            if not chunk:
                break
            self.spool.append(chunk)
            self.retained.commit(cursor, 0)
            n += len(chunk)
        self.resends += 1
        self.resent_records += n
        log.warning("the broker lost records it had acknowledged (its topic ids changed or a partition's offsets "
                    "went back): resending the %d records of the last %.0f s", n, self.retain_s)

    def trim_retained(self) -> None:
        """Forget sent records older than ``retain_s`` (the agent calls this now and then)."""
        if self.retained is not None:
            self.retained.drop_older_than(time.time() - self.retain_s)

    def _note_error(self, msg: str) -> None:
        self.last_error = msg

    def _failed(self) -> None:
        self.failures += 1
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning("bus unreachable (%s): spooling to %s", self.last_error, self.spool.dir)
        if self._producer is not None:
            try:
                self._producer.close(timeout_s=0)
            except Exception:  # noqa: BLE001 - closing a broken producer must not raise
                pass
            self._producer = None
        self._next_try = time.monotonic() + self._backoff
        self._backoff = min(self.retry_max_s, self._backoff * 2)

    def close(self, timeout_s: float = 5.0) -> None:
        """Deliver or spool what is queued, then close the producer and spool."""
        self.pump(force=True)
        with self._qlock:
            rest, self._queue = self._queue, []
        self.spool.append(rest)
        if self._producer is not None:
            try:
                self._producer.close(timeout_s=timeout_s)
            except Exception:  # noqa: BLE001
                pass
            self._producer = None
        self.spool.close()
