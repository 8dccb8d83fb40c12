"""A group consumer on confluent-kafka with incremental (cooperative-sticky) rebalancing.

Why: kafka-python (3.0.x) knows only the eager protocol: when an instance joins
or leaves, every member gives up every partition and waits for the new
assignment (measured on the embedded broker: the members that stay hold nothing
for ~3-6 s), so every job of the fleet stops for a membership change that moves
a few. With ``cooperative-sticky`` (KIP-429, done by the client: any broker
with the classic group protocol serves it, the embedded Tansu included) a
member gives up only the partitions that move and keeps reading the rest.

It has ``stream.bus.Consumer``'s interface as ``ConsumeLoop`` and online
diagnosis use it: ``poll``, ``commit``, ``close``, ``raw.assignment()``,
``raw.seek()`` and a ``kafka.ConsumerRebalanceListener`` called with the
partitions revoked or added, on the polling thread, inside ``poll``.

Measured on the embedded broker (benchmarks/scaleout.py --consumer confluent): two
bare members rebalance incrementally (tests/test_stream_coop.py), but with four
diagnosis instances joining, Tansu made the first member lose its whole
assignment (librdkafka's "lost" callback) and the moved jobs waited 10-13 s,
against 2 s for kafka-python's eager protocol: ``auto`` keeps kafka-python
there and takes this consumer on a real cluster. On the embedded broker online
diagnosis does not join a group at all by default (diagnosis/online/membership.py).

Static membership (``group.instance.id``, KIP-345): ``instance_id`` sets it, so
a restarted instance gets its partitions back without a rebalance, on a real
Kafka (2.3+). The embedded broker does not honour it: a static member that
restarts is given nothing (benchmarks/scaleout.py's docstring has the figures),
so it stays off unless configured.

Not here: kafka-python ``Consumer``'s detection of a log recreated under it (a
memory-only broker that restarted); librdkafka resets an out-of-range position
to the log's start (``auto.offset.reset``), and the service's changelog markers
decide what was applied already.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from faultlens.config import BusConfig
from faultlens.errors import BusError, ConfigError
from faultlens.stream import topics
from faultlens.stream.bus import Consumer, Message, is_embedded
from faultlens.stream.bus.lake_fetchers import confluent_settings
from faultlens.stream.bus.librdkafka_producer import confluent_available

log = logging.getLogger(__name__)


class _Raw:
    """The ``raw`` view ConsumeLoop, the service and the heartbeat membership use, with kafka-python's
    names and ``kafka.TopicPartition``s: assignment, pause, resume, seek, assign, partitions_for_topic."""

    def __init__(self, owner: _LibrdkafkaConsumer):
        self._owner = owner

    def assignment(self) -> set[Any]:
        from kafka import TopicPartition

        return {TopicPartition(tp.topic, tp.partition) for tp in self._owner._consumer.assignment()}

    def pause(self, *tps: Any) -> None:
        ck = self._owner._ck
        self._owner._consumer.pause([ck.TopicPartition(tp.topic, tp.partition) for tp in tps])

    def resume(self, *tps: Any) -> None:
        ck = self._owner._ck
        self._owner._consumer.resume([ck.TopicPartition(tp.topic, tp.partition) for tp in tps])

    def seek(self, tp: Any, offset: int) -> None:
        ck = self._owner._ck
        try:
            self._owner._consumer.seek(ck.TopicPartition(tp.topic, tp.partition, offset))
        except ck.KafkaException as exc:
            raise BusError(f"seek of {tp.topic}[{tp.partition}] to {offset} failed: {exc}") from exc

    def assign(self, tps: Iterable[Any]) -> None:
        """Fetch exactly ``tps`` (kafka-python's ``assign``): only the difference is added or removed,
        so a partition kept goes on from where it is (a whole new assignment would restart every
        partition from its committed offset)."""
        ck, c = self._owner._ck, self._owner._consumer
        want = {(tp.topic, tp.partition) for tp in tps}
        have = {(tp.topic, tp.partition) for tp in c.assignment()}
        try:
            if have - want:
                c.incremental_unassign([ck.TopicPartition(t, p) for t, p in sorted(have - want)])
            if want - have:
                c.incremental_assign([ck.TopicPartition(t, p) for t, p in sorted(want - have)])
        except ck.KafkaException as exc:
            raise BusError(f"assigning {sorted(want)} failed: {exc}") from exc

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        ck = self._owner._ck
        try:
            meta = self._owner._consumer.list_topics(topic, timeout=5.0).topics.get(topic)
        except ck.KafkaException as exc:
            raise BusError(f"metadata of {topic} failed: {exc}") from exc
        if meta is None or meta.error is not None:
            return None
        return set(meta.partitions)


class _LibrdkafkaConsumer:
    """``stream.bus.Consumer``'s interface on a confluent-kafka consumer of ``group_id`` over ``kinds``'
    topics, not yet subscribed to anything: ``poll``, ``commit``, ``close`` and ``raw``."""

    def __init__(self, bus: BusConfig, kinds: Iterable[str], *, group_id: str, bootstrap: str | None = None,
                 from_beginning: bool = True, fetch_max_wait_ms: int = 100, extra: dict[str, Any] | None = None):
        try:
            import confluent_kafka as ck
        except ImportError:
            raise ConfigError("consumer 'confluent' needs confluent-kafka: pip install confluent-kafka") from None
        self._ck = ck
        self.prefix = bus.topic_prefix
        self.topics = [topics.topic(k, self.prefix) for k in kinds]
        # The processor's librdkafka settings (stream/bus/lake_fetchers.py), as a consumer that answers at once:
        # no minimum fetch size, its own fetch wait.
        conf = confluent_settings(bus, bootstrap, check_crcs=False)
        conf.pop("check.crcs")
        conf.update({
            "group.id": group_id,
            "auto.offset.reset": "earliest" if from_beginning else "latest",
            "fetch.min.bytes": 1,
            "fetch.wait.max.ms": fetch_max_wait_ms,
            "topic.metadata.refresh.interval.ms": 5000,
            **(extra or {}),
        })
        try:
            self._consumer = ck.Consumer(conf)
        except ck.KafkaException as exc:
            raise BusError(f"cannot start a consumer on {self.topics}: {exc}") from exc

    @property
    def raw(self) -> _Raw:
        return _Raw(self)

    def poll(self, timeout_ms: int = 500, max_records: int = 10_000) -> list[Message]:
        ck = self._ck
        try:
            msgs: list[Any] = self._consumer.consume(num_messages=max_records, timeout=timeout_ms / 1000.0)
        except ck.KafkaException as exc:
            raise BusError(f"consuming {self.topics} failed: {exc}") from exc
        out = []
        kind_of = topics.kind_of
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.code() != ck.KafkaError._PARTITION_EOF:
                    log.warning("consumer %s: %s", self.topics, err)
                    if err.fatal():
                        raise BusError(f"consuming {self.topics} failed: {err}")
                continue
            key = m.key()
            headers = tuple(m.headers() or ())
            ctype = next((v.decode("latin-1") for k, v in headers if k == "content-type" and v), None)
            topic = m.topic()
            out.append(Message(kind_of(topic, self.prefix), topic, m.partition(), m.offset(),
                               key.decode("utf-8", "replace") if key else None, m.value(), m.timestamp()[1],
                               ctype, headers))
        return out

    def commit(self, offsets: dict[tuple[str, int], int] | None = None) -> None:
        """Commit ``offsets`` ({(topic, partition): next offset}) synchronously."""
        ck = self._ck
        try:
            if offsets is None:
                self._consumer.commit(asynchronous=False)
            elif offsets:
                self._consumer.commit(offsets=[ck.TopicPartition(t, p, o) for (t, p), o in offsets.items()],
                                      asynchronous=False)
        except ck.KafkaException as exc:
            raise BusError(f"commit failed: {exc}") from exc

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> _LibrdkafkaConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CooperativeConsumer(_LibrdkafkaConsumer):
    """A member of ``group_id`` over ``kinds``' topics, rebalanced incrementally (module docstring)."""

    def __init__(self, bus: BusConfig, kinds: Iterable[str], *, group_id: str, bootstrap: str | None = None,
                 from_beginning: bool = True, listener: Any = None, fetch_max_wait_ms: int = 100,
                 instance_id: str = ""):
        servers = bootstrap or bus.bootstrap_servers or ""
        extra: dict[str, Any] = {"partition.assignment.strategy": "cooperative-sticky",
                                 "session.timeout.ms": 3000 if is_embedded(servers) else bus.session_timeout_ms}
        if instance_id:
            extra["group.instance.id"] = instance_id
        super().__init__(bus, kinds, group_id=group_id, bootstrap=bootstrap, from_beginning=from_beginning,
                         fetch_max_wait_ms=fetch_max_wait_ms, extra=extra)
        self.listener = listener
        try:
            self._consumer.subscribe(self.topics, on_assign=self._assigned, on_revoke=self._revoked,
                                     on_lost=self._revoked)
        except self._ck.KafkaException as exc:
            raise BusError(f"cannot subscribe to {self.topics}: {exc}") from exc

    def _tps(self, parts: list[Any]) -> list[Any]:
        from kafka import TopicPartition

        return [TopicPartition(p.topic, p.partition) for p in parts]

    def _assigned(self, consumer: Any, parts: list[Any]) -> None:
        consumer.incremental_assign(parts)
        if self.listener is not None and parts:
            self.listener.on_partitions_assigned(self._tps(parts))

    def _revoked(self, consumer: Any, parts: list[Any]) -> None:
        if self.listener is not None and parts:
            self.listener.on_partitions_revoked(self._tps(parts))
        consumer.incremental_unassign(parts)


class AssignedConsumer(_LibrdkafkaConsumer):
    """No group membership: fetches what ``raw.assign`` names and commits as ``group_id`` (the
    heartbeat membership of diagnosis/online/membership.py decides the partitions), with records
    parsed in C rather than in kafka-python's Python."""


CONSUMERS = ("kafka", "confluent")


def consumer_backend(backend: str, bus: BusConfig, bootstrap: str | None) -> str:
    """``auto``: ``confluent`` when confluent-kafka is installed and the bus is a real cluster, else
    ``kafka`` (on the embedded broker a cooperative member lost its whole assignment in joins, and only
    kafka-python's consumer notices a memory-only broker that restarted: stream/bus/__init__.py)."""
    if backend not in ("auto", *CONSUMERS):
        raise ConfigError(f"diagnosis consumer {backend!r} not in {('auto', *CONSUMERS)}")
    if backend != "auto":
        return backend

    servers = bootstrap or bus.bootstrap_servers or ""
    return "confluent" if confluent_available() and not is_embedded(servers) else "kafka"


def group_consumer(bus: BusConfig, kinds: list[str], *, backend: str, group_id: str, bootstrap: str | None,
                   listener: Any, fetch_max_wait_ms: int, instance_id: str = "") -> Any:
    """A group member over ``kinds``: ``kafka`` (kafka-python, eager rebalances) or ``confluent``
    (cooperative-sticky, this module); ``instance_id``: static membership (group.instance.id)."""
    # Not "confluent" on the embedded broker by default: there a member lost its whole assignment when
    # others joined (benchmarks/scaleout.py --consumer confluent: Xid -> action 10-13 s in the joins, 2 s eager).
    if consumer_backend(backend, bus, bootstrap) == "confluent":
        return CooperativeConsumer(bus, kinds, group_id=group_id, bootstrap=bootstrap, listener=listener,
                                   fetch_max_wait_ms=fetch_max_wait_ms, instance_id=instance_id)

    extra: dict[str, Any] = {"group_instance_id": instance_id} if instance_id else {}
    return Consumer(bus, kinds, group_id=group_id, bootstrap=bootstrap, from_beginning=True, listener=listener,
                    fetch_max_wait_ms=fetch_max_wait_ms, **extra)
