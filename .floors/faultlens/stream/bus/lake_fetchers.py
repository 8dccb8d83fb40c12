"""Where the stream processor's messages come from: kafka-python or confluent-kafka.

The processor keeps its offsets in the lake (the manifest), not in Kafka, so it
needs from a client only: poll batches per topic partition, call it back on a
rebalance and let it place each assigned partition (seek), and report lag. Both
backends give exactly that (``Fetcher``); the processor does not know which one
runs.

* ``kafka`` (kafka-python, the default and always installed): pure Python.
  Its record parsing holds the GIL at ~15-20 us a message, which bounds one
  processor process (benchmarks/ingest.py: bare kafka-python consume).
* ``confluent`` (confluent-kafka, librdkafka in C; ``pip install
  confluent-kafka``): fetches and parses on librdkafka's own threads, ~3-5x the
  bare kafka-python rate on the same broker. The processor should use it where
  it can be installed (``StreamProcessor(..., fetcher="confluent")``).

Records handed to the processor have ``.offset .key .value .headers`` (what
stream/decode_arrow.py reads), whichever backend made them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from itertools import groupby
from typing import Any, Protocol

import msgspec

from faultlens.config import BusConfig
from faultlens.errors import BusError, ConfigError
from faultlens.stream import topics
from faultlens.stream.bus import Consumer, client_kwargs, is_embedded

log = logging.getLogger(__name__)

Key = tuple[str, int]  # (topic, partition)
# The processor's rebalance callbacks: assigned -> {key: next offset, or None for the beginning}.
OnAssigned = Callable[[list[Key]], dict[Key, int | None]]
OnRevoked = Callable[[list[Key]], None]
OnReset = Callable[[list[Key]], None]  # the broker lost these partitions' logs: read again from 0

BACKENDS = ("kafka", "confluent")


class Fetcher(Protocol):
    """What the stream processor needs from a Kafka client."""

    def poll(self, timeout_ms: int, max_records: int) -> dict[Key, list[Any]]:
        """Records per partition, in offset order (raises ``BusError`` when the bus failed)."""
        ...

    def lag(self) -> dict[Key, int]:
        """Messages behind the log end, per assigned partition."""
        ...

    def close(self) -> None: ...


def choose_backend(backend: str, bootstrap: str) -> str:
    """``auto``: confluent-kafka when it is installed and the bus is a real cluster (about 1.3-1.7x
    the lake rate: kafka-python's record parsing is the processor's wall), else kafka-python,
    whose path carries the embedded broker's restart handling (stream/bus/__init__.py)."""
    if backend != "auto":
        return backend

    if is_embedded(bootstrap):
        return "kafka"
    try:
        import confluent_kafka  # noqa: F401
    except ImportError:
        return "kafka"
    return "confluent"


def open_fetcher(backend: str, bus: BusConfig, kinds: Iterable[str], *, group_id: str, bootstrap: str,
                 on_assigned: OnAssigned, on_revoked: OnRevoked, check_crcs: bool,
                 overrides: dict[str, Any] | None = None, on_reset: OnReset | None = None) -> Fetcher:
    """The fetcher of ``backend`` (``kafka`` or ``confluent``), subscribed to ``kinds``' topics.

    ``on_reset`` hears of partitions whose log the broker lost and that are read again from
    offset 0 (stream/bus/__init__.py finds them for kafka-python; librdkafka resets by itself)."""
    if backend == "kafka":
        return KafkaPythonFetcher(bus, kinds, group_id=group_id, bootstrap=bootstrap, on_assigned=on_assigned,
                                  on_revoked=on_revoked, check_crcs=check_crcs, overrides=overrides,
                                  on_reset=on_reset)
    if backend == "confluent":
        return ConfluentFetcher(bus, kinds, group_id=group_id, bootstrap=bootstrap, on_assigned=on_assigned,
                                on_revoked=on_revoked, check_crcs=check_crcs, overrides=overrides)
    raise ConfigError(f"stream processor fetcher {backend!r}: expected one of {', '.join(BACKENDS)}")


# --------------------------------------------------------------------------- kafka-python


