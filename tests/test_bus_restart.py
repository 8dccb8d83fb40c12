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
from pathlib import Path

import pytest

from faultlens.config import BusConfig
from faultlens.schema import KernelEvent
from faultlens.stream.bus import Consumer, Producer, ensure_topics
from faultlens.stream.bus.embedded_broker import EmbeddedBroker


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


def _lake_rows(lake: Path) -> dict[str, tuple[int, int]]:
    from tests.test_stream_processor import lake_counts

    return lake_counts(lake) if (lake / "_manifest").exists() else {}


def _wait_lake(lake: Path, want: dict[str, int], timeout_s: float = 90.0) -> dict[str, tuple[int, int]]:
    deadline = time.monotonic() + timeout_s
    got: dict[str, tuple[int, int]] = {}
    while time.monotonic() < deadline:
        got = _lake_rows(lake)
        if got and all(got[t][0] >= n for t, n in want.items()):
            return got
        time.sleep(0.3)
    return got


@pytest.mark.slow
def test_a_processor_started_after_a_broker_restart_reads_the_new_log_from_its_start(tmp_path: Path) -> None:
    """Its manifest holds offsets of the lost log, past the end of the new one: it must not wait for them.

    (Tansu answers a fetch past the end with nothing rather than "out of range", so the
    bus compares the position with the fetches' high watermark.)
    """
    import threading

    from faultlens.stream.processor import StreamProcessor
    from tests.test_stream_processor import config_for, expected_rows, mixed_records, produce

    broker = EmbeddedBroker().start()
    lake = tmp_path / "lake"
    try:
        bus = BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix="relog", linger_ms=5)
        ensure_topics(bus)
        first, second = mixed_records(600), mixed_records(300, start=600)
        produce(bus, first)
        proc = StreamProcessor(config_for(bus, tmp_path), flush_interval_s=0.3)
        assert proc.run(exit_when_idle_s=3, max_runtime_s=90) is not None
        got = _lake_rows(lake)
        assert {t: got[t] for t in expected_rows(first)} == {t: (n, n) for t, n in expected_rows(first).items()}

        broker.kill()  # its topics, offsets and groups are gone; offsets restart at 0
        broker.start()
        ensure_topics(bus)
        produce(bus, second)  # shorter than the first log on every partition
        proc = StreamProcessor(config_for(bus, tmp_path), flush_interval_s=0.3)
        worker = threading.Thread(target=proc.run, kwargs={"max_runtime_s": 120})
        worker.start()
        want = expected_rows(first + second)
        got = _wait_lake(lake, want, timeout_s=60)
        proc.stop()
        worker.join(timeout=60)
        assert {t: got[t] for t in want} == {t: (n, n) for t, n in want.items()}, "rows lost or doubled"
    finally:
        broker.stop()
