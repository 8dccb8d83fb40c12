"""Membership without a group join (diagnosis/online/membership.py).

* the target is a pure function of the live members: every partition once, balanced per topic;
* the protocol on heartbeats alone (MemberView): a partition is taken only once no live member
  holds it (after the holder's release, or after its heartbeats stopped), a newer epoch fences;
* two MemberConsumers on the embedded broker: the second takes its share while the first keeps
  the rest (released first, then taken), and a member that dies without a word loses its
  partitions to the survivor after the timeout; with either client (kafka-python, librdkafka);
* librdkafka under the membership: an assignment that changes leaves the kept partitions where
  they are, and a commit as the group is where the next holder starts.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from kafka import TopicPartition

from faultlens.diagnosis.online.membership import (
    MemberConsumer,
    MemberView,
    assign,
    membership_mode,
)
from faultlens.errors import ConfigError
from faultlens.stream.bus import ensure_topics
from faultlens.stream.topics import REPARTITION_PARTITIONS, topic

PARTS = {"x.gpu": 8, "x.kernel": 4, "x.diag-repartition": 16, "x.stacks": 1}


def test_the_target_holds_every_partition_once_and_balances_each_topic() -> None:
    for n in range(1, 7):
        members = [f"m{i}" for i in range(n)]
        target = assign(PARTS, members)
        assert sorted(target) == sorted((t, p) for t, k in PARTS.items() for p in range(k))
        for t, k in PARTS.items():
            loads = [sum(1 for (tt, _), m in target.items() if tt == t and m == x) for x in members]
            assert max(loads) <= -(-k // n)
        assert assign(PARTS, list(reversed(members))) == target, "the order members are listed in matters"


def test_a_join_moves_a_share_not_everything() -> None:
    before = assign({"t": 16}, ["a", "b", "c"])
    after = assign({"t": 16}, ["a", "b", "c", "d"])
    moved = [s for s in before if before[s] != after[s]]
    assert 4 <= len(moved) <= 8
    assert sum(1 for m in after.values() if m == "d") == 4


def _beat(member: str, owns: dict[str, int], *, ts: float, left: bool = False, group: str = "") -> bytes:
    return json.dumps({"v": 1, "group": group, "member": member, "ts": ts, "owns": owns, "left": left}).encode()


def test_a_partition_is_taken_after_its_release_or_after_its_holder_went_silent() -> None:
    view = MemberView("b", timeout_s=2.0)
    everything = {f"t:{p}": 100 for p in range(4)}
    view.heard(_beat("a", everything, ts=1000.0), now=50.0, wall=1000.0)
    owned: dict[Any, int] = {}
    plan = view.plan(owned, {"t": 4}, now=50.1)
    assert plan.take == [] and plan.give == []  # b's share is still held by a
    # a releases b's share (a heartbeat without it): b takes it
    mine = [s for s, m in assign({"t": 4}, ["a", "b"]).items() if m == "b"]
    kept = {k: e for k, e in everything.items() if ("t", int(k.split(":")[1])) not in mine}
    view.heard(_beat("a", kept, ts=1000.2), now=50.2, wall=1000.2)
    assert view.plan(owned, {"t": 4}, now=50.3).take == mine
    # a goes silent: after the timeout b takes the rest too
    assert view.plan(owned, {"t": 4}, now=51.0).take == mine
    assert view.plan(owned, {"t": 4}, now=52.5).take == [("t", p) for p in range(4)]
    # a heartbeat read back at start-up that is older than the timeout is not a live member
    late = MemberView("c", timeout_s=2.0)
    late.heard(_beat("a", everything, ts=900.0), now=50.0, wall=1000.0)
    assert late.live(50.0) == ["c"]
    assert late.top_epoch[("t", 0)] == 100  # but its epochs count: a new claim goes above them


def test_a_member_that_left_is_gone_at_once_another_group_is_no_member_and_a_newer_epoch_fences() -> None:
    view = MemberView("b", timeout_s=2.0)
    view.heard(_beat("a", {"t:0": 5}, ts=10.0, left=True), now=1.0, wall=10.0)
    view.heard(_beat("x", {"t:0": 50}, ts=10.0, group="another-deployment"), now=1.0, wall=10.0)
    assert view.live(1.0) == ["b"]
    view.heard(_beat("c", {"t:1": 9}, ts=10.0), now=1.0, wall=10.0)
    plan = view.plan({("t", 1): 7, ("t", 0): 6}, {"t": 2}, now=1.1)
    assert plan.lose == [("t", 1)]  # c holds it with a newer epoch
    view.heard(b"not json", now=1.2, wall=10.2)
    view.heard(_beat("d", {"t:zero": 1}, ts=10.0), now=1.2, wall=10.2)
    assert view.unreadable == 2


def test_with_keys_only_a_signed_heartbeat_makes_a_member() -> None:
    """A writer of diag-members without the diagnosis key cannot claim every partition and stop diagnosis."""
    from faultlens.stream.signing import Keyring, new_key
    from tests.runner_standins import signed, signing_keyring

    view = MemberView("b", timeout_s=2.0, keyring=signing_keyring())
    forged = json.loads(_beat("mallory", {f"t:{p}": 10**15 for p in range(4)}, ts=10.0))
    view.heard(json.dumps(forged).encode(), now=1.0, wall=10.0)  # unsigned
    other = Keyring([new_key("not-ours")]).sign(forged)
    view.heard(json.dumps(other).encode(), now=1.0, wall=10.0)  # signed by a key we do not hold
    tampered = signed(json.loads(_beat("a", {"t:0": 5}, ts=10.0)))
    tampered["owns"] = {f"t:{p}": 10**15 for p in range(4)}
    view.heard(json.dumps(tampered).encode(), now=1.0, wall=10.0)
    assert view.unverified == 3 and view.live(1.0) == ["b"] and view.top_epoch == {}
    assert view.plan({("t", 0): 7}, {"t": 4}, now=1.1).lose == []  # nothing fenced it
    view.heard(json.dumps(signed(json.loads(_beat("a", {"t:0": 9}, ts=10.0)))).encode(), now=1.0, wall=10.0)
    assert view.live(1.0) == ["a", "b"] and view.plan({("t", 0): 7}, {"t": 4}, now=1.1).lose == [("t", 0)]


def test_the_mode_follows_the_broker_unless_chosen() -> None:
    assert membership_mode("auto", "127.0.0.1:9092") == "members"
    assert membership_mode("auto", "kafka-0.prod:9092") == "group"
    assert membership_mode("group", "127.0.0.1:9092") == "group"
    with pytest.raises(ConfigError, match="membership"):
        membership_mode("raft", "127.0.0.1:9092")


class _Listener:
    def __init__(self) -> None:
        self.events: list[tuple[str, list[int]]] = []

    def on_partitions_assigned(self, tps: Any) -> None:
        self.events.append(("assign", sorted(tp.partition for tp in tps)))

    def on_partitions_revoked(self, tps: Any) -> None:
        self.events.append(("revoke", sorted(tp.partition for tp in tps)))

    def on_partitions_released(self, tps: Any) -> None:
        self.events.append(("release", sorted(tp.partition for tp in tps)))


def _held(c: MemberConsumer) -> set[int]:
    return {tp.partition for tp in c.raw.assignment()}


def _poll_until(consumers: list[MemberConsumer], done: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for c in consumers:
            c.poll(20)
        if done():
            return
    raise AssertionError(f"not settled in {timeout_s} s: {[sorted(_held(c)) for c in consumers]}")


@pytest.mark.broker
@pytest.mark.parametrize("backend", ["kafka", "confluent"])
def test_a_join_splits_the_partitions_and_a_silent_death_hands_them_back(bus: Any, backend: str) -> None:
    if backend == "confluent":
        pytest.importorskip("confluent_kafka")
    ensure_topics(bus, names=["diag-repartition", "diag-members"])
    every = set(range(REPARTITION_PARTITIONS))
    kw: dict[str, Any] = {"group_id": f"{bus.topic_prefix}-g", "bootstrap": None, "heartbeat_s": 0.2,
                          "timeout_s": 1.0, "backend": backend}
    la, lb = _Listener(), _Listener()
    a = MemberConsumer(bus, ["diag-repartition"], listener=la, member_id="a", **kw)
    b = None
    try:
        _poll_until([a], lambda: _held(a) == every)
        assert la.events == [("assign", sorted(every))]
        # b restores what it takes before it fetches it (the service's changelog read)
        b = MemberConsumer(bus, ["diag-repartition"], listener=lb, member_id="b", restore_kinds=["diag-repartition"],
                           **kw)
        _poll_until([a, b], lambda: bool(lb.events) and len(_held(a)) == 8)
        name = topic("diag-repartition", bus.topic_prefix)
        share = sorted(p for (t, p), m in assign({name: REPARTITION_PARTITIONS}, ["a", "b"]).items() if m == "b")
        assert la.events[1:] == [("release", share)], "a did not release b's share before b took it"
        assert lb.events == [("assign", share)]
        assert _held(b) == set(), "b fetches a partition before its state is in"
        b.ready(TopicPartition(name, p) for p in share)
        assert sorted(_held(b)) == share and _held(a) | _held(b) == every
        b.membership.close(leave=False)  # b dies without a word (kill -9): its heartbeats stop
        started = time.monotonic()
        _poll_until([a], lambda: _held(a) == every)
        assert time.monotonic() - started >= 0.5, "a took b's partitions before b's heartbeats went stale"
        assert la.events[-1] == ("assign", share)
    finally:
        a.close()
        if b is not None:
            b._consumer.close()


@pytest.mark.broker
def test_librdkafka_keeps_positions_through_assignments_and_commits_as_the_group(bus: Any) -> None:
    pytest.importorskip("confluent_kafka")
    from faultlens.stream.bus import Producer
    from faultlens.stream.bus.librdkafka_consumer import AssignedConsumer

    ensure_topics(bus, names=["diag-repartition"])
    name = topic("diag-repartition", bus.topic_prefix)
    tp0, tp1 = TopicPartition(name, 0), TopicPartition(name, 1)

    def send(partition: int, n: int) -> None:
        with Producer(bus) as p:
            for i in range(n):
                p.send_raw("diag-repartition", "job", b"v%d" % i, partition=partition)
            p.flush(10)

    def fetch(c: AssignedConsumer, n: int) -> list[tuple[int, int]]:
        got: list[tuple[int, int]] = []
        deadline = time.monotonic() + 20
        while len(got) < n and time.monotonic() < deadline:
            got += [(m.partition, m.offset) for m in c.poll(100)]
        return sorted(got)

    send(0, 5)
    send(1, 5)
    group = f"{bus.topic_prefix}-g"
    c = AssignedConsumer(bus, ["diag-repartition"], group_id=group)
    try:
        assert c.raw.partitions_for_topic(name) == set(range(REPARTITION_PARTITIONS))
        c.raw.assign([tp0, tp1])
        assert fetch(c, 10) == [(p, o) for p in (0, 1) for o in range(5)]
        send(0, 3)
        c.raw.assign([tp0])  # partition 1 goes; partition 0 goes on from offset 5, not from the start
        assert {(tp.topic, tp.partition) for tp in c.raw.assignment()} == {(name, 0)}
        assert fetch(c, 3) == [(0, 5), (0, 6), (0, 7)]
        c.commit({(name, 0): 8})
    finally:
        c.close()
    send(0, 1)
    with AssignedConsumer(bus, ["diag-repartition"], group_id=group) as again:
        again.raw.assign([tp0])
        assert fetch(again, 1) == [(0, 8)]  # from the group's committed offset
