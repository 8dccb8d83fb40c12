"""A producer on confluent-kafka (librdkafka) with stream/bus/__init__.py's ``Producer`` interface.

Why: kafka-python's ``send`` costs ~20 us of the caller's CPU a message (its
partitioner and record accumulator are Python) plus its IO thread's, on the
same GIL; librdkafka's ``produce`` costs ~2 us and batches on its own threads.
Online diagnosis forwards every input record once (the repartitioner) and
checkpoints every changed job, so its producer is on the per-record path
(benchmarks/engine_throughput.py, benchmarks/scaleout.py).

Same behaviour as ``Producer``: keys are partitioned with murmur2 (Kafka's and
kafka-python's default), so both clients place a key on the same partition;
not idempotent on the embedded broker (bus.py says why); a message that cannot
be delivered makes the next ``flush`` raise ``BusError``, as a lost topic does.
"""

from __future__ import annotations

import logging
from typing import Any

from faultlens import schema
from faultlens.config import BusConfig
from faultlens.decode import CONTENT_TYPE_HEADER, content_type_of
from faultlens.errors import BusError, ConfigError
from faultlens.stream import topics
from faultlens.stream.bus import Producer, client_kwargs, is_embedded
from faultlens.stream.bus.lake_fetchers import confluent_security
from faultlens.stream.signing import Keyring

log = logging.getLogger(__name__)
BACKENDS = ("auto", "kafka", "confluent")


def confluent_available() -> bool:
    try:
        import confluent_kafka  # noqa: F401
    except ImportError:
        return False
    return True


def make_producer(bus: BusConfig, bootstrap: str | None = None, *, backend: str = "auto",
                  keyring: Keyring | None = None, linger_ms: int | None = None) -> Producer:
    """``auto``: confluent-kafka when it is installed, else kafka-python; ``kafka`` or ``confluent`` to choose."""
    if backend not in BACKENDS:
        raise ConfigError(f"producer backend {backend!r} not in {BACKENDS}")
    if backend == "confluent" or (backend == "auto" and confluent_available()):
        return ConfluentProducer(bus, bootstrap, keyring=keyring, linger_ms=linger_ms)
    extra: dict[str, Any] = {} if linger_ms is None else {"linger_ms": linger_ms}
    if is_embedded(",".join(client_kwargs(bus, bootstrap)["bootstrap_servers"])):
        extra["max_in_flight_requests_per_connection"] = 1  # in order through retries (ConfluentProducer says why)
    return Producer(bus, bootstrap, keyring=keyring, **extra)


class ConfluentProducer(Producer):
    """``Producer`` on librdkafka: send/send_raw queue, flush waits and raises what failed."""

    message_timeout_ms = 60_000  # a record not delivered by then fails: the next flush raises BusError

    def __init__(self, bus: BusConfig, bootstrap: str | None = None, *, keyring: Keyring | None = None,
                 linger_ms: int | None = None):
        try:
            import confluent_kafka as ck
        except ImportError:
            raise ConfigError("producer backend 'confluent' needs confluent-kafka: pip install confluent-kafka") from None
        self.prefix = bus.topic_prefix
        self.keyring = keyring
        kw = client_kwargs(bus, bootstrap)
        servers = ",".join(kw["bootstrap_servers"])
        conf: dict[str, Any] = {
            "bootstrap.servers": servers,
            "client.id": bus.client_id,
            "security.protocol": bus.security_protocol,
            "linger.ms": bus.linger_ms if linger_ms is None else linger_ms,
            "batch.size": bus.batch_size_bytes,
            "compression.type": bus.compression,
            "acks": "all",
            "message.max.bytes": schema.MAX_MESSAGE_BYTES * 4,
            "partitioner": "murmur2_random",  # kafka-python's and Java's: a key lands where theirs does
            "enable.idempotence": not is_embedded(servers),
            # Records of one key stay in order through retries: idempotence does it on a real Kafka; without
            # it (the embedded broker) one request in flight does. Online diagnosis relies on it: a forward
            # retried behind a later one of the same node was taken for a repeat and dropped.
            "max.in.flight.requests.per.connection": 5 if not is_embedded(servers) else 1,
            "message.timeout.ms": self.message_timeout_ms,
            "log_level": 3,
            # Only failures come back (flush waits for the rest): a report for every forwarded record was
            # a third of the repartitioner's time (its poll built a Message per record; py-spy on
            # benchmarks/scaleout.py).
            "on_delivery": self._delivered,
            "delivery.report.only.error": True,
        }
        conf.update(confluent_security(kw))
        self._ck = ck
        self._failed: list[str] = []
        self._topics: dict[str, str] = {}  # kind -> topic name (send_raw runs once per forwarded record)
        self._unpolled = 0  # sends since the last poll for delivery reports
        try:
            self._producer = ck.Producer(conf)
        except ck.KafkaException as exc:
            raise BusError(f"cannot make a producer for {servers}: {exc}") from exc

    def _delivered(self, err: Any, msg: Any) -> None:
        if err is not None and len(self._failed) < 100:
            self._failed.append(f"{msg.topic()}[{msg.partition()}]: {err}")

    def send_raw(self, kind: str, key: str | None, value: bytes | None, *, partition: int | None = None,
                 headers: list[tuple[str, bytes]] | None = None) -> Any:
        """Queue pre-encoded bytes (None: a tombstone); ``partition`` overrides the key's partition."""
        name = self._topics.get(kind)
        if name is None:
            name = self._topics[kind] = topics.topic(kind, self.prefix)
        if headers is None and value is not None:
            headers = [(CONTENT_TYPE_HEADER, content_type_of(value).encode())]
        kw: dict[str, Any] = {}
        if partition is not None:
            kw["partition"] = partition
        if headers:
            kw["headers"] = headers
        while True:
            try:
                self._producer.produce(name, value, key.encode() if key else None, **kw)
                break
            except BufferError:  # the local queue is full: let librdkafka send some
                self._producer.poll(0.05)
            except (self._ck.KafkaException, ValueError, TypeError) as exc:
                raise BusError(f"producing to {name} failed: {exc}") from exc
        self._unpolled += 1
        if self._unpolled >= 64:  # failed deliveries of what went before (flush serves the rest)
            self._unpolled = 0
            self._producer.poll(0)
        return None

    def flush(self, timeout_s: float | None = None) -> None:
        left = self._producer.flush(-1 if timeout_s is None else timeout_s)
        failed, self._failed = self._failed, []
        if left:
            raise BusError(f"flush failed: {left} message(s) not delivered within {timeout_s} s")
        if failed:
            raise BusError(f"flush failed: {len(failed)} message(s) not delivered ({failed[0]})")

    def close(self, timeout_s: float = 5.0) -> None:
        """Deliver what is queued (up to ``timeout_s``), then stop librdkafka's threads."""
        left = self._producer.flush(timeout_s)
        if left:
            log.warning("producer closed with %d message(s) not delivered", left)
        close = getattr(self._producer, "close", None)  # confluent-kafka 2.13+; older ones stop when collected
        if close is not None:
            try:
                close()
            except (RuntimeError, self._ck.KafkaException) as exc:
                log.debug("producer close: %r", exc)
