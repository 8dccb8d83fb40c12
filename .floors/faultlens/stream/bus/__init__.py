"""Producer and consumer wrappers on kafka-python.

They know the topic of each record kind, the key of each kind (node or job),
batching and compression, and TLS/SASL settings; kafka errors are translated
into ``BusError`` with the topic named. Records are encoded by
``faultlens.schema``; nothing else in faultlens builds Kafka clients by hand.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from faultlens import schema
from faultlens.config import BusConfig
from faultlens.decode import CONTENT_TYPE_HEADER, content_type_of
from faultlens.errors import BusError
from faultlens.stream import topics
from faultlens.stream.bus.embedded_broker import EMBEDDED_MAX_POLL_INTERVAL_MS
from faultlens.stream.signing import Keyring

log = logging.getLogger(__name__)
END_CHECK_S = 3.0  # how often a consumer compares idle partitions' positions with their logs' ends


def client_kwargs(bus: BusConfig, bootstrap: str | None = None) -> dict[str, Any]:
    """Connection settings shared by producers, consumers and admin clients."""
    servers = bootstrap or bus.bootstrap_servers
    if not servers:
        raise BusError("no bootstrap servers: set [bus] bootstrap_servers or FAULTLENS_BOOTSTRAP, or use the embedded broker")
    kw: dict[str, Any] = {
        "bootstrap_servers": [s.strip() for s in servers.split(",") if s.strip()],
        "client_id": bus.client_id,
        "security_protocol": bus.security_protocol,
    }
    if bus.security_protocol in ("SSL", "SASL_SSL"):
        for src, dst in (("ssl_cafile", "ssl_cafile"), ("ssl_certfile", "ssl_certfile"), ("ssl_keyfile", "ssl_keyfile"), ("ssl_password", "ssl_password")):
            if getattr(bus, src):
                kw[dst] = getattr(bus, src)
    if bus.security_protocol.startswith("SASL"):
        kw["sasl_mechanism"] = bus.sasl_mechanism or "PLAIN"
        kw["sasl_plain_username"] = bus.sasl_username
        kw["sasl_plain_password"] = bus.sasl_password
    return kw


def is_embedded(bootstrap: str) -> bool:
    return bootstrap.startswith("127.0.0.1:") or bootstrap.startswith("localhost:")


def ensure_topics(bus: BusConfig, bootstrap: str | None = None, names: Iterable[str] = topics.NAMES) -> None:
    """Create the faultlens topics that do not exist yet."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic
    from kafka.errors import KafkaError, TopicAlreadyExistsError

    try:
        admin = KafkaAdminClient(**client_kwargs(bus, bootstrap), request_timeout_ms=10_000)
    except KafkaError as exc:
        raise BusError(f"cannot reach the bus at {bootstrap or bus.bootstrap_servers}: {exc}") from exc
    try:
        existing = set(admin.list_topics())
        new = [
            NewTopic(topics.topic(n, bus.topic_prefix), topics.DEFAULT_PARTITIONS.get(n, 1), 1,
                     topic_configs=topics.TOPIC_CONFIGS.get(n, {}))
            for n in names
            if topics.topic(n, bus.topic_prefix) not in existing
        ]
        if new:
            try:
                admin.create_topics(new)
            except TopicAlreadyExistsError:
                pass
    except KafkaError as exc:
        raise BusError(f"creating topics failed: {exc}") from exc
    finally:
        admin.close()


