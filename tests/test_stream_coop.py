"""Cooperative rebalancing: a member that stays keeps reading while another joins."""

from __future__ import annotations

import time
from typing import Any

import pytest
from kafka import ConsumerRebalanceListener

from faultlens.config import BusConfig
from faultlens.errors import ConfigError
from faultlens.stream.bus import Producer, ensure_topics
from faultlens.stream.bus.librdkafka_consumer import CooperativeConsumer, group_consumer
from faultlens.stream.topics import REPARTITION_PARTITIONS

pytest.importorskip("confluent_kafka")


class _Log(ConsumerRebalanceListener):
    def __init__(self) -> None:
        self.events: list[tuple[str, set[int]]] = []

    def on_partitions_revoked(self, revoked: Any) -> None:
        self.events.append(("revoked", {tp.partition for tp in revoked}))

    def on_partitions_assigned(self, assigned: Any) -> None:
        self.events.append(("assigned", {tp.partition for tp in assigned}))


def _owned(c: CooperativeConsumer) -> set[int]:
    return {tp.partition for tp in c.raw.assignment()}


def _poll_until(consumers: list[CooperativeConsumer], done: Any, timeout_s: float = 40.0) -> list[Any]:
    got: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not done():
        for c in consumers:
            got.extend(c.poll(100))
    assert done(), "the group did not settle in time"
    return got


def test_a_joining_member_takes_some_partitions_and_the_first_keeps_the_rest(bus: BusConfig) -> None:
    ensure_topics(bus)
    first_log, second_log = _Log(), _Log()
    first = CooperativeConsumer(bus, ["diag-repartition"], group_id=f"{bus.topic_prefix}-g", listener=first_log)
    second = None
    try:
        _poll_until([first], lambda: len(_owned(first)) == REPARTITION_PARTITIONS)
        kept_before = _owned(first)
        second = CooperativeConsumer(bus, ["diag-repartition"], group_id=f"{bus.topic_prefix}-g", listener=second_log)
        with Producer(bus) as p:
            for i in range(64):
                p.send_raw("diag-repartition", f"job{i}", b"x", headers=[("k", b"gpu")])
        both = [first, second]
        got = _poll_until(both, lambda: _owned(second) and len(_owned(first) | _owned(second)) == REPARTITION_PARTITIONS
                          and not _owned(first) & _owned(second))
        moved = _owned(second)
        # Incremental: the first gave up exactly what moved, never its whole assignment.
        revoked = set().union(*(parts for what, parts in first_log.events if what == "revoked"))
        assert revoked == moved and 0 < len(moved) < REPARTITION_PARTITIONS
        assert _owned(first) == kept_before - moved
        assert ("assigned", moved) in second_log.events
        assert all(m.kind == "diag-repartition" and m.header("k") == b"gpu" for m in got)
    finally:
        first.close()
        if second is not None:
            second.close()


def test_an_unknown_consumer_is_a_config_error(bus: BusConfig) -> None:
    with pytest.raises(ConfigError):
        group_consumer(bus, ["gpu"], backend="eager", group_id="g", bootstrap=None, listener=None,
                       fetch_max_wait_ms=50)
