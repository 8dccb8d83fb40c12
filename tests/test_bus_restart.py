"""The embedded broker killed (-9) and restarted under a live producer and consumer.

Tansu keeps everything in memory: a restarted broker has empty topics whose offsets
start again at 0, and it has forgotten producer ids and consumer groups. The bus
wrappers must carry on across that without being rebuilt: the producer sends to the
new broker (kafka-python's idempotent producer would fail for good here), and a
group consumer reads the recreated topic from its start. Nothing sent after the
restart is lost.
"""

from __future__ import annotations

import time

import pytest

from faultlens.config import BusConfig
from faultlens.stream.broker import EmbeddedBroker
from faultlens.stream.bus import Consumer, Producer, ensure_topics
from faultlens.stream.schema import KernelEvent


def _send(producer: Producer, lo: int, hi: int, deadline_s: float = 60.0) -> None:
    """Send records lo..hi-1, retrying the ones that failed until each is acknowledged."""
    todo = list(range(lo, hi))
    deadline = time.monotonic() + deadline_s
    while todo and time.monotonic() < deadline:
        futs = [(i, producer.send(KernelEvent(ts=float(i), node="n1", kind="xid", raw=f"line {i}"))) for i in todo]
        try:
            producer.flush(10)
        except Exception:  # noqa: BLE001 - a failed flush leaves the failed futures to resend
            pass
        todo = [i for i, f in futs if not (f.is_done and f.succeeded())]
        if todo:
            time.sleep(0.5)
    assert not todo, f"{len(todo)} records never acknowledged"


def _drain(consumer: Consumer, got: list[int], want: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and len(set(got)) < want:
        for m in consumer.poll(300):
            got.append(int(m.value.split(b"line ")[1].split(b'"')[0]))
        try:
            consumer.commit()
        except Exception:  # noqa: BLE001 - the restarted broker forgot the group: it rejoins
            pass


@pytest.mark.slow
def test_broker_kill_and_restart_under_producer_and_consumer() -> None:
    broker = EmbeddedBroker().start()
    bus = BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix="restart", linger_ms=5)
    try:
        ensure_topics(bus, names=("kernel",))
        producer = Producer(bus, request_timeout_ms=3000, delivery_timeout_ms=10_000, max_block_ms=3000)
        consumer = Consumer(bus, ["kernel"], group_id="restart-g")
        got: list[int] = []
        _send(producer, 0, 200)
        _drain(consumer, got, 200)
        assert sorted(set(got)) == list(range(200))
        for round_ in range(2):
            broker.kill()
            time.sleep(0.5)
            broker.start()  # same port, empty
            ensure_topics(bus, names=("kernel",))
            lo = 200 + round_ * 100
            _send(producer, lo, lo + 100)  # the same producer, not a new one
            _drain(consumer, got, lo + 100)
        assert sorted(set(got)) == list(range(400)), f"lost: {sorted(set(range(400)) - set(got))[:20]}"
        producer.close()
        consumer.close()
    finally:
        broker.stop()
