"""Per-job diagnosis state: one engine per job, checkpointed to a changelog topic keyed by job.

The Kafka Streams / Quix Streams state-store pattern, by hand: the state of
the jobs of repartition partition *p* lives in changelog partition *p* (same
partition count), one message per job key, the newest wins. A checkpoint of a
job holds:

* the engine's dynamic state (diagnosis.engine_state.EngineState: incident book,
  bursts, inhibition, guard history, counters, detectors' baselines, step
  history...), never its static parts (configuration, catalogs, workflows, the
  node-health store);
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

A checkpoint is a versioned MessagePack document (msgspec, zlib-compressed;
docs/schemas.md, "Diagnosis checkpoints"): ``{"format": "faultlens.checkpoint", "version": 2,
"key", "next_offset", "sources", "outbox", "topology", "engine": {part: ...}}``,
each part of the engine's state written by diagnosis/online/codec.py, which builds only plain
data and instances of faultlens's own classes. Nothing read back from the
changelog is ever unpickled: a checkpoint or marker that does not read (another
version, garbage, a null, an old pickle) is refused with ``CheckpointError`` and
that job (or partition marker) starts afresh; the service counts it.
"""

from __future__ import annotations

import collections
import logging
import math
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import orjson

from faultlens.config import Config
from faultlens.diagnosis.engine import DiagnosisEngine
from faultlens.diagnosis.online import codec
from faultlens.errors import BusError, FaultlensError
from faultlens.stream import topics
from faultlens.stream.bus import ensure_topics
from faultlens.stream.bus.replay_log import ReplayLog
from faultlens.stream.signing import Keyring, Unverified, unseal

log = logging.getLogger(__name__)

FORMAT = "faultlens.checkpoint"
VERSION = 2
MARK_VERSION = 1
MAX_CHECKPOINT_BYTES = 256 * 1024 * 1024  # a checkpoint inflating past this is refused (a zlib bomb)
_MSGPACK = msgspec.msgpack.Encoder()


class CheckpointError(FaultlensError):
    """A checkpoint or marker that does not read: the job (or partition) starts afresh."""


MARK_KEY = "~mark"


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


def snapshot(state: JobState) -> bytes:
    """A job's checkpoint value (see the module docstring)."""
    body = {"format": FORMAT, "version": VERSION, "key": state.key, "next_offset": state.next_offset,
            "sources": state.sources, "outbox": codec.encode(state.outbox, "outbox"),
            "topology": codec.encode(state.topology, "topology"), "engine": state.engine.state.snapshot(codec.encode)}
    return zlib.compress(_MSGPACK.encode(body), 1)


def _inflate(value: bytes) -> bytes:
    d = zlib.decompressobj()
    try:
        raw = d.decompress(value, MAX_CHECKPOINT_BYTES)
    except zlib.error as exc:
        raise CheckpointError(f"not a compressed checkpoint: {exc}") from None
    if d.unconsumed_tail:
        raise CheckpointError(f"checkpoint inflates past {MAX_CHECKPOINT_BYTES} bytes")
    return raw


def read_body(value: bytes | None) -> dict[str, Any]:
    """A checkpoint value -> its document, checked for format and version; CheckpointError if it is none."""
    if not value:
        raise CheckpointError("null or empty checkpoint")
    try:
        body = msgspec.msgpack.decode(_inflate(value))  # untyped: builtins only, whatever the bytes
    except (msgspec.DecodeError, RecursionError) as exc:
        raise CheckpointError(f"not a checkpoint document (an old pickle, or garbage): {exc}") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise CheckpointError("not a faultlens checkpoint document")
    if body.get("version") != VERSION:
        raise CheckpointError(f"checkpoint version {body.get('version')!r} is not {VERSION}")
    if type(body.get("next_offset")) is not int or body["next_offset"] < 0 or not isinstance(body.get("key"), str):
        raise CheckpointError("checkpoint without a key or a next offset")
    sources = body.get("sources")
    if not isinstance(sources, dict) or not all(type(v) is int for v in sources.values()):
        raise CheckpointError("checkpoint sources are not offsets")
    if not isinstance(body.get("engine"), dict):
        raise CheckpointError("checkpoint without engine state")
    return body


