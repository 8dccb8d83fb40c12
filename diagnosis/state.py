"""Per-job diagnosis state: one engine per job, checkpointed to a changelog topic keyed by job.

The Kafka Streams / Quix Streams state-store pattern, by hand: the state of
the jobs of repartition partition *p* lives in changelog partition *p* (same
partition count), one message per job key, the newest wins. A checkpoint of a
job holds:

* the engine's dynamic state (``DYNAMIC``: incident book, bursts, inhibition,
  guard history, counters, detectors' baselines, step history...), never its
  static parts (``STATIC``: configuration, catalogs, the node-health store);
* ``next_offset``: the repartition offset after the last record applied, so a
  restore skips records the checkpoint already reflects;
* ``sources``: the last source offset per (kind, source key), so a record the
  repartitioner forwarded twice is applied once;
* ``outbox``: outputs decided but maybe not yet on the bus; a restored owner
  sends them again (same ids: the runner's ledger and the incident key make
  that harmless), so an action decided just before a crash is never lost.

Each checkpoint round ends with a marker (key ``~mark``) per partition: the
offset from which a new owner replays. Keys checkpointed in a round that did
not finish are newer than the marker and skip what they already hold.

Checkpoints are pickled (zlib-compressed): the engine's state is a graph of
Python objects that has no other serial form yet. The changelog topic is
internal: only diagnosis instances may write it (a broker ACL), as with any
Kafka Streams changelog; once the engine's state has to_dict/from_dict, the
format changes to JSON (``FORMAT`` is in every value).
"""

from __future__ import annotations

import logging
import pickle
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from faultlens.config import Config
from faultlens.diagnosis.engine import DiagnosisEngine
from faultlens.errors import BusError
from faultlens.stream import topics

log = logging.getLogger(__name__)

FORMAT = 1
MARK_KEY = "~mark"
# The engine's attributes, split: what a checkpoint carries and what a new owner builds itself.
# A dotted name carries one attribute of a part whose rest is static (CounterRules: compiled rules
# and closures are rebuilt by the new owner, its per-GPU memory is carried).
STATIC = frozenset({"config", "mode", "source", "catalog", "matcher", "policy", "node_health", "_classify", "steps_cfg",
                    "counters", "routed_job"})  # routed_job: set from the job's key by EngineFactory
DYNAMIC = ("book", "counters._gpus", "counters._present", "detectors", "guard", "aggregator", "_jobs", "_node_job", "_outputs",
           "_evicted", "now", "_final", "counts", "_last_known", "jobwide", "_classify_ctx")


def unclassified_attributes(engine: DiagnosisEngine) -> set[str]:
    """Engine attributes that are neither STATIC nor DYNAMIC (a test keeps this empty)."""
    return set(vars(engine)) - STATIC - {d.split(".", 1)[0] for d in DYNAMIC}


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _set(obj: Any, dotted: str, value: Any) -> None:
    *head, last = dotted.split(".")
    for part in head:
        obj = getattr(obj, part)
    setattr(obj, last, value)


@dataclass
class JobState:
    """One job's engine and its bookkeeping on one instance."""

    key: str
    partition: int
    engine: DiagnosisEngine
    next_offset: int = 0
    sources: dict[str, int] = field(default_factory=dict)
    outbox: list[Any] = field(default_factory=list)
    dirty: bool = False
    topology: bytes | None = None  # the topology message last applied (a repeat is skipped)

    def seen(self, kind: str, source_key: str, source_offset: int) -> bool:
        """True when this (kind, source key) record was applied already; else remember it."""
        k = f"{kind}/{source_key}"
        if source_offset <= self.sources.get(k, -1):
            return True
        self.sources[k] = source_offset
        return False


# References from the dynamic state to static parts: cut before pickling, re-made on restore (a
# per-object persistent_id hook would cost a Python call for every object of every checkpoint).
STATIC_REFS: dict[str, Callable[[DiagnosisEngine], Any]] = {
    "book.prior_blames": lambda e: e.node_health.prior_blames if e.node_health is not None else None,
}


