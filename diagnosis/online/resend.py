"""Diagnosis outputs survive a broker that lost them, as agents' inputs do (collectors/delivery.py).

The service keeps what it sent (incidents, actions, commands, action status) while it is still
relevant: everything for ``retain_s``, then open incidents and actions no action-status has settled.
It notices a loss as an agent or the lake's reader does: the service's own consumer found its input
or repartition offsets went back (``Consumer.resets``: a memory-only broker restarted and its topics
were made again), the changelog could not be written, a partition's acknowledged offsets went back
between flushes (the kafka-python producer: librdkafka reports only failed deliveries), or an output
topic's id changed.
Then every kept output is sent again under its own id: the runner's ledger executes an action id
once and an incident is keyed by its id, so a resend is harmless and the lake ends with them all.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from faultlens.errors import BusError

log = logging.getLogger(__name__)

OUTPUT_KINDS = ("incidents", "actions", "commands", "action-status")
SETTLED = frozenset({"done", "failed", "dry_run", "refused"})  # "pending": the runner retries it


def output_key(record: Any) -> tuple[str, str] | None:
    kind = getattr(type(record), "KIND", "")
    rid = getattr(record, "id", None) or getattr(record, "action_id", None)
    if kind not in OUTPUT_KINDS or not rid:
        return None
    if kind == "action-status":
        return kind, f"{rid}/{getattr(record, 'status', '')}"
    return kind, str(rid)


class OutputResend:
    """What diagnosis sent and may have to send again; a watch on the broker's offsets and topic ids."""

    def __init__(self, *, retain_s: float = 600.0, max_kept: int = 20_000):
        self.retain_s = retain_s
        self.max_kept = max_kept
        self.kept: dict[tuple[str, str], tuple[Any, float]] = {}  # key -> (newest record, monotonic time sent)
        self.settled: set[str] = set()  # action ids an action-status settled
        self._high: dict[tuple[str, int], int] = {}
        self._topic_ids: dict[str, str] = {}
        self._resets = 0  # the consumer's count of partitions whose log went back, as last seen
        self.pending = False  # a resend that has not gone out yet (its flush failed): tried again next round
        self._suspected = False  # a checkpoint failed since the last that was written (suspect() arms once)
        self.losses = 0  # broker losses noticed
        self.resent = 0  # outputs sent again

    def sent(self, record: Any) -> None:
        key = output_key(record)
        if key is not None:
            self.kept.pop(key, None)  # re-inserted: the dict stays in send order (oldest first)
            self.kept[key] = (record, time.monotonic())

    def restored(self, open_incidents: Iterable[Any]) -> None:
        """A job's state read back from the changelog: its open incidents as the previous owner sent them."""
        for inc in open_incidents:
            self.sent(inc.record())

    def status(self, record: Any) -> None:
        """An action-status read from the runner: a settled action need not outlive the window."""
        if getattr(record, "status", "") in SETTLED:
            self.settled.add(str(record.action_id))

    def suspect(self) -> None:
        """The changelog could not be written (a memory-only broker restarted without it): the outputs
        went with it, so they are resent once, not at every round that fails the same way."""
        if not self._suspected:
            self._suspected = self.pending = True

    def checkpointed(self) -> None:
        self._suspected = False

    def lost(self, producer: Any, futures: Iterable[Any] = (), *, input_resets: int = 0) -> bool:
        """After a flush: True when the broker lost what it had acknowledged (the consumer's offsets or
        the producer's went back, or an output topic's id changed)."""
        reset, self._resets = input_resets > self._resets, max(self._resets, input_resets)
        low: dict[tuple[str, int], int] = {}
        high: dict[tuple[str, int], int] = {}
        for topic, partition, offset in _offsets(futures):
            tp = (topic, partition)
            low[tp] = min(offset, low.get(tp, offset))
            high[tp] = max(offset, high.get(tp, offset))
        went_back = any(tp in self._high and lo <= self._high[tp] for tp, lo in low.items())
        if went_back:
            self._high.clear()
        self._high.update(high)
        changed = False
        for kind in ("incidents", "actions"):
            try:
                tid = producer.topic_id(kind)
            except Exception:  # noqa: BLE001 - a metadata look-up never stops diagnosis
                tid = None
            if tid is None:
                continue
            changed = changed or self._topic_ids.get(kind, tid) != tid
            self._topic_ids[kind] = tid
        return reset or went_back or changed or self.pending

    def due(self, open_ids: set[str]) -> list[Any]:
        """Every output still relevant, oldest first (forgets the rest)."""
        self.prune(open_ids)
        return [rec for rec, _ in self.kept.values()]

    def prune(self, open_ids: set[str]) -> None:
        cutoff = time.monotonic() - self.retain_s
        for key, (_record, ts) in list(self.kept.items()):
            if ts >= cutoff:
                break  # send order: the rest are newer
            kind, rid = key
            if (kind == "incidents" and rid in open_ids) or (kind == "actions" and rid not in self.settled):
                continue
            del self.kept[key]
            if kind == "actions":
                self.settled.discard(rid)
        while len(self.kept) > self.max_kept:
            del self.kept[next(iter(self.kept))]

    def note_resent(self, n: int) -> None:
        self.losses += 1
        self.resent += n
        log.warning("diagnosis: the broker lost records it had acknowledged (offsets went back or a topic was made "
                    "again): resent %d output(s) still relevant (open incidents, unsettled actions, the last %.0f s)",
                    n, self.retain_s)


def _offsets(futures: Iterable[Any]) -> Iterable[tuple[str, int, int]]:
    """(topic, partition, offset) of kafka-python futures that succeeded."""
    for fut in futures:
        if fut is None or not getattr(fut, "is_done", False) or not fut.succeeded():
            continue
        meta = fut.value
        offset = getattr(meta, "offset", -1)
        if isinstance(offset, int) and offset >= 0:
            yield meta.topic, meta.partition, offset



def resend_if_lost(resend: OutputResend, producer: Any, futures: Iterable[Any], states: dict[str, Any],
                   consumer: Any = None) -> int:
    """After a round's flush: when the broker lost what it had acknowledged, send every kept output again
    and checkpoint every job afresh (the changelog went with it). Returns how many were resent."""
    resets = getattr(consumer, "resets", 0) if consumer is not None else 0
    if not resend.lost(producer, futures, input_resets=resets if isinstance(resets, int) else 0):
        return 0
    open_ids = {i.id for st in states.values() for i in st.engine.book.open_incidents()}
    due = resend.due(open_ids)
    resend.pending = True  # until the flush below returns (a BusError leaves it for the next round)
    try:
        for rec in due:
            producer.send(rec)
        if due:
            producer.flush(30.0)
    except BusError as exc:
        log.warning("diagnosis: resending %d output(s) after a broker loss failed (%s); next round", len(due), exc)
        return 0
    resend.pending = False
    for st in states.values():
        st.dirty = True
    resend.note_resent(len(due))
    return len(due)
