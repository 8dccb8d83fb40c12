"""Who holds which partition, without a consumer-group join: heartbeats on ``diag-members``.

Why: on the embedded broker (Tansu) every consumer-group JoinGroup waits ~2.0 s
(measured: 2.00-2.01 s for each join of benchmarks/scaleout.py, the first
member alone included), kafka-python stops fetching while a join is in flight
(even under its cooperative assignor), and librdkafka's cooperative members
lost their whole assignment there. So with the group protocol a join stopped
every job of the fleet for 2-3 s (Xid -> action p99 3.4 s while going 1 -> 2
-> 4 instances), and a kill -9 cost the session timeout (3 s) plus a join
(2 s) plus a restore: 6.2 s. Here membership is the service's own business
and the broker only stores records:

* every instance heartbeats on ``diag-members`` (key: its member id) every
  ``heartbeat_s``, and at once when what it holds changes: ``{"v": 1, "group",
  "member", "ts", "owns": {"<topic>:<partition>": epoch}, "left"}``;
* with ``[keys]`` configured, heartbeats are signed with the diagnosis key
  (stream/signing.py) and an unsigned or forged one is ignored, counted: a
  writer of the topic without the key cannot claim partitions and stop
  diagnosis; without keys (the demo, tests) they are plain JSON;
* every instance reads the whole topic: a member of its group (``group_id``)
  is live while its newest heartbeat is younger than ``timeout_s`` and does
  not say it left;
* the target (``assign``) is a pure function of the live members: per topic,
  each partition goes to the live member that ranks highest for it by a hash
  (rendezvous hashing), at most ceil(partitions / members) each. Every
  instance computes the same target from the same members; a join moves only
  what the newcomer takes (and a few to keep the balance), a leave only what
  the leaver held;
* a member gives up (``Plan.give``) a partition whose target is another
  member: its consumer stops fetching it, the service checkpoints its jobs and
  the offsets are committed, then a heartbeat without it (the release);
* a member takes (``Plan.take``) a partition whose target it is once no other
  live member's newest heartbeat holds it: right after the release, or
  ``timeout_s`` after the holder's heartbeats stopped (kill -9). The claim
  carries an epoch above every epoch seen for that partition (wall-clock
  milliseconds, so a member that did not read the old claims still goes
  above them) and is published before the first fetch;
* fencing (``Plan.lose``): a member that sees another live member hold one of
  its partitions with a higher epoch (equal: the lower member id) drops it at
  once without writing anything. Two owners can only both act between a
  paused instance's last round and its next read of this topic; what they
  would both do is harmless there: action ids are deterministic and the
  runner executes an id once, and evictions are claimed on the one guard log.

Nothing here needs a group coordinator, so it behaves the same on Tansu and on a
real Kafka (where ``diag-members`` is compacted: one record per member). The
consumers commit their offsets as ``group_id`` with manual assignment
(generation -1), which both brokers accept.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from faultlens.config import BusConfig
from faultlens.errors import BusError, ConfigError
from faultlens.stream import topics
from faultlens.stream.bus import (
    Consumer,
    Message,
    Producer,
    ensure_topics,
    is_embedded,
)
from faultlens.stream.bus.librdkafka_consumer import AssignedConsumer
from faultlens.stream.bus.replay_log import ReplayLog, topic_partitions
from faultlens.stream.signing import Keyring, Unverified

log = logging.getLogger(__name__)

Slot = tuple[str, int]  # (topic, partition)
VERSION = 1


def slot_key(slot: Slot) -> str:
    return f"{slot[0]}:{slot[1]}"


def parse_slot(text: str) -> Slot:
    topic, _, partition = text.rpartition(":")
    return topic, int(partition)


MODES = ("members", "group")


def membership_mode(mode: str, bootstrap: str | None) -> str:
    """``members`` or ``group`` for ``[diagnosis] membership`` (``auto``: members on the embedded broker)."""
    if mode not in ("auto", *MODES):
        raise ConfigError(f"diagnosis membership {mode!r} not in {('auto', *MODES)}", key="diagnosis.membership")
    if mode == "auto":
        return "members" if is_embedded(bootstrap or "") else "group"
    return mode


def default_member_id() -> str:
    """A member id unique to this process (``[diagnosis] instance_id`` gives a stable one)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _rank(topic: str, partition: int, member: str) -> int:
    digest = hashlib.blake2b(f"{topic}\0{partition}\0{member}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def assign(partitions: dict[str, int], members: Iterable[str]) -> dict[Slot, str]:
    """The target: each (topic, partition) -> a member; deterministic, balanced per topic, sticky."""
    ms = sorted(set(members))
    out: dict[Slot, str] = {}
    if not ms:
        return out
    for topic in sorted(partitions):
        n = partitions[topic]
        cap = -(-n // len(ms))
        load = dict.fromkeys(ms, 0)
        for p in range(n):
            for m in sorted(ms, key=lambda m: _rank(topic, p, m), reverse=True):
                if load[m] < cap:
                    out[(topic, p)] = m
                    load[m] += 1
                    break
    return out


@dataclass
class Beat:
    """A member's newest heartbeat as this instance heard it."""

    member: str
    owns: dict[Slot, int]
    left: bool
    sent: float  # local monotonic time it was sent, as far as this instance can tell


@dataclass
class Plan:
    """What a member should do now: take, give up (checkpoint first) or drop (fenced) partitions."""

    take: list[Slot] = field(default_factory=list)
    give: list[Slot] = field(default_factory=list)
    lose: list[Slot] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.take or self.give or self.lose)


class MemberView:
    """The other members' newest heartbeats; pure (no I/O), so the protocol is testable alone."""

    def __init__(self, me: str, timeout_s: float, group: str = "", keyring: Keyring | None = None):
        self.me = me
        # With keys configured only heartbeats signed by a diagnosis key count: anyone else who can
        # write the topic could otherwise claim every partition with a high epoch and stop diagnosis.
        self.keyring = keyring if keyring else None
        self.unverified = 0
        self._target: tuple[Any, dict[Slot, str]] | None = None  # (members and partitions, assign() of them)
        self.group = group  # heartbeats of another group on the same topic are not members
        self.timeout_s = timeout_s
        self.beats: dict[str, Beat] = {}
        self.top_epoch: dict[Slot, int] = {}
        self.unreadable = 0

    def heard(self, value: bytes | None, *, now: float, wall: float) -> None:
        """One record of the members topic (``now``: monotonic, ``wall``: time.time() at receipt)."""
        try:
            beat = json.loads(value or b"")
            if self.keyring is not None:
                try:
                    self.keyring.verify(beat)
                except Unverified as exc:
                    self.unverified += 1
                    if self.unverified <= 3 or self.unverified % 1000 == 0:
                        log.warning("membership: heartbeat ignored (%s: %s; %d so far): %r", exc.reason, exc.detail,
                                    self.unverified, (value or b"")[:200])
                    return
            member = str(beat["member"])
            owns = {parse_slot(k): int(e) for k, e in dict(beat.get("owns") or {}).items()}
            age = max(0.0, wall - float(beat["ts"]))  # a record read back at start-up is old
            left = bool(beat.get("left", False))
            group = str(beat.get("group", ""))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            self.unreadable += 1
            log.warning("membership: unreadable heartbeat %r: %s", (value or b"")[:200], exc)
            return
        if group != self.group:
            return
        for slot, epoch in owns.items():
            self.top_epoch[slot] = max(self.top_epoch.get(slot, 0), epoch)
        if member == self.me:
            return  # an earlier life of this instance (static id): what it holds now is its own business
        self.beats[member] = Beat(member, owns, left, now - age)

    def live(self, now: float) -> list[str]:
        """Live members, this one included, sorted."""
        others = [b.member for b in self.beats.values() if not b.left and now - b.sent < self.timeout_s]
        return sorted({self.me, *others})

    def holders(self, slot: Slot, now: float) -> list[tuple[int, str]]:
        """(epoch, member) of every other live member whose newest heartbeat holds ``slot``."""
        return [(b.owns[slot], b.member) for b in self.beats.values()
                if slot in b.owns and not b.left and now - b.sent < self.timeout_s]

    def plan(self, owned: dict[Slot, int], partitions: dict[str, int], now: float) -> Plan:
        # Called at every poll: the target is hashed again only when the members or partitions change.
        key = (tuple(sorted(partitions.items())), tuple(self.live(now)))
        if self._target is None or self._target[0] != key:
            self._target = (key, assign(partitions, key[1]))
        target = self._target[1]
        out = Plan()
        for slot, epoch in sorted(owned.items()):
            if any(e > epoch or (e == epoch and m < self.me) for e, m in self.holders(slot, now)):
                out.lose.append(slot)
            elif target.get(slot) != self.me:
                out.give.append(slot)
        for slot, member in sorted(target.items()):
            if member == self.me and slot not in owned and not self.holders(slot, now):
                out.take.append(slot)
        return out


class Membership:
    """This instance's heartbeats and its view of the others (a thread); see the module docstring."""

    def __init__(self, bus: BusConfig, bootstrap: str | None, member_id: str, *, group: str = "",
                 heartbeat_s: float = 0.5, timeout_s: float = 2.0, keyring: Keyring | None = None):
        self.me = member_id
        self.heartbeat_s = heartbeat_s
        self.topic = topics.topic("diag-members", bus.topic_prefix)
        self.group = group
        self.view = MemberView(member_id, timeout_s, group, keyring)
        self._signer = keyring if keyring and keyring.can_sign else None
        self.owned: dict[Slot, int] = {}
        self.ready = threading.Event()
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._last_beat = 0.0
        self._bus, self._bootstrap = bus, bootstrap
        # A heartbeat never blocks for long: a broker without the topic (a memory-only broker that
        # restarted) makes it again (_publish) rather than wait out kafka-python's 60 s.
        self._producer = Producer(bus, bootstrap, linger_ms=0, max_block_ms=2000)
        try:
            self._reader = ReplayLog(bus, bootstrap, self.topic, fetch_max_wait_ms=50, fetch_min_bytes=1)
            self._reader.assign([0])
        except BusError as exc:
            self._producer.close()
            raise BusError(f"cannot read {self.topic}: {exc}") from exc
        self._thread = threading.Thread(target=self._run, name="faultlens-members", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._catch_up()
            self._publish()
            self.ready.set()
            while not self._stop.is_set():
                self._read(int(self.heartbeat_s * 500))
                if time.monotonic() - self._last_beat >= self.heartbeat_s:
                    self._publish()
        except Exception:  # noqa: BLE001 - a dead heartbeat thread must be loud: the others take over
            log.exception("membership: the heartbeat thread stopped")

    def _catch_up(self, timeout_s: float = 30.0) -> None:
        """Read what the topic holds before the first heartbeat: the members live now and the epochs.
        The fetch's high watermark says where the end is (Tansu's ListOffsets does not)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            self._read(100)
            hw = self._reader.highwater(0)
            if hw is not None and self._reader.position(0) >= hw:
                return
        log.warning("membership: %s not read to its end in %.0f s; going on", self.topic, timeout_s)

    def _read(self, timeout_ms: int) -> None:
        try:
            got = self._reader.poll(timeout_ms, 5000)
        except BusError as exc:
            log.warning("membership: reading %s failed: %s", self.topic, exc)
            time.sleep(timeout_ms / 1000)
            return
        now, wall = time.monotonic(), time.time()
        with self._lock:
            for m in got:
                self.view.heard(m.value, now=now, wall=wall)
        hw = self._reader.highwater(0)
        if not got and hw is not None and self._reader.position(0) > hw:
            # Past the end of the log: the broker lost it (restarted empty); read the new one.
            log.warning("membership: %s went back to offset %d; reading it from the start", self.topic, hw)
            self._reader.rewind([0])

    def _publish(self, *, left: bool = False) -> None:
        with self._lock:
            beat: dict[str, Any] = {"v": VERSION, "group": self.group, "member": self.me, "ts": time.time(),
                                    "left": left, "owns": {slot_key(s): e for s, e in sorted(self.owned.items())}}
            if self._signer is not None:
                beat = self._signer.sign(beat)
            value = json.dumps(beat).encode()
            self._last_beat = time.monotonic()
        try:
            self._producer.send_raw("diag-members", self.me, value, partition=0)
            self._producer.flush(5.0)
        except BusError as exc:
            log.warning("membership: heartbeat not sent (%s); making %s again", exc, self.topic)
            try:
                ensure_topics(self._bus, self._bootstrap, names=["diag-members"])
            except BusError as again:
                log.warning("membership: %s", again)

    def plan(self, partitions: dict[str, int]) -> Plan:
        if not self.ready.is_set():
            return Plan()
        with self._lock:
            return self.view.plan(dict(self.owned), partitions, time.monotonic())

    def took(self, slots: Iterable[Slot]) -> None:
        """Claim ``slots`` (published before the caller fetches them)."""
        now_ms = int(time.time() * 1000)
        with self._lock:
            for s in slots:
                self.owned[s] = max(now_ms, self.view.top_epoch.get(s, 0) + 1)
                self.view.top_epoch[s] = self.owned[s]
        self._publish()

    def gave(self, slots: Iterable[Slot]) -> None:
        """Released (or lost) ``slots``: a heartbeat without them lets their next holder take them."""
        with self._lock:
            for s in slots:
                self.owned.pop(s, None)
        self._publish()

    def live(self) -> list[str]:
        with self._lock:
            return self.view.live(time.monotonic())

    def close(self, *, leave: bool = True) -> None:
        """Stop heartbeating; ``leave``: say so, so the others take over at once (a clean stop)."""
        self._stop.set()
        self._thread.join(5.0)
        if leave:
            with self._lock:
                self.owned.clear()
            self._publish(left=True)
        self._producer.close()
        self._reader.close()


class MemberConsumer:
    """A consumer over ``kinds`` whose partitions ``Membership`` decides, with the interface
    ``ConsumeLoop`` and the service use (``poll``, ``commit``, ``close``, ``raw``), and the
    listener told on the polling thread: ``on_partitions_assigned`` (taken),
    ``on_partitions_released`` (given up: checkpoint, then let go) and ``on_partitions_revoked``
    (lost to a fence: drop, write nothing).

    A partition of ``restore_kinds`` is fetched only once the service calls ``ready`` (its state
    is restored): never fetched and then paused, because kafka-python parks a paused partition's
    fetched records and, on a busy consumer, may not fetch that partition again for many seconds
    (measured: 20 s on the full benchmark). A release stops fetching at once; the heartbeat
    without the partition goes out at the next poll, after the service's round has checkpointed
    its jobs, so the next holder restores what this one last decided."""

    def __init__(self, bus: BusConfig, kinds: Iterable[str], *, group_id: str, bootstrap: str | None,
                 listener: Any, member_id: str, restore_kinds: Iterable[str] = (), fetch_max_wait_ms: int = 100,
                 heartbeat_s: float = 0.5, timeout_s: float = 2.0, keyring: Keyring | None = None,
                 backend: str = "kafka"):
        """``backend``: the client that fetches (stream.bus.librdkafka_consumer.consumer_backend): ``kafka`` (kafka-python)
        or ``confluent`` (librdkafka, stream.bus.librdkafka_consumer.AssignedConsumer)."""
        self.listener = listener
        self._consumer: Any
        if backend == "confluent":

            self._consumer = AssignedConsumer(bus, kinds, group_id=group_id, bootstrap=bootstrap,
                                              fetch_max_wait_ms=fetch_max_wait_ms)
        else:
            self._consumer = Consumer(bus, kinds, group_id=group_id, bootstrap=bootstrap, from_beginning=True,
                                      manual=True, fetch_max_wait_ms=fetch_max_wait_ms)
        self.topics = self._consumer.topics
        self._restore_topics = {topics.topic(k, bus.topic_prefix) for k in restore_kinds}
        try:
            self.membership = Membership(bus, bootstrap, member_id, group=group_id, heartbeat_s=heartbeat_s,
                                         timeout_s=timeout_s, keyring=keyring)
        except BusError:
            self._consumer.close()
            raise
        self._releasing: set[Slot] = set()  # given up, their heartbeat not sent yet
        self._waiting: set[Slot] = set()  # taken, not fetched until ready()
        self._partitions: dict[str, int] = {}
        self._partitions_at = 0.0

    @property
    def raw(self) -> Any:
        return self._consumer.raw

    @property
    def resets(self) -> int:
        """Partitions whose log went back under the consumer (stream.bus.Consumer.resets; 0 with librdkafka)."""
        return int(getattr(self._consumer, "resets", 0))

    def _partition_counts(self) -> dict[str, int]:
        if time.monotonic() - self._partitions_at > 10.0 or not self._partitions:
            raw = self._consumer.raw
            counts = {t: len(raw.partitions_for_topic(t) or ()) for t in self.topics}
            self._partitions = {t: n for t, n in counts.items() if n}
            self._partitions_at = time.monotonic()
        return self._partitions

    def _assign(self) -> None:
        """Fetch what this member holds, less what waits for its state and what it is letting go."""
        self._consumer.raw.assign(self._tps(set(self.membership.owned) - self._waiting - self._releasing))

    def _tps(self, slots: Iterable[Slot]) -> list[Any]:
        return [tp for t, p in sorted(slots) for tp in topic_partitions(t, [p])]

    def ready(self, tps: Iterable[Any]) -> None:
        """Partitions whose state is in: fetch them from now on."""
        slots = {(tp.topic, tp.partition) for tp in tps} & self._waiting
        if slots:
            self._waiting -= slots
            self._assign()

    def rebalance(self) -> None:
        """Apply what the membership says (called at each poll)."""
        m = self.membership
        if self._releasing:
            m.gave(self._releasing)
            log.info("membership: %s released %s", m.me, sorted(self._releasing))
            self._releasing = set()
        plan = m.plan(self._partition_counts())
        if not plan:
            return
        if plan.lose:
            log.warning("membership: %s fenced off %s (another member holds them with a newer epoch)", m.me,
                        plan.lose)
            m.gave(plan.lose)
            self._waiting -= set(plan.lose)
            self._assign()
            self.listener.on_partitions_revoked(self._tps(plan.lose))
        if plan.give:
            self._releasing = set(plan.give)
            self._waiting -= self._releasing
            self._assign()
            released = getattr(self.listener, "on_partitions_released", self.listener.on_partitions_revoked)
            released(self._tps(plan.give))
        if plan.take:
            m.took(plan.take)
            self._waiting |= {s for s in plan.take if s[0] in self._restore_topics}
            self._assign()
            log.info("membership: %s took %s (live: %s)", m.me, plan.take, m.live())
            self.listener.on_partitions_assigned(self._tps(plan.take))

    def poll(self, timeout_ms: int = 500, max_records: int = 10_000) -> list[Message]:
        self.rebalance()
        return self._consumer.poll(timeout_ms, max_records)

    def commit(self, offsets: dict[tuple[str, int], int] | None = None) -> None:
        self._consumer.commit(offsets)

    def close(self) -> None:
        """Stop heartbeating and say so (the others take over at once), then close the consumer."""
        self.membership.close(leave=True)
        self._consumer.close()
