"""ConsumeLoop through the real embedded broker: commit after effects, a poison message dead-lettered,
a failed flush delivered again, commits held back below records still in memory, shutdown commits."""

from __future__ import annotations

import threading
import time

import pytest

from faultlens import schema
from faultlens.errors import BusError
from faultlens.stream.bus import Consumer, Producer, ensure_topics
from faultlens.stream.bus.consume_loop import ConsumeLoop

pytestmark = pytest.mark.broker


def _committed(consumer: Consumer) -> int:
    return sum(consumer.raw.committed(tp) or 0 for tp in consumer.raw.assignment())


def _fill(bus, values: list[bytes]) -> None:
    ensure_topics(bus, names=("kernel", "deadletter"))
    with Producer(bus) as p:
        for v in values:
            p.send_raw("kernel", "n1", v)  # one key: one partition, in order
        p.flush(10)


def _until(pred, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_poison_message_is_dead_lettered_and_the_rest_committed(bus) -> None:
    _fill(bus, [b"ok-1", b"poison", b"ok-2", b"ok-3"])
    handled: list[bytes] = []

    def handle(batch):
        for m in batch:
            if m.value == b"poison":
                raise ValueError("cannot handle this one")
        handled.extend(m.value for m in batch)

    consumer = Consumer(bus, ["kernel"], group_id=f"{bus.topic_prefix}-g")
    producer = Producer(bus)
    loop = ConsumeLoop(consumer, handle, producer=producer, name="t")
    try:
        _until(lambda: loop.step() is not None and len(handled) >= 3)
        assert handled == [b"ok-1", b"ok-2", b"ok-3"]
        assert loop.stats.dead_letters == 1 and loop.stats.by_reason == {"handler_error": 1}
        assert _committed(consumer) == 4
    finally:
        consumer.close()
        producer.close()
    with Consumer(bus, ["deadletter"], group_id=None) as dl:
        got = []
        _until(lambda: got.extend(dl.poll(200)) or got)
        letter = schema.decode("deadletter", got[0].value)
        assert letter.reason == "handler_error" and letter.payload == "poison" and "cannot handle" in letter.detail


def test_a_failed_flush_is_delivered_again_and_nothing_is_committed_past_it(bus) -> None:
    _fill(bus, [b"a", b"b"])
    calls: list[list[bytes]] = []

    def handle(batch):
        calls.append([m.value for m in batch])
        if len(calls) == 1:
            raise BusError("flush failed: broker away")

    consumer = Consumer(bus, ["kernel"], group_id=f"{bus.topic_prefix}-g")
    loop = ConsumeLoop(consumer, handle, name="t", backoff_s=0.01)
    try:
        _until(lambda: loop.step() is not None and len(calls) >= 2)
        assert calls[0] == calls[1] == [b"a", b"b"]
        assert loop.stats.rewinds == 1 and loop.stats.dead_letters == 0
        loop.step(0)
        assert _committed(consumer) == 2
    finally:
        consumer.close()


def _holding(bus) -> tuple[Consumer, ConsumeLoop, dict[tuple[str, int], int]]:
    """Three records (x, held, y) and a loop whose handler holds the middle one in memory."""
    _fill(bus, [b"x", b"held", b"y"])
    held: dict[tuple[str, int], int] = {}

    def handle(batch):
        for m in batch:
            if m.value == b"held":
                held[(m.topic, m.partition)] = m.offset

    consumer = Consumer(bus, ["kernel"], group_id=f"{bus.topic_prefix}-g")
    return consumer, ConsumeLoop(consumer, handle, name="t", hold_back=lambda: dict(held)), held


def test_commits_stay_below_held_records_and_shutdown_commits(bus) -> None:
    consumer, loop, held = _holding(bus)
    _until(lambda: loop.step() is not None and bool(held) and loop.stats.polled >= 3)
    assert _committed(consumer) == 1  # below the held record at offset 1
    held.clear()  # the record was passed on
    stop = threading.Event()
    stop.set()
    loop.run(stop)  # no round: commits what was handled, then closes
    with Consumer(bus, ["kernel"], group_id=f"{bus.topic_prefix}-g") as again:
        _until(lambda: again.poll(100) is not None and bool(again.raw.assignment()))
        assert _committed(again) == 3


def test_an_offset_held_back_is_not_committed_again_every_round(bus) -> None:
    """A held-back cap that does not move costs no commit round trip per round; once it moves, and
    after ``recommit_s`` in any case, it is committed."""
    consumer, loop, held = _holding(bus)
    try:
        _until(lambda: loop.step(50) is not None and loop.stats.polled >= 3, timeout_s=90)
        assert loop.stats.polled == 3, "the three records were not fetched (a slow group join?)"
        assert _committed(consumer) == 1 and loop.stats.commits == 1
        for _ in range(5):
            loop.step(0)
        assert loop.stats.commits == 1  # the same capped offset: not sent again
        loop.recommit_s = 0.0
        loop.step(0)
        assert loop.stats.commits == 2  # ... unless it is time to send them all again
        loop.recommit_s = 60.0
        held.clear()
        loop.step(0)
        assert loop.stats.commits == 3 and _committed(consumer) == 3
    finally:
        consumer.close()