def _load_into(engine: DiagnosisEngine, value: bytes) -> dict[str, Any]:
    body = read_body(value)
    try:
        body["outbox"] = codec.decode(body.get("outbox"))
        body["topology"] = codec.decode(body.get("topology"))
        if not isinstance(body["outbox"], list) or not isinstance(body["topology"], (bytes, type(None))):
            raise CheckpointError("checkpoint outbox or topology of the wrong type")
        prior = engine.node_health.prior_blames if engine.node_health is not None else None
        engine.state.restore(body["engine"], codec.decode, prior_blames=prior)
    except (codec.CodecError, ValueError) as exc:
        raise CheckpointError(str(exc)) from None
    return body


def restore(value: bytes, partition: int, make_engine: Callable[[str], DiagnosisEngine], key: str = "") -> JobState:
    """Rebuild a JobState from its checkpoint: a fresh engine with the dynamic state put back.

    CheckpointError when the value is no checkpoint this version wrote (the caller starts the job afresh)."""
    engine = make_engine(key)
    body = _load_into(engine, value)
    return JobState(key=body["key"], partition=partition, engine=engine, next_offset=body["next_offset"],
                    sources=body["sources"], outbox=list(body["outbox"]), topology=body.get("topology"))


class EngineFactory:
    """New engines for jobs, cheaply: one prototype is built (catalogs parsed once), and each job's
    engine shares its static parts (DiagnosisEngine.fork) and starts from the prototype's blank state.

    Building a full engine per job would parse the catalogs again for every job a rebalance hands
    over, holding the service's thread (and its group heartbeats' interpreter time)."""

    def __init__(self, build: Callable[[], DiagnosisEngine]):
        self._proto = build()
        blank = JobState("", -1, self._proto)
        self._blank = snapshot(blank)

    def __call__(self, key: str = "") -> DiagnosisEngine:
        engine = self._proto.fork()
        _load_into(engine, self._blank)
        # The repartitioner routes a node's records to its job's key only once a topology named
        # the node there: that job is the honest answer for a node this engine has no topology
        # for (its state came back from a changelog a broker lost), never "unknown".
        engine.routed_job = key if key and key != "unknown" and not key.startswith("~") else None  # "~nodes/<p>": no job
        return engine


def mark_value(next_offset: int, stream_time: float) -> bytes:
    return orjson.dumps({"version": MARK_VERSION, "next_offset": next_offset, "stream_time": stream_time,
                         "wall": time.time()})


def read_mark(value: bytes | None) -> dict[str, Any]:
    """A marker value -> ``{"next_offset": int, "stream_time": float}``; CheckpointError when it is none."""
    if not value:
        raise CheckpointError("null or empty marker")
    try:
        mark = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise CheckpointError(f"marker is not JSON: {exc}") from None
    if not isinstance(mark, dict) or mark.get("version", MARK_VERSION) != MARK_VERSION:
        raise CheckpointError("not a marker of this version")
    nxt, st = mark.get("next_offset"), mark.get("stream_time", 0.0)
    if type(nxt) is not int or nxt < 0 or type(st) not in (int, float) or not math.isfinite(st):
        raise CheckpointError(f"marker with next_offset={nxt!r} stream_time={st!r}")
    return {"next_offset": nxt, "stream_time": float(st)}


@dataclass
class Restored:
    """What a changelog partition held: the newest checkpoint per key and the last marker."""

    values: dict[str, bytes]
    mark: dict[str, Any] | None
    records_read: int
    seconds: float
    offsets: dict[str, int] = field(default_factory=dict)  # key -> changelog offset of its value
    bad_marks: list[tuple[int, str]] = field(default_factory=list)  # (offset, why) of markers that did not read
    # (key, offset, why, the record's first bytes) of checkpoints, markers and tombstones whose seal did not
    # verify: never obeyed (an older record of the key that verifies stands), dead-lettered by the service
    unverified: list[tuple[str, int, str, bytes]] = field(default_factory=list)


def changelog_context(partition: int, key: str) -> bytes:
    """The place a changelog record is sealed for: a checkpoint or marker copied to another job or
    partition does not verify (a genuine marker of a busier partition would skip records here)."""
    return f"diag-changelog\0{partition}\0{key}".encode()


# Sealed records kept per key until the end of a restore, newest last: only the newest are verified
# (one Ed25519 check per job, not one per record of a changelog the broker does not compact), and a
# forged newest one falls back to an older genuine one.
CANDIDATES_PER_KEY = 3
CANDIDATE_MARKS = 64