class KafkaPythonFetcher:
    """kafka-python through stream/bus/__init__.py's Consumer; rebalance callbacks run on its IO thread."""

    def __init__(self, bus: BusConfig, kinds: Iterable[str], *, group_id: str, bootstrap: str,
                 on_assigned: OnAssigned, on_revoked: OnRevoked, check_crcs: bool,
                 overrides: dict[str, Any] | None = None, on_reset: OnReset | None = None):
        from kafka import ConsumerRebalanceListener


        fetcher = self
        self._on_reset = on_reset

        class _Listener(ConsumerRebalanceListener):
            def on_partitions_revoked(self, revoked: Any) -> None:
                on_revoked([(tp.topic, tp.partition) for tp in revoked])

            def on_partitions_assigned(self, assigned: Any) -> None:
                # On kafka-python's IO thread: local work and seeks only, no blocking consumer calls.
                positions = on_assigned([(tp.topic, tp.partition) for tp in assigned])
                fetcher._seek(assigned, positions)

            def on_offsets_reset(self, partitions: Any) -> None:  # stream.bus's hook (see Consumer)
                if on_reset is not None:
                    on_reset([(tp.topic, tp.partition) for tp in partitions])

        kw: dict[str, Any] = {"check_crcs": check_crcs, "max_poll_records": 50_000, "fetch_min_bytes": 1 << 20,
                              "fetch_max_wait_ms": 100}
        kw.update(overrides or {})
        self._consumer = Consumer(bus, kinds, group_id=group_id, bootstrap=bootstrap, listener=_Listener(), **kw)

    def _seek(self, assigned: Any, positions: dict[Key, int | None]) -> None:
        raw = self._consumer.raw
        lowered = []
        for tp in assigned:
            key = (tp.topic, tp.partition)
            if key not in positions:  # the processor could not prepare it (and stops): leave it be
                continue
            pos = positions[key]
            if pos is None:
                raw.seek_to_beginning(tp)
            elif raw.seek(tp, pos) < pos:  # stream.bus: a position kept from a log the broker lost
                lowered.append(key)
        if lowered and self._on_reset is not None:
            self._on_reset(lowered)

    def poll(self, timeout_ms: int, max_records: int) -> dict[Key, list[Any]]:
        from kafka.errors import KafkaError

        try:
            batch = self._consumer.raw.poll(timeout_ms=timeout_ms, max_records=max_records)
        except KafkaError as exc:
            raise BusError(f"poll failed: {exc}") from exc
        return {(tp.topic, tp.partition): records for tp, records in batch.items()}

    def topic_ids(self) -> dict[str, str]:
        """topic -> the broker's id for it in the consumer's metadata (a new id: the topic was created
        again and its old log is gone; the processor then reads the new one from its start)."""
        cluster = getattr(self._consumer.raw, "_cluster", None)
        if cluster is None:
            return {}
        out = {}
        for topic in list(getattr(cluster, "_topic_ids", {})):
            tid = cluster.topic_id(topic)
            if tid is not None:
                out[topic] = str(tid)
        return out

    def rewind(self, keys: list[Key]) -> None:
        """Read these partitions from the beginning of their (new) log."""
        from kafka import TopicPartition

        raw = self._consumer.raw
        owned = set(raw.assignment())
        tps = [tp for tp in (TopicPartition(t, p) for t, p in keys) if tp in owned]
        if tps:
            raw.seek_to_beginning(*tps)

    def lag(self) -> dict[Key, int]:
        raw = self._consumer.raw
        parts = list(raw.assignment())
        if not parts:
            return {}
        ends = raw.end_offsets(parts)
        return {(tp.topic, tp.partition): max(0, ends[tp] - raw.position(tp)) for tp in parts if tp in ends}

    def close(self) -> None:
        self._consumer.close()


# --------------------------------------------------------------------------- confluent-kafka


class _Record(msgspec.Struct, frozen=True, gc=False):
    """A confluent-kafka message as the decoder reads records (attributes, not methods).

    A Struct: built by ``map`` in C, no Python frame per message. ``gc=False``: it holds
    no container that could point back at it, and an untracked object neither counts
    towards the next garbage collection nor is scanned by one (the processor holds tens
    of thousands of records at a time).
    """

    offset: int
    key: bytes | None
    value: bytes | None
    headers: Any


def confluent_settings(bus: BusConfig, bootstrap: str | None, check_crcs: bool) -> dict[str, Any]:
    """librdkafka settings equivalent to stream/bus/__init__.py's kafka-python ones."""

    kw = client_kwargs(bus, bootstrap)
    servers = ",".join(kw["bootstrap_servers"])
    embedded = is_embedded(servers)
    conf: dict[str, Any] = {
        "bootstrap.servers": servers,
        "client.id": bus.client_id,
        "security.protocol": bus.security_protocol,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "session.timeout.ms": 6000 if embedded else bus.session_timeout_ms,
        "heartbeat.interval.ms": 1000 if embedded else 3000,
        "max.poll.interval.ms": max(bus.max_poll_interval_ms, 300_000) if embedded else bus.max_poll_interval_ms,
        "fetch.min.bytes": 1 << 20,
        "fetch.wait.max.ms": 100,
        "fetch.max.bytes": 64 << 20,
        "max.partition.fetch.bytes": 16 << 20,
        "check.crcs": check_crcs,
        "log_level": 3,
    }
    conf.update(confluent_security(kw))
    return conf