def snapshot(state: JobState) -> bytes:
    """A job's checkpoint value (see the module docstring)."""
    engine = state.engine
    cut = {name: _get(engine, name) for name in STATIC_REFS}
    for name in cut:
        _set(engine, name, None)
    try:
        body = {"format": FORMAT, "key": state.key, "next_offset": state.next_offset, "sources": state.sources,
                "outbox": state.outbox, "topology": state.topology,
                "engine": {name: _get(engine, name) for name in DYNAMIC}}
        raw = pickle.dumps(body, protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        for name, value in cut.items():
            _set(engine, name, value)
    return zlib.compress(raw, 1)


def _load_into(engine: DiagnosisEngine, value: bytes) -> dict[str, Any]:
    body = pickle.loads(zlib.decompress(value))
    if body.get("format") != FORMAT:
        raise ValueError(f"checkpoint format {body.get('format')} is not {FORMAT}")
    for name, part in body["engine"].items():
        _set(engine, name, part)
    for name, remake in STATIC_REFS.items():
        _set(engine, name, remake(engine))
    return body


def restore(value: bytes, partition: int, make_engine: Callable[[str], DiagnosisEngine], key: str = "") -> JobState:
    """Rebuild a JobState from its checkpoint: a fresh engine with the dynamic state put back."""
    engine = make_engine(key)
    body = _load_into(engine, value)
    return JobState(key=body["key"], partition=partition, engine=engine, next_offset=body["next_offset"],
                    sources=body["sources"], outbox=list(body["outbox"]), topology=body.get("topology"))


class EngineFactory:
    """New engines for jobs, cheaply: one prototype is built (catalogs parsed once, ~30 ms), and
    each job's engine shares its static parts and starts from the prototype's blank dynamic state.

    Building a full engine per job would parse the catalogs again for every job a rebalance
    hands over, holding the service's thread (and its group heartbeats' interpreter time) for
    seconds."""

    def __init__(self, build: Callable[[], DiagnosisEngine]):
        self._proto = build()
        blank = JobState("", -1, self._proto)
        self._blank = snapshot(blank)

    def __call__(self, key: str = "") -> DiagnosisEngine:
        import copy

        engine = copy.copy(self._proto)
        engine.counters = copy.copy(self._proto.counters)  # static rules, its own per-GPU memory
        _load_into(engine, self._blank)
        # The repartitioner routes a node's records to its job's key only once a topology named
        # the node there: that job is the honest answer for a node this engine has no topology
        # for (its state came back from a changelog a broker lost), never "unknown".
        engine.routed_job = key if key and key != "unknown" and not key.startswith("~") else None  # "~nodes/<p>": no job
        return engine


def mark_value(next_offset: int, stream_time: float) -> bytes:
    return orjson.dumps({"next_offset": next_offset, "stream_time": stream_time, "wall": time.time()})


@dataclass
class Restored:
    """What a changelog partition held: the newest checkpoint per key and the last marker."""

    values: dict[str, bytes]
    mark: dict[str, Any] | None
    records_read: int
    seconds: float


class ChangelogReader:
    """Reads changelog partitions to their end (the restore on assignment), with one client for
    the life of the instance: a new client per restore would re-bootstrap the cluster metadata
    each time, and on Tansu that churn keeps the instance's other groups re-joining.

    The broker may not compact (Tansu does not): then a restore reads every checkpoint ever
    written to the partition, and the newest per key wins all the same."""

    def __init__(self, config: Config, bootstrap: str | None):
        from kafka import KafkaConsumer
        from kafka.errors import KafkaError

        from faultlens.stream.bus import client_kwargs

        self.name = topics.topic("diag-changelog", config.bus.topic_prefix)
        self._bus, self._bootstrap = config.bus, bootstrap
        try:
            self._consumer = KafkaConsumer(**client_kwargs(config.bus, bootstrap), enable_auto_commit=False,
                                           group_id=None, fetch_max_bytes=64 * 1024 * 1024,
                                           max_partition_fetch_bytes=32 * 1024 * 1024)
        except KafkaError as exc:
            raise BusError(f"cannot read {self.name}: {exc}") from exc

    def read(self, partition: int, *, timeout_s: float = 60.0) -> Restored:
        from kafka import TopicPartition
        from kafka.errors import KafkaError

        started = time.monotonic()
        c = self._consumer
        tp = TopicPartition(self.name, partition)
        values: dict[str, bytes] = {}
        mark = None
        n = 0
        try:
            known = c.partitions_for_topic(self.name)
            if not known or partition not in known:
                # No such topic on the broker (a memory-only broker restarted without it): nothing
                # to restore, and asking its offsets would only wait out the client's timeout. The
                # topics are made again so that this instance's checkpoints have somewhere to go.
                log.warning("%s has no partition %d on the broker: nothing to restore", self.name, partition)
                from faultlens.stream.bus import ensure_topics

                ensure_topics(self._bus, self._bootstrap)
                return Restored(values, mark, 0, time.monotonic() - started)
            c.assign([tp])
            c.seek_to_beginning(tp)
            end = c.end_offsets([tp])[tp]
            while c.position(tp) < end:
                if time.monotonic() - started > timeout_s:
                    raise BusError(f"restoring {self.name}[{partition}] took over {timeout_s:.0f} s "
                                   f"({c.position(tp)}/{end} read)")
                for msgs in c.poll(timeout_ms=500, max_records=5000).values():
                    for m in msgs:
                        n += 1
                        key = m.key.decode() if m.key else ""
                        if key == MARK_KEY:
                            mark = orjson.loads(m.value)
                        elif m.value is None:
                            values.pop(key, None)
                        else:
                            values[key] = m.value
        except KafkaError as exc:
            raise BusError(f"restoring {self.name}[{partition}] failed: {exc}") from exc
        return Restored(values, mark, n, time.monotonic() - started)

    def close(self) -> None:
        self._consumer.close()
