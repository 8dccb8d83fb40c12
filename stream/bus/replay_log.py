"""ReplayLog: reads partitions of one topic into memory, from their start, without a group.

Diagnosis keeps shared state in small logs on the bus (the guard log, the changelog of
per-job checkpoints, the membership heartbeats). Each is read the same way: assign the
partitions, seek, read up to the end (or a high watermark), and go on folding what comes
later. This is that reader, so no part outside stream/bus/ builds a Kafka client; every
client error comes out as ``BusError`` naming the topic.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kafka import ConsumerRebalanceListener, KafkaConsumer, TopicPartition
from kafka.errors import KafkaError

from faultlens.config import BusConfig
from faultlens.errors import BusError
from faultlens.stream.bus import client_kwargs

__all__ = ["QueuedRebalance", "ReplayLog", "partitions_of", "topic_partitions"]


def topic_partitions(topic: str, partitions: Iterable[int]) -> list[Any]:
    """The client's partition handles of ``topic`` (what assign/seek/pause take)."""
    return [TopicPartition(topic, p) for p in partitions]


def partitions_of(tps: Iterable[Any], topic: str) -> list[int]:
    """The partition numbers of ``topic`` among client partition handles."""
    return [tp.partition for tp in tps if tp.topic == topic]


class QueuedRebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    """A rebalance listener that only queues what happened to ``topic``'s partitions, as
    ``("assign" | "revoke" | "release", [partition, ...])`` on ``events``.

    kafka-python calls listeners on its IO loop (the one that heartbeats), so they must not
    block: the owner restores and lets go on its own thread, before it applies any record of
    those partitions. ``release`` (membership's MemberConsumer only): given up while still held,
    so state can be checkpointed before it goes; ``revoke``: already gone."""

    def __init__(self, events: Any, topic: str):
        self._events, self._topic = events, topic

    def on_partitions_revoked(self, revoked: Any) -> None:
        self._events.put(("revoke", partitions_of(revoked, self._topic)))

    def on_partitions_assigned(self, assigned: Any) -> None:
        self._events.put(("assign", partitions_of(assigned, self._topic)))

    def on_partitions_released(self, released: Any) -> None:
        self._events.put(("release", partitions_of(released, self._topic)))


class ReplayLog:
    """One topic's partitions read without a consumer group (``assign`` + ``seek``), one client
    for the reader's life: a client per read would re-bootstrap the cluster metadata each time."""

    def __init__(self, bus: BusConfig, bootstrap: str | None, topic: str, **client: Any):
        self.topic = topic
        try:
            self._consumer = KafkaConsumer(**client_kwargs(bus, bootstrap), group_id=None,
                                           enable_auto_commit=False, **client)
        except KafkaError as exc:
            raise BusError(f"cannot read {topic}: {exc}") from exc

    def _tp(self, partition: int) -> Any:
        return TopicPartition(self.topic, partition)

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except KafkaError as exc:
            raise BusError(f"{what} {self.topic}: {exc}") from exc

    def known_partitions(self) -> set[int]:
        """The topic's partitions on the broker (empty when the broker does not have the topic)."""
        return set(self._call("cannot list the partitions of", self._consumer.partitions_for_topic, self.topic) or ())

    def assign(self, partitions: Iterable[int], *, from_start: bool = True) -> None:
        tps = [self._tp(p) for p in partitions]
        self._call("cannot assign", self._consumer.assign, tps)
        if tps and from_start:
            self._call("cannot seek", self._consumer.seek_to_beginning, *tps)

    def rewind(self, partitions: Iterable[int]) -> None:
        """Read ``partitions`` again from their start."""
        tps = [self._tp(p) for p in partitions]
        if tps:
            self._call("cannot seek", self._consumer.seek_to_beginning, *tps)

    def end_offsets(self, partitions: Iterable[int]) -> dict[int, int]:
        ends = self._call("cannot ask the end of", self._consumer.end_offsets, [self._tp(p) for p in partitions])
        return {tp.partition: off for tp, off in ends.items()}

    def position(self, partition: int) -> int:
        return int(self._call("cannot ask the position in", self._consumer.position, self._tp(partition)))

    def highwater(self, partition: int) -> int | None:
        """The high watermark the last fetch saw (None before one): where the end is on a broker whose
        ListOffsets does not say (Tansu)."""
        return self._consumer.highwater(self._tp(partition))

    def poll(self, timeout_ms: int, max_records: int = 10_000) -> list[Any]:
        """The next records of the assigned partitions, in order per partition (each has ``partition``,
        ``offset``, ``key``, ``value``, ``timestamp``)."""
        got = self._call("cannot read", self._consumer.poll, timeout_ms, max_records)
        return [m for msgs in got.values() for m in msgs]

    def close(self) -> None:
        try:
            self._consumer.close()
        except KafkaError:
            pass