def confluent_security(kw: dict[str, Any]) -> dict[str, Any]:
    """The TLS and SASL settings of kafka-python's ``client_kwargs`` in librdkafka's names."""
    conf: dict[str, Any] = {}
    for src, dst in (("ssl_cafile", "ssl.ca.location"), ("ssl_certfile", "ssl.certificate.location"),
                     ("ssl_keyfile", "ssl.key.location"), ("ssl_password", "ssl.key.password")):
        if src in kw:
            conf[dst] = kw[src]
    if "sasl_mechanism" in kw:
        conf.update({"sasl.mechanism": kw["sasl_mechanism"], "sasl.username": kw["sasl_plain_username"],
                     "sasl.password": kw["sasl_plain_password"]})
    return conf


class ConfluentFetcher:
    """confluent-kafka (librdkafka); rebalance callbacks run inside ``poll`` on the caller's thread."""

    def __init__(self, bus: BusConfig, kinds: Iterable[str], *, group_id: str, bootstrap: str,
                 on_assigned: OnAssigned, on_revoked: OnRevoked, check_crcs: bool,
                 overrides: dict[str, Any] | None = None):
        try:
            import confluent_kafka as ck
        except ImportError:
            raise ConfigError("stream processor fetcher 'confluent' needs confluent-kafka: "
                              "pip install confluent-kafka (or use fetcher='kafka')") from None
        self._ck = ck
        conf = confluent_settings(bus, bootstrap, check_crcs)
        conf["group.id"] = group_id
        conf.update(overrides or {})
        self._on_assigned, self._on_revoked = on_assigned, on_revoked
        self.topics = [topics.topic(k, bus.topic_prefix) for k in kinds]
        try:
            self._consumer = ck.Consumer(conf)
            self._consumer.subscribe(self.topics, on_assign=self._assign, on_revoke=self._revoke)
        except ck.KafkaException as exc:
            raise BusError(f"cannot start a consumer on {self.topics}: {exc}") from exc

    def _assign(self, consumer: Any, partitions: list[Any]) -> None:
        positions = self._on_assigned([(tp.topic, tp.partition) for tp in partitions])
        for tp in partitions:
            key = (tp.topic, tp.partition)
            if key in positions:  # else the processor could not prepare it (and stops)
                pos = positions[key]
                tp.offset = self._ck.OFFSET_BEGINNING if pos is None else pos
        consumer.assign(partitions)

    def _revoke(self, consumer: Any, partitions: list[Any]) -> None:
        self._on_revoked([(tp.topic, tp.partition) for tp in partitions])
        consumer.unassign()

    def poll(self, timeout_ms: int, max_records: int) -> dict[Key, list[Any]]:
        # consume() waits for num_messages or the timeout. Waiting for a first 1,000 and then taking
        # what else was queued started decoding sooner but in smaller batches (more fixed costs a
        # batch): ~10% fewer messages a second in benchmarks/ingest.py, so it waits for the lot.
        try:
            msgs: list[Any] = self._consumer.consume(num_messages=min(max_records, 100_000), timeout=timeout_ms / 1000)
        except self._ck.KafkaException as exc:
            raise BusError(f"poll failed: {exc}") from exc
        if not msgs:
            return {}
        ck = self._ck
        if any(map(ck.Message.error, msgs)):
            good = []
            for m in msgs:
                err = m.error()
                if err is None:
                    good.append(m)
                elif err.code() != ck.KafkaError._PARTITION_EOF:
                    log.warning("fetch error on %s[%s]: %s", m.topic(), m.partition(), err)
            msgs = good
        M = ck.Message
        recs = list(map(_Record, map(M.offset, msgs), map(M.key, msgs), map(M.value, msgs), map(M.headers, msgs)))
        keys = list(zip(map(M.topic, msgs), map(M.partition, msgs), strict=True))
        out: dict[Key, list[Any]] = {}
        # A fetch returns runs of one partition: group the runs (in C), not the messages.
        i = 0
        for key, run in groupby(keys):
            n = len(list(run))
            out.setdefault(key, []).extend(recs[i:i + n])
            i += n
        return out

    def lag(self) -> dict[Key, int]:
        parts = self._consumer.assignment()
        if not parts:
            return {}
        out = {}
        for tp in self._consumer.position(parts):
            _, high = self._consumer.get_watermark_offsets(tp, timeout=1.0, cached=False)
            if tp.offset >= 0:
                out[(tp.topic, tp.partition)] = max(0, high - tp.offset)
        return out

    def close(self) -> None:
        self._consumer.close()
