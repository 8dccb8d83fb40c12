"""The repartitioner's forwards are acknowledged by the next round (settle), and their input offsets
stay uncommitted until then; a forward that fails is sent again and keeps its offset held."""

from __future__ import annotations

import pytest

from faultlens.config import BusConfig
from faultlens.diagnosis.online.repartition import Repartitioner
from faultlens.errors import BusError
from faultlens.stream.bus import Consumer, Message, ensure_topics
from faultlens.stream.bus.librdkafka_producer import make_producer

pytest.importorskip("confluent_kafka")


def _steps(offsets: range, partition: int = 2) -> list[Message]:
    return [Message(kind="steps", topic="t-steps", partition=partition, offset=o, key="job7",
                    value=b'{"ts": 1.0}', timestamp_ms=10**12) for o in offsets]


def test_forwards_hold_their_offsets_until_the_next_round_settles_them(bus: BusConfig) -> None:
    ensure_topics(bus)
    producer = make_producer(bus, backend="confluent", linger_ms=5)
    rep = Repartitioner(producer)
    rep.settle_after_s = 0.0  # every round settles the one before
    rep.handle(_steps(range(10, 15)))
    assert rep.hold_back() == {("t-steps", 2): 10}  # not acknowledged yet: nothing of the round commits
    rep.handle(_steps(range(15, 17)))  # settles the first round, forwards the second
    assert rep.hold_back() == {("t-steps", 2): 15}
    rep.try_settle()
    assert rep.hold_back() == {}
    producer.close()
    with Consumer(bus, ["diag-repartition"], group_id=None, from_beginning=True) as c:
        got: list[Message] = []
        for _ in range(50):
            got.extend(c.poll(200))
            if len(got) >= 7:
                break
    assert sorted(int(m.header("so") or b"-1") for m in got) == list(range(10, 17))
    assert {m.key for m in got} == {"job7"}


def test_a_forward_that_is_not_acknowledged_is_sent_again_and_keeps_its_offset_held() -> None:
    dead = BusConfig(bootstrap_servers="127.0.0.1:9", topic_prefix="nobody")  # nothing listens there
    producer = make_producer(dead, backend="confluent", linger_ms=5)
    rep = Repartitioner(producer)
    rep.settle_timeout_s, rep.settle_after_s = 0.3, 0.0
    rep.handle(_steps(range(3, 6)))
    with pytest.raises(BusError):
        rep.handle(_steps(range(6, 8)))  # the ConsumeLoop rewinds this batch and tries again
    assert rep.hold_back() == {("t-steps", 2): 3}
    assert rep.forwarded == 6  # the three of the first round, sent again
    rep.try_settle()  # logged, not raised (idle and stopping)
    assert rep.hold_back() == {("t-steps", 2): 3}


def test_rounds_leave_forwards_unacknowledged_up_to_a_bound(bus: BusConfig) -> None:
    ensure_topics(bus)
    producer = make_producer(bus, backend="confluent", linger_ms=5)
    rep = Repartitioner(producer)
    rep.max_unsettled, rep.settle_after_s = 8, 60.0
    rep.handle(_steps(range(0, 5)))
    rep.handle(_steps(range(5, 10)))  # 5 unacknowledged: no wait
    assert rep.hold_back() == {("t-steps", 2): 0}
    rep.handle(_steps(range(10, 12)))  # 10 >= 8: the round waits for them first
    assert rep.hold_back() == {("t-steps", 2): 10}
    rep.try_settle()
    producer.close()