class ChangelogReader:
    """Reads changelog partitions to their end (the restore on assignment), with one client for
    the life of the instance: a new client per restore would re-bootstrap the cluster metadata
    each time, and on Tansu that churn keeps the instance's other groups re-joining.

    The broker may not compact (Tansu does not): then a restore reads every checkpoint ever
    written to the partition, and the newest per key wins all the same."""

    def __init__(self, config: Config, bootstrap: str | None, keyring: Keyring | None = None):
        self.name = topics.topic("diag-changelog", config.bus.topic_prefix)
        # With [keys] configured every record must carry diagnosis's seal (stream.signing.seal).
        self.keyring = keyring if keyring is not None else Keyring.from_config(config.keys)
        self._bus, self._bootstrap = config.bus, bootstrap
        self._log = ReplayLog(config.bus, bootstrap, self.name, fetch_max_bytes=64 * 1024 * 1024,
                              max_partition_fetch_bytes=32 * 1024 * 1024)

    def read(self, partition: int, *, timeout_s: float = 60.0) -> Restored:
        return self.read_many([partition], timeout_s=timeout_s)[partition]

    def read_many(self, partitions: list[int], *, timeout_s: float = 60.0) -> dict[int, Restored]:
        """Several partitions in one pass (one assignment, fetches of all of them together): the
        partitions of a join or a failover come back together, not one restore after another."""
        started = time.monotonic()
        c = self._log
        values: dict[int, dict[str, bytes]] = {p: {} for p in partitions}
        offsets: dict[int, dict[str, int]] = {p: {} for p in partitions}
        bad_marks: dict[int, list[tuple[int, str]]] = {p: [] for p in partitions}
        marks: dict[int, dict[str, Any] | None] = dict.fromkeys(partitions)
        sealed: dict[tuple[int, str], collections.deque[tuple[int, bytes | None]]] = {}
        n = dict.fromkeys(partitions, 0)
        try:
            known = c.known_partitions()
            missing = [p for p in partitions if p not in known]
            if missing:
                # No such topic on the broker (a memory-only broker restarted without it): nothing
                # to restore, and asking its offsets would only wait out the client's timeout. The
                # topics are made again so that this instance's checkpoints have somewhere to go.
                log.warning("%s has no partition %s on the broker: nothing to restore", self.name, missing)
                ensure_topics(self._bus, self._bootstrap)
            tps = [p for p in partitions if p in known]
            c.assign(tps)
            ends = c.end_offsets(tps) if tps else {}
            while tps and any(c.position(tp) < ends[tp] for tp in tps):
                if time.monotonic() - started > timeout_s:
                    behind = ", ".join(f"[{tp}] {c.position(tp)}/{ends[tp]}" for tp in tps)
                    raise BusError(f"restoring {self.name} took over {timeout_s:.0f} s (read: {behind})")
                for m in c.poll(500, 5000):
                    p = m.partition
                    n[p] += 1
                    key = m.key.decode("utf-8", "replace") if m.key else ""
                    if self.keyring:
                        sealed.setdefault((p, key), collections.deque(
                            maxlen=CANDIDATE_MARKS if key == MARK_KEY else CANDIDATES_PER_KEY)).append((m.offset, m.value))
                    elif key == MARK_KEY:
                        try:
                            marks[p] = read_mark(m.value)  # the newest marker that reads wins
                        except CheckpointError as exc:
                            bad_marks[p].append((m.offset, str(exc)))
                    elif m.value is None:
                        values[p].pop(key, None)  # a tombstone: that job starts afresh
                        offsets[p].pop(key, None)
                    else:
                        values[p][key] = m.value
                        offsets[p][key] = m.offset
        except BusError as exc:
            raise BusError(f"restoring {self.name}{sorted(partitions)} failed: {exc}") from exc
        unverified: dict[int, list[tuple[str, int, str, bytes]]] = {p: [] for p in partitions}
        for (p, key), held in sealed.items():
            for offset, value in reversed(held):  # the newest record of the key that verifies wins
                try:
                    payload = unseal(self.keyring, value, changelog_context(p, key))
                    if key == MARK_KEY:
                        marks[p] = read_mark(payload)
                    else:
                        values[p][key], offsets[p][key] = payload, offset
                    break
                except Unverified as exc:
                    unverified[p].append((key, offset, f"{exc.reason}: {exc.detail}", (value or b"")[:4096]))
                except CheckpointError as exc:  # sealed by diagnosis, yet no marker of this version
                    bad_marks[p].append((offset, str(exc)))
        took = time.monotonic() - started
        return {p: Restored(values[p], marks[p], n[p], took, offsets[p], bad_marks[p], unverified[p])
                for p in partitions}

    def close(self) -> None:
        self._log.close()