class Producer:
    """Sends records to their topic, keyed by node or job.

    ``send`` never blocks on the network for long: kafka-python batches in the
    background (``linger_ms``). Callers that must not lose data on a broker
    outage (the agent) put a spool in front of this (collectors.spool).

    On the embedded broker the producer is not idempotent: its memory-only
    storage forgets producer ids when it restarts, and kafka-python's
    idempotent producer then fails for good (``InitProducerId``: unknown error)
    instead of sending to the restarted broker. Duplicates from retries are
    harmless downstream (the lake dedupes on offsets, actions carry ids).
    """

    def __init__(self, bus: BusConfig, bootstrap: str | None = None, *, keyring: Keyring | None = None,
                 **overrides: Any):
        from kafka import KafkaProducer
        from kafka.errors import KafkaError

        self.prefix = bus.topic_prefix
        self.keyring = keyring  # signs actions and commands (stream/signing.py); None or empty: unsigned
        kw = client_kwargs(bus, bootstrap)
        if is_embedded(",".join(kw["bootstrap_servers"])):
            kw["enable_idempotence"] = False
        kw.update(
            linger_ms=bus.linger_ms,
            batch_size=bus.batch_size_bytes,
            compression_type=None if bus.compression == "none" else bus.compression,
            acks="all",
            max_request_size=schema.MAX_MESSAGE_BYTES * 4,
        )
        kw.update(overrides)
        try:
            self._producer = KafkaProducer(**kw)
        except KafkaError as exc:
            raise BusError(f"cannot connect a producer to {kw['bootstrap_servers']}: {exc}") from exc

    def send(self, record: Any, *, value: bytes | None = None) -> Any:
        """Send one record (or its pre-encoded ``value``); returns kafka's future."""
        kind = type(record).KIND
        key = getattr(record, topics.KEY_FIELD[kind], None)
        if kind in ("incidents", "actions", "commands"):
            import orjson

            event = schema.cloudevent(record)
            if kind != "incidents" and self.keyring:
                event = self.keyring.sign(event)
            value = orjson.dumps(event)
        return self.send_raw(kind, key, value if value is not None else schema.encode(record))

    def send_raw(self, kind: str, key: str | None, value: bytes | None, *, partition: int | None = None,
                 headers: list[tuple[str, bytes]] | None = None) -> Any:
        """Send pre-encoded bytes (None: a tombstone); ``partition`` overrides the key's partition."""
        from kafka.errors import KafkaError

        name = topics.topic(kind, self.prefix)
        if headers is None and value is not None:
            # The wire format travels in a header (DESIGN.md: JSON, or the agent's MessagePack).
            headers = [(CONTENT_TYPE_HEADER, content_type_of(value).encode())]
        try:
            return self._producer.send(name, key=key.encode() if key else None, value=value, partition=partition,
                                       headers=headers or None)
        except KafkaError as exc:
            raise BusError(f"producing to {name} failed: {exc}") from exc
        except ValueError as exc:  # kafka-python: "Unrecognized partition" (the broker lost the topic)
            raise BusError(f"producing to {name}[{partition}] failed: {exc}") from exc

    def flush(self, timeout_s: float | None = None) -> None:
        from kafka.errors import KafkaError

        try:
            self._producer.flush(timeout=timeout_s)
        except KafkaError as exc:
            raise BusError(f"flush failed: {exc}") from exc

    def topic_id(self, kind: str) -> str | None:
        """The broker's id of ``kind``'s topic as last seen in metadata (None: unknown). A new id
        for the same name means the topic was created again: what the old one held is gone."""
        try:
            tid = self._producer._metadata.topic_id(topics.topic(kind, self.prefix))
        except AttributeError:  # a client without topic ids
            return None
        return str(tid) if tid is not None else None

    def close(self, timeout_s: float = 5.0) -> None:
        self._producer.close(timeout=timeout_s)

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class Message:
    kind: str
    topic: str
    partition: int
    offset: int
    key: str | None
    value: bytes
    timestamp_ms: int
    content_type: str | None = None  # the content-type header (JSON or the agent's MessagePack)
    headers: tuple[tuple[str, bytes], ...] = ()

    def header(self, name: str) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None


class _SeekWatch:
    """The kafka-python consumer of a ``Consumer``, with its seeks noted and its polls
    watched for logs that went back (see ``Consumer.raw``)."""

    def __init__(self, owner: Consumer):
        self._owner = owner
        self._c = owner._consumer

    def poll(self, timeout_ms: int = 0, max_records: int | None = None, **kw: Any) -> dict[Any, list[Any]]:
        batch = self._c.poll(timeout_ms=timeout_ms, max_records=max_records, **kw)
        batch = self._owner._watch_offsets(batch)
        for tp, msgs in batch.items():
            if msgs:
                self._owner._next[tp] = msgs[-1].offset + 1
        return batch

    def seek(self, partition: Any, offset: int) -> int:
        """Seek; returns the offset sought, lower than ``offset`` when that was kept from a lost log."""
        nxt = self._owner._next.get(partition, 0)
        if partition in self._owner._went_back and offset > nxt:
            # A position kept from before the broker lost this log (a manifest, a
            # checkpoint): past what the new log has handed over, it would skip records.
            log.warning("%s[%d]: not seeking to %d, kept from the lost log; reading on from %d",
                        partition.topic, partition.partition, offset, nxt)
            offset = nxt
        if offset == 0:
            self._c.seek_to_beginning(partition)  # a plain seek right after a recreation is never fetched
        else:
            self._c.seek(partition, offset)
        self._owner._next[partition] = offset
        return offset

    def seek_to_beginning(self, *partitions: Any) -> None:
        self._c.seek_to_beginning(*partitions)
        for tp in partitions or self._c.assignment():
            self._owner._next[tp] = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._c, name)


