"""The confluent-kafka producer behaves as the kafka-python one: same partitions, headers, errors."""

from __future__ import annotations

import socket

import pytest

from faultlens.config import BusConfig
from faultlens.errors import BusError, ConfigError
from faultlens.stream.bus import Consumer, Producer, ensure_topics
from faultlens.stream.bus.librdkafka_producer import ConfluentProducer, make_producer

pytest.importorskip("confluent_kafka")


def _read(bus: BusConfig, kind: str, n: int) -> list:
    with Consumer(bus, [kind], group_id=None, from_beginning=True) as c:
        got: list = []
        for _ in range(100):
            got.extend(c.poll(200))
            if len(got) >= n:
                break
    return got


def test_keys_land_where_kafka_python_puts_them_with_headers(bus: BusConfig) -> None:
    ensure_topics(bus)
    keys = [f"job{i:04d}" for i in range(40)]
    with Producer(bus) as kp:
        for k in keys:
            kp.send_raw("diag-repartition", k, b"kafka-python", headers=[("k", b"gpu")])
    fast = make_producer(bus, backend="confluent")
    assert isinstance(fast, ConfluentProducer)
    for k in keys:
        fast.send_raw("diag-repartition", k, b"librdkafka", headers=[("k", b"gpu")])
    fast.send_raw("diag-repartition", "pinned", b"pinned", partition=3)
    fast.flush(30)
    fast.close()
    got = _read(bus, "diag-repartition", 2 * len(keys) + 1)
    where: dict[tuple[str, bytes], int] = {(m.key, m.value): m.partition for m in got}
    assert {where[(k, b"kafka-python")] for k in keys} != {0}  # spread: the test can fail
    for k in keys:
        assert where[(k, b"librdkafka")] == where[(k, b"kafka-python")]
    assert where[("pinned", b"pinned")] == 3
    assert all(m.header("k") == b"gpu" for m in got if m.key != "pinned")


def test_a_partition_the_topic_lacks_is_a_bus_error(bus: BusConfig) -> None:
    ensure_topics(bus)
    fast = ConfluentProducer(bus)
    with pytest.raises(BusError):
        fast.send_raw("diag-changelog", "job", b"x", partition=999)
        fast.flush(10)
    fast.close(1)


def test_a_record_never_delivered_fails_the_next_flush() -> None:
    """Only failed deliveries are reported (delivery.report.only.error): they still reach flush."""

    class Impatient(ConfluentProducer):
        message_timeout_ms = 300

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = Impatient(BusConfig(bootstrap_servers=f"127.0.0.1:{port}", topic_prefix="gone"))
    p.send_raw("gpu", "node-1", b"x")
    with pytest.raises(BusError, match="not delivered"):
        p.flush(10)
    p.close(0.1)


def test_an_unknown_backend_is_a_config_error(bus: BusConfig) -> None:
    with pytest.raises(ConfigError):
        make_producer(bus, backend="fast")
