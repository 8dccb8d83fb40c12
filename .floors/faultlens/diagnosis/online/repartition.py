"""Repartitioner: node-keyed telemetry re-keyed by job, so one job's records reach one instance.

Input topics are keyed by node (gpu, kernel, nccl) or by job (steps, stacks).
Each diagnosis instance runs one repartitioner: a member of the group
``<diagnosis.group_id>-repartition`` over the input topics, plus a reader of
the whole jobs topic (topologies are state: node -> job). It forwards every
record, bytes untouched (no decode on this hot path), to the
``diag-repartition`` topic with key = the job, and headers that say where it
came from:

* ``k``: the record kind; ``sk``/``so``: its source key and offset, so the
  consumer drops a record forwarded twice (a repartitioner that crashed after
  forwarding and before committing) by keeping the last source offset per
  (kind, source key) in the job's checkpointed state;
* ``content-type``: passed through (MessagePack or JSON).

A topology is forwarded to its job's key before any record routed by it, so a
job's engine knows its topology before it sees the job's records.

A node that no job names yet is held briefly (``unknown_hold_s``: the topology
may be a poll behind), per node so one idle node delays nobody else; after
that its records go out keyed ``~node/<node>`` and get node-local rules only
(the "unknown" job). Offsets are committed only below the oldest held record
(``hold_back``), so a crash never loses a held record.

A round does not wait for its forwards to be acknowledged: librdkafka delivers
them while the next batches are fetched and handled, and a later round waits for
them (``settle``) once ``max_unsettled`` forwards or ``settle_after_s`` have
gathered, as does the idle loop; until then ``hold_back`` keeps their input
offsets uncommitted. A forward that fails is sent again by the next try; a crash before
the acknowledgement re-reads the records, and diagnosis drops the copies (``so``).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from faultlens import schema
from faultlens.decode import CONTENT_TYPE_HEADER
from faultlens.errors import BusError, SchemaError
from faultlens.stream.bus import Message, Producer
from faultlens.stream.topology import Topology

log = logging.getLogger(__name__)

NODE_KEYED = ("gpu", "kernel", "nccl")
# action-status: the runner's verdicts, so a refused action reaches the engine of its incident
JOB_KEYED = ("steps", "stacks", "action-status")
UNJOBBED_PREFIX = "~node/"
PASS_HEADERS = (CONTENT_TYPE_HEADER,)


def unjobbed_key(node: str) -> str:
    return UNJOBBED_PREFIX + node


class Repartitioner:
    """Forwards input messages to the repartition topic keyed by job; see the module docstring."""

    def __init__(self, producer: Producer, *, unknown_hold_s: float = 3.0, clock: Any = time.monotonic,
                 not_before_ms: int = 0):
        """``not_before_ms``: records stamped (by Kafka) earlier are skipped: a new group reads its
        topics from the start, so a slow group join loses nothing, but it does not judge history."""
        self.producer = producer
        self.not_before_ms = not_before_ms
        self.skipped_old = 0
        self.unknown_hold_s = unknown_hold_s
        self.clock = clock
        self.node_job: dict[str, str] = {}
        self.topologies: dict[str, bytes] = {}  # job -> its latest topology message value
        self._first_unknown: dict[str, float] = {}
        self._held: dict[str, collections.deque[Message]] = {}
        self.forwarded = 0
        self.unjobbed = 0
        # Forwards not yet acknowledged (settle): (message, key, source key), and per input partition the
        # oldest offset among them (commits stay below it).
        self._sent: list[tuple[Message, str, str]] = []
        self._unsettled: dict[tuple[str, int], int] = {}
        self._kind_bytes: dict[str, bytes] = {}
        self.settle_timeout_s = 30.0
        self.max_unsettled = 20_000  # forwards a round may leave unacknowledged (memory: references only)
        self.settle_after_s = 1.0  # ... and for how long at most (commits lag by that)
        self._sent_since = 0.0
        self.bad_topologies = 0
        # Where a jobs-topic message that does not decode goes (the service's ConsumeLoop.dead_letter).
        self.dead_letter: Callable[[Message, str, str], None] | None = None

    # ------------------------------------------------------------------ topologies

    def on_topology(self, m: Message) -> None:
        """A jobs-topic message: learn node -> job and forward it to the job's key first."""
        try:
            ctype = m.header(CONTENT_TYPE_HEADER)
            topo = schema.decode("jobs", m.value, content_type=ctype.decode("latin-1") if ctype else None)
        except SchemaError as exc:  # a null value, garbage, a time out of bounds: never the service's end
            self.bad_topologies += 1
            if self.dead_letter is not None:
                self.dead_letter(m, exc.reason, str(exc))
            else:
                log.warning("skipping undecodable job topology at offset %d: %s", m.offset, exc)
            return
        if self.topologies.get(topo.job) == m.value:
            return
        nodes = set(Topology.from_job(topo).nodes)
        for node, job in list(self.node_job.items()):
            if job == topo.job and node not in nodes:
                del self.node_job[node]
        for node in nodes:
            if node:
                self.node_job[node] = topo.job
                self._first_unknown.pop(node, None)
        self.topologies[topo.job] = m.value
        self._send(m, topo.job, source_key=topo.job)

    # ------------------------------------------------------------------ telemetry

    def handle(self, batch: Sequence[Message]) -> None:
        """Forward one batch (ConsumeLoop handler); held records wait. The previous round's forwards are
        settled first; this round's are acknowledged while the next batch is fetched (see the module)."""
        if len(self._sent) >= self.max_unsettled or (self._sent and self.clock() - self._sent_since
                                                       >= self.settle_after_s):
            self.settle()
        for m in batch:
            if m.timestamp_ms < self.not_before_ms:
                self.skipped_old += 1
                continue
            if m.kind in JOB_KEYED:
                self._send(m, m.key or "unknown", source_key=m.key or "")
            elif m.kind in NODE_KEYED:
                self._route(m)
            else:
                raise SchemaError(f"{m.kind} is not an input of the diagnosis", kind=m.kind)
        self.release()

    def settle(self) -> None:
        """Wait until every forward sent so far is acknowledged; BusError when some are not (they are sent
        again on the next call, and their input offsets stay uncommitted until then)."""
        if not self._sent:
            return
        try:
            self.producer.flush(self.settle_timeout_s)
        except BusError:
            again, self._sent = self._sent, []
            for m, key, source_key in again:  # copies of what did arrive are dropped downstream (``so``)
                self._send(m, key, source_key=source_key)
            raise
        self._sent = []
        self._unsettled = {}

    def try_settle(self) -> None:
        """settle, outside a round (idle, stopping): a failure is logged and tried again by the next round."""
        try:
            self.settle()
        except BusError as exc:
            log.warning("repartitioner: forwards not acknowledged (%s); sending them again", exc)

    def _route(self, m: Message) -> None:
        node = m.key or ""
        held = self._held.get(node)
        if held:
            held.append(m)
            return
        job = self.node_job.get(node)
        if job is not None:
            self._send(m, job, source_key=node)
            return
        first = self._first_unknown.setdefault(node, self.clock())
        if self.unknown_hold_s > 0 and self.clock() - first < self.unknown_hold_s:
            self._held.setdefault(node, collections.deque()).append(m)
            return
        self.unjobbed += 1
        self._send(m, unjobbed_key(node), source_key=node)

    def release(self) -> int:
        """Pass on held records whose node has a job now, or whose wait is over."""
        n = 0
        now = self.clock()
        for node in list(self._held):
            job = self.node_job.get(node)
            if job is None and now - self._first_unknown.get(node, now) < self.unknown_hold_s:
                continue
            for m in self._held.pop(node):
                self._send(m, job or unjobbed_key(node), source_key=node)
                n += 1
            if job is None:
                self.unjobbed += n
        return n

    def hold_back(self) -> dict[tuple[str, int], int]:
        """{(topic, partition): oldest held or unacknowledged offset}: commits must stay below these."""
        caps: dict[tuple[str, int], int] = dict(self._unsettled)
        for q in self._held.values():
            for m in q:
                key = (m.topic, m.partition)
                caps[key] = min(caps.get(key, m.offset), m.offset)
        return caps

    @property
    def held(self) -> int:
        return sum(len(q) for q in self._held.values())

    def _send(self, m: Message, key: str, *, source_key: str) -> None:
        kind = self._kind_bytes.get(m.kind)
        if kind is None:
            kind = self._kind_bytes[m.kind] = m.kind.encode()
        headers = [("k", kind), ("sk", source_key.encode()), ("so", str(m.offset).encode())]
        headers += [(h, v) for h, v in m.headers if h in PASS_HEADERS]
        self.producer.send_raw("diag-repartition", key, m.value, headers=headers)
        self.forwarded += 1
        if not self._sent:
            self._sent_since = self.clock()
        self._sent.append((m, key, source_key))
        where = (m.topic, m.partition)
        first = self._unsettled.get(where)
        if first is None or m.offset < first:
            self._unsettled[where] = m.offset

    def job_of_node(self, node: str) -> str:
        return self.node_job.get(node, "unknown")