def _content_type(headers: Any) -> str | None:
    for k, v in headers or ():
        if k == CONTENT_TYPE_HEADER:
            return v.decode("latin-1") if isinstance(v, bytes) else str(v)
    return None


class Consumer:
    """A consumer-group member over some kinds' topics, yielding raw ``Message``s.

    Auto-commit is off: the caller commits after its sink has the data (or
    stores offsets with the data, as the lake writer does).

    A topic whose offsets went back (the memory-only embedded broker restarted
    and recreated it empty, numbering from 0 again) is read again from its
    start: a partition positioned past the new log (kafka-python resets it to
    the earliest offset) and a partition of a topic whose id changed under a
    live consumer (sought to the beginning) both hand the new log over from
    offset 0, and the listener's ``on_offsets_reset(partitions)``, when it has
    one, hears of it first (an offset-keyed dedupe must forget the old
    numbering). ``resets`` counts such partitions.
    """

    def __init__(
        self,
        bus: BusConfig,
        kinds: Iterable[str],
        *,
        group_id: str | None,
        bootstrap: str | None = None,
        from_beginning: bool = True,
        listener: Any = None,
        manual: bool = False,
        **overrides: Any,
    ):
        """``listener``: a ``kafka.ConsumerRebalanceListener`` for a group member
        (kafka-python calls it on its IO thread); ``manual``: join no group and assign nothing, the
        caller assigns partitions (``raw.assign``) and commits as ``group_id``
        (diagnosis.online.membership); ``overrides``: KafkaConsumer options."""
        from kafka import KafkaConsumer
        from kafka.errors import KafkaError

        self.prefix = bus.topic_prefix
        self.listener = listener
        self.resets = 0
        self._next: dict[Any, int] = {}  # TopicPartition -> next offset (returned, or sought)
        self._topic_ids: dict[str, Any] = {}  # topic -> the id of the incarnation read so far
        self._went_back: set[Any] = set()  # partitions whose log was recreated while this consumer ran
        self._next_end_check = 0.0
        self._beyond: dict[Any, tuple[int, int]] = {}  # partition -> (position, high watermark) past it
        kw = client_kwargs(bus, bootstrap)
        servers = ",".join(kw["bootstrap_servers"])
        embedded = is_embedded(servers)
        kw.update(
            group_id=group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest" if from_beginning else "latest",
            max_poll_interval_ms=EMBEDDED_MAX_POLL_INTERVAL_MS if embedded else bus.max_poll_interval_ms,
            session_timeout_ms=3000 if embedded else bus.session_timeout_ms,
            heartbeat_interval_ms=1000 if embedded else 3000,
            fetch_max_bytes=64 * 1024 * 1024,
            max_partition_fetch_bytes=16 * 1024 * 1024,
        )
        kw.update(overrides)
        self.topics = [topics.topic(k, self.prefix) for k in kinds]
        try:
            self._consumer = KafkaConsumer(**kw)
            if manual:
                pass
            elif group_id is not None:
                self._consumer.subscribe(self.topics, listener=listener)
            else:
                from kafka import TopicPartition

                parts = []
                for t in self.topics:
                    for p in sorted(self._consumer.partitions_for_topic(t) or ()):
                        parts.append(TopicPartition(t, p))
                self._consumer.assign(parts)
                if from_beginning:
                    self._consumer.seek_to_beginning()
        except KafkaError as exc:
            raise BusError(f"cannot start a consumer on {self.topics}: {exc}") from exc

    @property
    def raw(self) -> Any:
        """The kafka-python consumer, for offset management (seek, commit, assignment).

        Seeks through it are remembered: a partition sought past the end of a
        recreated log, then reset to its start by kafka-python, is a reset."""
        return _SeekWatch(self)

    def poll(self, timeout_ms: int = 500, max_records: int = 10_000) -> list[Message]:
        from kafka.errors import KafkaError

        try:
            batch = self._consumer.poll(timeout_ms=timeout_ms, max_records=max_records)
        except KafkaError as exc:
            raise BusError(f"consuming {self.topics} failed: {exc}") from exc
        batch = self._watch_offsets(batch)
        out = []
        for tp, msgs in batch.items():
            kind = topics.kind_of(tp.topic, self.prefix)
            for m in msgs:
                out.append(
                    Message(kind, tp.topic, tp.partition, m.offset, m.key.decode("utf-8", "replace") if m.key else None,
                            m.value, m.timestamp, _content_type(m.headers), tuple(m.headers or ()))
                )
            if msgs:
                self._next[tp] = msgs[-1].offset + 1
        return out

    def _watch_offsets(self, batch: dict[Any, list[Any]]) -> dict[Any, list[Any]]:
        """Find partitions whose log was recreated (see the class doc); returns the batch to hand over."""
        cluster = self._consumer._client.cluster  # topic ids come with metadata (v10+)
        reset: list[Any] = []
        try:
            assigned = list(self._consumer.assignment())
        except Exception:  # noqa: BLE001 - no assignment known yet
            assigned = []
        for topic in {tp.topic for tp in assigned}:
            now_id = cluster.topic_id(topic)
            if now_id is None:
                continue
            was = self._topic_ids.setdefault(topic, now_id)
            if was == now_id:
                continue
            self._topic_ids[topic] = now_id
            for tp in assigned:
                if tp.topic != topic:
                    continue
                msgs = batch.get(tp) or []
                if msgs and msgs[0].offset == 0:
                    continue  # already read from the new log's start (below)
                if self._next.get(tp, 0) == 0 and not msgs:
                    continue  # nothing read yet: it starts where it should
                batch.pop(tp, None)
                self._consumer.seek_to_beginning(tp)  # (a plain seek right after a recreation is never fetched)
                self._next[tp] = 0
                reset.append(tp)
        for tp, msgs in batch.items():
            if msgs and msgs[0].offset == 0 and self._next.get(tp, 0) > 0 and tp not in reset:
                reset.append(tp)  # kafka-python reset a position past the new log's end to its start
        now = time.monotonic()
        if now >= self._next_end_check:
            # A position past the end of the log: the broker lost it (Tansu answers such a
            # fetch with nothing rather than "out of range"). The fetches' high watermark
            # tells (Tansu's ListOffsets does not: it answers the last batch's first offset
            # + 1); past it on two checks in a row, END_CHECK_S apart, is a lost log.
            self._next_end_check = now + END_CHECK_S
            for tp in assigned:
                hw = self._consumer.highwater(tp)
                nxt = self._next.get(tp, 0)
                if batch.get(tp) or hw is None or nxt <= hw or tp in reset:
                    self._beyond.pop(tp, None)
                elif self._beyond.get(tp) == (nxt, hw):
                    self._beyond.pop(tp, None)
                    self._consumer.seek_to_beginning(tp)
                    reset.append(tp)
                else:
                    self._beyond[tp] = (nxt, hw)
        if reset:
            self.resets += len(reset)
            log.warning("offsets went back on %s (the broker lost its log): reading from the start",
                        ", ".join(f"{tp.topic}[{tp.partition}]" for tp in reset))
            hook = getattr(self.listener, "on_offsets_reset", None)
            if hook is not None:
                hook(reset)
            for tp in reset:
                self._next[tp] = 0
                self._went_back.add(tp)
        return batch

    def commit(self, offsets: dict[tuple[str, int], int] | None = None) -> None:
        """Commit the consumed positions, or ``offsets`` ({(topic, partition): next offset})."""
        from kafka import TopicPartition
        from kafka.errors import KafkaError
        from kafka.structs import OffsetAndMetadata

        try:
            if offsets is None:
                self._consumer.commit()
            elif offsets:
                self._consumer.commit({TopicPartition(t, p): OffsetAndMetadata(o, "", -1)
                                       for (t, p), o in offsets.items()})
        except KafkaError as exc:
            raise BusError(f"commit failed: {exc}") from exc

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
