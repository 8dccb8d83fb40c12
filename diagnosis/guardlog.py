"""Caps that hold across decisions, jobs and instances: the guard log.

An eviction is *claimed* on one ordered log of guard events before it goes out.
Every holder of the log folds the same events in the same order (``GuardBook``),
so every diagnosis instance agrees which claims were granted, which breaker is
open and since when, without talking to each other:

* ``claim``  an eviction decision: job, nodes, event time, the job's size, the
             caps it was made under (so a reader with other settings, such as
             ``faultlens guard status``, judges it alike), and the claim id (the
             action id, deterministic: a replayed decision re-claims under the
             same id and gets its first verdict back);
* ``reset``  a person's reset (``faultlens guard reset --job J`` / ``--fleet``):
             who, when, why; it closes the breaker and starts that count afresh;
* ``trip``   a breaker tripped by something outside the fold (a broker that lost
             the log gets the open breakers back from an instance's file).

What the fold enforces (``[guard]`` in faultlens.config):

* per job: distinct nodes granted within the last hour of event time, counted
  across decisions, at most ``min(max_evictions_per_job_per_hour,
  max(1, floor(max_evicted_fraction x job nodes)))``; a claim past it is refused
  and trips the job's breaker;
* fleet: distinct nodes granted within the last hour over every job at most
  ``max_evictions_fleet_per_hour``; a claim past it trips the fleet breaker;
* storm: ``storm_nodes`` distinct nodes claimed within ``storm_window_s`` is the
  fabric, not the machines: refused, fleet breaker tripped;
* an open breaker refuses every eviction in its scope until a person resets it.

Two logs: ``LocalGuardLog`` (one process: batch diagnosis, tests; optionally a
JSON-lines file, so breakers survive a restart and ``faultlens guard`` can read
and reset them) and ``KafkaGuardLog`` (online: the one-partition topic
``diag-guard``, read from its start by every instance; a claim is produced, then
the topic is read up to it, so two instances claiming at once are ordered by the
broker and the second sees the first). A guard log that cannot be reached
refuses the eviction (fail closed) with reason ``guard_unavailable``.
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson

from faultlens.config import BusConfig, GuardConfig
from faultlens.errors import BusError
from faultlens.files import replace_lines
from faultlens.stream import topics
from faultlens.stream.bus import Producer, ensure_topics
from faultlens.stream.bus.replay_log import ReplayLog

log = logging.getLogger(__name__)

HOUR_S = 3600.0
UNKNOWN_JOB = "unknown"  # the engine's job for nodes no topology names


def job_cap(c: GuardConfig, job_nodes: int) -> int:
    """The most distinct machines one job may lose to evictions within an hour (its blast radius)."""
    return min(c.max_evictions_per_job_per_hour, max(1, math.floor(c.max_evicted_fraction * job_nodes)))


GUARD_TOPIC = "diag-guard"
# Why an action was not taken as decided (faultlens_actions_suppressed_total{reason}, incident.suppressed).
SUPPRESSION_REASONS = ("duplicate", "confidence", "job_cap", "fleet_cap", "breaker", "storm", "guard_unavailable",
                       "runner_refused", "stale")
MAX_VERDICTS = 20_000  # claim ids remembered for replays (oldest forgotten first)
MAX_RESETS = 50
MAX_SEEN = 200_000  # event ids remembered: a compacted file or a re-read topic folds nothing twice


@dataclass(frozen=True)
class ClaimVerdict:
    granted: bool
    reason: str = ""  # one of SUPPRESSION_REASONS when refused
    text: str = ""


def new_event(type_: str, **fields: Any) -> dict[str, Any]:
    """A guard event with a unique id and the wall time and host it was written on."""
    return {"eid": uuid.uuid4().hex, "type": type_, "wall": time.time(), "host": socket.gethostname(), **fields}


class GuardBook:
    """The fold: guard events in log order -> breakers, counted evictions, verdicts. No I/O."""

    def __init__(self, config: GuardConfig):
        self.config = config
        self.fleet_grants: list[tuple[float, str, str]] = []  # (ts, job, node), since the last fleet reset
        self.job_grants: dict[str, list[tuple[float, str]]] = {}  # job -> (ts, node), since the job's last reset
        self.claimed: list[tuple[float, str]] = []  # (ts, first node) of every claim: the storm's count
        self.fleet_breaker: dict[str, Any] | None = None
        self.job_breakers: dict[str, dict[str, Any]] = {}
        self.verdicts: dict[str, ClaimVerdict] = {}
        self.resets: list[dict[str, Any]] = []
        self.counts: dict[str, int] = {"claims": 0, "granted": 0, "refused": 0, "resets": 0, "trips": 0}
        self._seen: dict[str, None] = {}  # event ids folded, oldest first (MAX_SEEN kept)
        self._newest_ts = 0.0

    def apply(self, event: dict[str, Any]) -> None:
        """Fold one event; an event seen before (same ``eid``) and an unknown type change nothing."""
        eid = str(event.get("eid", ""))
        if not eid or eid in self._seen:
            return
        self._seen[eid] = None
        if len(self._seen) > MAX_SEEN:
            del self._seen[next(iter(self._seen))]
        kind = event.get("type")
        if kind == "claim":
            self._claim(event)
        elif kind == "reset":
            self._reset(event)
        elif kind == "trip":
            self._trip(str(event.get("scope", "fleet")), str(event.get("job") or ""), str(event.get("reason", "")),
                       float(event.get("ts", 0.0)), event)

    # ------------------------------------------------------------------ the fold

    def _claim(self, ev: dict[str, Any]) -> None:
        claim_id = str(ev.get("claim", ev["eid"]))
        if claim_id in self.verdicts:
            return  # the same action claimed again (a replay): its first verdict stands
        job, nodes, ts = str(ev.get("job", "")), tuple(sorted(str(n) for n in ev.get("nodes") or ())), float(ev["ts"])
        job_nodes = max(1, int(ev.get("job_nodes") or len(nodes) or 1))
        self._newest_ts = max(self._newest_ts, ts)
        self._forget_before(self._newest_ts - 2 * HOUR_S)
        verdict = self._judge(job, nodes, ts, job_nodes, _caps(ev.get("caps"), self.config))
        self.counts["claims"] += 1
        self.counts["granted" if verdict.granted else "refused"] += 1
        self.verdicts[claim_id] = verdict
        if len(self.verdicts) > MAX_VERDICTS:
            del self.verdicts[next(iter(self.verdicts))]
        if verdict.granted:
            self.fleet_grants.extend((ts, job, n) for n in nodes)
            self.job_grants.setdefault(job, []).extend((ts, n) for n in nodes)

    def _judge(self, job: str, nodes: tuple[str, ...], ts: float, job_nodes: int, c: GuardConfig) -> ClaimVerdict:
        if self.fleet_breaker is not None:
            return ClaimVerdict(False, "breaker", f"fleet breaker open ({self.fleet_breaker['reason']}); a person "
                                "resets it: faultlens guard reset --fleet")
        if job in self.job_breakers:
            return ClaimVerdict(False, "breaker", f"job breaker open ({self.job_breakers[job]['reason']}); a person "
                                f"resets it: faultlens guard reset --job {job}")
        if nodes:
            self.claimed.append((ts, nodes[0]))
        blamed = {n for t, n in self.claimed if ts - c.storm_window_s <= t}
        if len(blamed) >= c.storm_nodes:
            why = f"storm: {len(blamed)} nodes blamed within {c.storm_window_s:.0f} s"
            self._trip("fleet", "", why, ts, None)
            return ClaimVerdict(False, "storm", why)
        in_job = {n for t, n in self.job_grants.get(job, ()) if ts - HOUR_S < t}
        allowed = job_cap(c, job_nodes)
        # Nodes outside any job ("unknown") are not one job: only the fleet cap counts them.
        if job != UNKNOWN_JOB and len(in_job | set(nodes)) > allowed:
            why = (f"job cap: {len(in_job | set(nodes))} of {job_nodes} nodes within an hour > {allowed} "
                   f"(guard.max_evictions_per_job_per_hour {c.max_evictions_per_job_per_hour}, "
                   f"guard.max_evicted_fraction {c.max_evicted_fraction:.0%}; already evicted: "
                   f"{', '.join(sorted(in_job)) or 'none'})")
            self._trip("job", job, why, ts, None)
            return ClaimVerdict(False, "job_cap", why)
        in_fleet = {n for t, _, n in self.fleet_grants if ts - HOUR_S < t}
        if len(in_fleet | set(nodes)) > c.max_evictions_fleet_per_hour:
            why = (f"fleet cap: {len(in_fleet | set(nodes))} nodes within an hour > "
                   f"guard.max_evictions_fleet_per_hour {c.max_evictions_fleet_per_hour}")
            self._trip("fleet", "", why, ts, None)
            return ClaimVerdict(False, "fleet_cap", why)
        return ClaimVerdict(True)

    def _trip(self, scope: str, job: str, reason: str, ts: float, event: dict[str, Any] | None) -> None:
        entry = {"reason": reason, "since_ts": ts, "wall": (event or {}).get("wall", time.time())}
        if scope == "job":
            if job in self.job_breakers:
                return
            self.job_breakers[job] = entry
        else:
            if self.fleet_breaker is not None:
                return
            self.fleet_breaker = entry
        self.counts["trips"] += 1

    def _reset(self, ev: dict[str, Any]) -> None:
        scope, job = str(ev.get("scope", "")), str(ev.get("job") or "")
        if scope == "fleet":
            self.fleet_breaker = None
            self.fleet_grants.clear()
            self.claimed.clear()
        elif scope == "job" and job:
            self.job_breakers.pop(job, None)
            self.job_grants.pop(job, None)
        else:
            return
        self.counts["resets"] += 1
        self.resets.append({k: ev.get(k) for k in ("scope", "job", "by", "reason", "wall", "host")})
        del self.resets[:-MAX_RESETS]

    def _forget_before(self, ts: float) -> None:
        self.fleet_grants = [g for g in self.fleet_grants if g[0] >= ts]
        self.claimed = [g for g in self.claimed if g[0] >= ts]
        for job in list(self.job_grants):
            kept = [g for g in self.job_grants[job] if g[0] >= ts]
            if kept:
                self.job_grants[job] = kept
            else:
                del self.job_grants[job]

    # ------------------------------------------------------------------ views

    def status(self) -> dict[str, Any]:
        """Breakers, the counts within the newest hour, recent resets (``faultlens guard status``)."""
        ts = self._newest_ts
        in_fleet = sorted({n for t, _, n in self.fleet_grants if ts - HOUR_S < t})
        jobs = {j: sorted({n for t, n in g if ts - HOUR_S < t}) for j, g in self.job_grants.items()}
        return {"fleet_breaker": self.fleet_breaker, "job_breakers": dict(self.job_breakers),
                "evicted_last_hour": {"fleet": in_fleet, "jobs": {j: n for j, n in jobs.items() if n}},
                "caps": {"max_evictions_fleet_per_hour": self.config.max_evictions_fleet_per_hour,
                         "max_evictions_per_job_per_hour": self.config.max_evictions_per_job_per_hour,
                         "max_evicted_fraction": self.config.max_evicted_fraction,
                         "storm_nodes": self.config.storm_nodes, "storm_window_s": self.config.storm_window_s},
                "newest_claim_ts": ts, "resets": list(self.resets), "counts": dict(self.counts)}

    def open_breakers(self) -> list[dict[str, Any]]:
        """Trip events that re-create the open breakers (a broker that lost the log gets them back)."""
        out = []
        if self.fleet_breaker is not None:
            out.append(new_event("trip", scope="fleet", reason=self.fleet_breaker["reason"],
                                 ts=self.fleet_breaker["since_ts"]))
        for job, b in self.job_breakers.items():
            out.append(new_event("trip", scope="job", job=job, reason=b["reason"], ts=b["since_ts"]))
        return out


class GuardLog(Protocol):
    """Where claims and resets are ordered: ``LocalGuardLog`` or ``KafkaGuardLog``."""

    book: GuardBook

    def claim(self, claim_id: str, *, job: str, nodes: Iterable[str], ts: float, job_nodes: int) -> ClaimVerdict: ...

    def reset(self, scope: str, *, job: str = "", by: str = "", reason: str = "") -> dict[str, Any]: ...

    def refresh(self) -> None: ...


CAP_KEYS = ("max_evictions_fleet_per_hour", "max_evictions_per_job_per_hour", "max_evicted_fraction", "storm_nodes",
            "storm_window_s")


def _caps(given: Any, default: GuardConfig) -> GuardConfig:
    """The caps a claim was made under (they travel with it, so every reader judges it alike)."""
    if not isinstance(given, dict):
        return default
    import dataclasses

    kept = {k: type(getattr(default, k))(given[k]) for k in CAP_KEYS if k in given}
    return dataclasses.replace(default, **kept)


def _claim_event(claim_id: str, job: str, nodes: Iterable[str], ts: float, job_nodes: int,
                 config: GuardConfig) -> dict[str, Any]:
    return new_event("claim", claim=claim_id, job=job, nodes=sorted(nodes), ts=ts, job_nodes=job_nodes,
                     caps={k: getattr(config, k) for k in CAP_KEYS})


def reset_event(scope: str, *, job: str = "", by: str = "", reason: str = "") -> dict[str, Any]:
    """A person's reset; ``scope`` is "fleet" or "job" (then ``job`` names it)."""
    if scope not in ("fleet", "job") or (scope == "job" and not job):
        raise ValueError("a reset is --fleet or --job J")
    return new_event("reset", scope=scope, job=job, by=by or os.environ.get("USER", "unknown"), reason=reason)


class LocalGuardLog:
    """The guard log of one process; with ``path``, a JSON-lines file appended per event (fsynced),
    replayed at start and re-read by ``refresh`` (a reset written by ``faultlens guard reset``).

    Bounded: at start, and past twice what the last compaction left plus ``COMPACT_SLACK`` events, the file is
    rewritten to what the fold still needs (``compact``): every event from the first claim inside
    the caps' look-back (two hours of event time, as ``GuardBook`` keeps) on, the last
    ``MAX_RESETS`` resets before it (``guard status`` lists them), and a trip for each breaker
    still open that those would not re-open. Appends and the rewrite hold ``<path>.lock``; a reader
    that finds a new file reads it from its start (events it has folded are skipped by id). A file is
    known by its inode and its first line, which a rewrite makes a new ``generation`` event: a
    filesystem reuses a replaced file's inode at once, so the inode alone would have a holder read
    a rewritten file from its old offset and miss what was appended (a reset)."""

    COMPACT_SLACK = 2000

    def __init__(self, config: GuardConfig, path: str | os.PathLike[str] = ""):
        self.book = GuardBook(config)
        self.path = Path(path) if path else None
        self._read_bytes = 0
        self._ident: tuple[int, bytes] = (0, b"")  # the file read: its inode and first line
        self._events = 0  # events in the file as read
        self._compacted = 0  # events the last compaction left
        self.compactions = 0
        self.bad_lines = 0
        self.refresh()
        self._compacted = self._events
        if self._events:  # a start rewrites the file to what the fold still needs
            self.compact()

    def refresh(self) -> None:
        if self.path is None or not self.path.exists():
            return
        with self.path.open("rb") as f:
            ident = (os.fstat(f.fileno()).st_ino, f.readline(1024))
            if ident != self._ident:  # compacted (by this process or another): read the new file whole
                self._ident, self._read_bytes, self._events = ident, 0, 0
            f.seek(self._read_bytes)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a half-written last line waits for its end
        for line in data[:end].splitlines():
            if not line.strip():
                continue
            self._events += 1
            try:
                event = orjson.loads(line)
                if isinstance(event, dict):
                    self.book.apply(event)
                    continue
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                pass
            self.bad_lines += 1
            log.error("guard log %s: unreadable line skipped: %r", self.path, line[:200])
        self._read_bytes += end

    def read_to_end(self, timeout_s: float = 0.0) -> bool:
        self.refresh()
        return True

    def _locked(self) -> Any:
        """An exclusive lock on ``<path>.lock`` for an append or a rewrite (closing the file frees it)."""
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path.with_name(self.path.name + ".lock"), "ab")  # noqa: SIM115 - closed by the caller's with
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        return f

    def _append(self, event: dict[str, Any]) -> None:
        if self.path is not None:
            with self._locked():
                self.refresh()  # another process's events first: the file is the order
                with self.path.open("ab") as f:
                    f.write(orjson.dumps(event) + b"\n")
                    f.flush()
                    os.fsync(f.fileno())
                self.refresh()
                if self._events > 2 * self._compacted + self.COMPACT_SLACK:
                    self._compact_locked()
        else:
            self.book.apply(event)

    def compact(self) -> bool:
        """Rewrite the file to what the fold still needs; False when there is no file or the rewrite
        would fold differently (then it is left as it is, and said)."""
        if self.path is None or not self.path.exists():
            return False
        with self._locked():
            self.refresh()
            return self._compact_locked()

    def _compact_locked(self) -> bool:
        assert self.path is not None
        events = []
        for line in self.path.read_bytes().splitlines():
            try:
                event = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(event, dict):
                events.append(event)
        horizon = self.book._newest_ts - 2 * HOUR_S
        start = next((i for i, e in enumerate(events) if e.get("type") == "claim" and float(e.get("ts") or 0.0) >= horizon),
                     len(events))
        head = [e for e in events[:start] if e.get("type") == "reset"][-MAX_RESETS:]
        kept = events[start:]
        again = _fold(self.book.config, head + kept)
        trips = [t for t in self.book.open_breakers()
                 if (t["scope"] == "fleet" and again.fleet_breaker is None)
                 or (t["scope"] == "job" and t["job"] not in again.job_breakers)]
        out = [{"type": "generation", "gen": uuid.uuid4().hex}] + head + trips + kept  # no eid: never folded
        if trips:
            again = _fold(self.book.config, out)
        if _view(again) != _view(self.book):
            log.error("guard log %s: a compaction would fold differently; the file is kept whole", self.path)
            self._compacted = self._events
            return False
        replace_lines(self.path, (orjson.dumps(e) for e in out))
        for t in trips:
            self.book._seen[t["eid"]] = None
        with self.path.open("rb") as f:
            self._ident = (os.fstat(f.fileno()).st_ino, f.readline(1024))
            self._read_bytes, self._events = os.fstat(f.fileno()).st_size, len(out)
        self._compacted = len(out)
        self.compactions += 1
        return True

    def claim(self, claim_id: str, *, job: str, nodes: Iterable[str], ts: float, job_nodes: int) -> ClaimVerdict:
        if claim_id in self.book.verdicts:
            return self.book.verdicts[claim_id]
        self._append(_claim_event(claim_id, job, nodes, ts, job_nodes, self.book.config))
        return self.book.verdicts.get(claim_id, ClaimVerdict(False, "guard_unavailable", "claim not in the guard log"))

    def reset(self, scope: str, *, job: str = "", by: str = "", reason: str = "") -> dict[str, Any]:
        event = reset_event(scope, job=job, by=by, reason=reason)
        self._append(event)
        return event


def _fold(config: GuardConfig, events: list[dict[str, Any]]) -> GuardBook:
    book = GuardBook(config)
    for e in events:
        book.apply(e)
    return book


def _view(book: GuardBook) -> tuple[Any, ...]:
    """What a compaction must keep: the open breakers and the evictions the caps still count."""
    st = book.status()
    return (book.fleet_breaker is not None, sorted(book.job_breakers), st["evicted_last_hour"], st["newest_claim_ts"])


class KafkaGuardLog:
    """The guard log on the one-partition topic ``diag-guard``, shared by every diagnosis instance.

    ``backup_path`` (``guard.state_path``): every event this instance folds is also appended to a
    local file; when the topic comes back empty (a memory-only broker restarted) the open breakers
    in that file are written to the topic again, so a restart of the broker opens no breaker."""

    def __init__(self, config: GuardConfig, bus: BusConfig, bootstrap: str | None = None, *,
                 backup_path: str = "", claim_timeout_s: float = 10.0):
        self.book = GuardBook(config)
        self.claim_timeout_s = claim_timeout_s
        self._bus, self._bootstrap = bus, bootstrap
        self.recoveries = 0
        # One consumer and one book for the claims of the service thread and the refresher's reads.
        self._lock = threading.RLock()
        self._refresher: threading.Thread | None = None
        self._stop = threading.Event()
        self.name = topics.topic(GUARD_TOPIC, bus.topic_prefix)
        self._backup = LocalGuardLog(config, backup_path) if backup_path else None
        try:
            ensure_topics(bus, bootstrap, names=(GUARD_TOPIC,))
            self._producer = Producer(bus, bootstrap, linger_ms=0)
            self._log = ReplayLog(bus, bootstrap, self.name)
            self._log.assign([0])
            end = self._log.end_offsets([0])[0]
        except BusError as exc:
            raise BusError(f"cannot open the guard log {self.name}: {exc}") from exc
        self._read_until(lambda: self._log.position(0) >= end, timeout_s=30.0)
        if end == 0 and self._backup is not None:
            for event in self._backup.book.open_breakers():
                log.warning("guard log %s is empty: re-opening a %s breaker from %s", self.name, event["scope"],
                            backup_path)
                self._send(event)

    def _read_until(self, done: Any, timeout_s: float) -> bool:
        with self._lock:
            return self._read_until_locked(done, timeout_s)

    def _read_until_locked(self, done: Any, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not done():
            try:
                batch = self._log.poll(50 if timeout_s > 0 else 0)
            except BusError as exc:
                log.warning("guard log %s: read failed: %s", self.name, exc)
                return False
            for m in batch:
                self._fold(m.value)
            if time.monotonic() > deadline:
                return done()
        return True

    def _fold(self, value: bytes | None) -> None:
        try:
            event = orjson.loads(value) if value else None
        except orjson.JSONDecodeError:
            event = None
        if not isinstance(event, dict):
            log.error("guard log %s: unreadable event skipped", self.name)
            return
        try:
            self.book.apply(event)
        except (KeyError, TypeError, ValueError) as exc:
            log.error("guard log %s: bad event skipped (%r): %r", self.name, exc, event)
            return
        if self._backup is not None and event.get("eid") not in self._backup.book._seen:
            self._backup._append(event)

    def _produce(self, event: dict[str, Any]) -> None:
        self._producer.send_raw(GUARD_TOPIC, str(event.get("job") or event.get("scope") or "fleet"),
                                orjson.dumps(event), partition=0)
        self._producer.flush(self.claim_timeout_s)

    def _send(self, event: dict[str, Any], *, retry: bool = True) -> bool:
        """Produce ``event`` and read the topic up to it; False when it did not come back in time."""
        try:
            self._produce(event)
            if self._read_until(lambda: event["eid"] in self.book._seen, self.claim_timeout_s):
                return True
        except BusError as exc:
            log.error("guard log %s: cannot write: %s", self.name, exc)
        return retry and self._recover() and self._send(event, retry=False)

    def _rewrite(self, trips: list[dict[str, Any]], end: int, attempts: int = 3) -> None:
        """Write the open breakers to the new log until they are on it: a send just after the broker's restart
        can be lost with no error (the producer's view of the topic is stale; CI saw a fresh instance read no
        breaker). A trip written twice is folded once (its eid)."""
        for _ in range(attempts):
            for trip in trips:
                self._produce(trip)
            deadline = time.monotonic() + self.claim_timeout_s
            while time.monotonic() < deadline:
                if self._log.end_offsets([0])[0] >= end + len(trips):
                    return
                time.sleep(0.1)
        log.error("guard log %s: the re-opened breakers did not reach the new log", self.name)

    def _recover(self) -> bool:
        """The broker lost the topic (a memory-only broker restarted): make it again, read the new log
        from its start, and write the breakers this instance knows to be open back to it."""
        try:
            ensure_topics(self._bus, self._bootstrap, names=(GUARD_TOPIC,))
            end = self._log.end_offsets([0])[0]
            if end >= self._log.position(0):
                return True  # the same log, slow to answer: one more try
            log.warning("guard log %s is shorter than what was read (%d): the broker lost it; re-opening %d "
                        "breaker(s) on the new log", self.name, end, len(self.book.open_breakers()))
            self.recoveries += 1
            self._log.rewind([0])
            self._read_until(lambda: self._log.position(0) >= end, self.claim_timeout_s)
            self._rewrite(self.book.open_breakers(), end)
        except BusError as exc:
            log.error("guard log %s: cannot recover: %s", self.name, exc)
            return False
        return True

    def refresh(self) -> None:
        """Fold what other instances and ``faultlens guard reset`` wrote (no wait); nothing to do here
        while a refresher thread reads them (start_refresher)."""
        if self._refresher is None:
            self._read_until(lambda: False, 0.0)

    def start_refresher(self, interval_s: float = 1.0) -> None:
        """Read the topic every ``interval_s`` on a thread of its own: a kafka-python poll waits for its
        IO thread (ms), which the diagnosis thread then spends between records instead of on them
        (7% of one instance's handler time). Claims still read up to their own event themselves."""
        if self._refresher is not None:
            return

        def run() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self._read_until(lambda: False, 0.0)
                except Exception:  # noqa: BLE001 - a failed read is retried at the next interval
                    log.warning("guard log %s: background read failed", self.name, exc_info=True)

        self._refresher = threading.Thread(target=run, name="faultlens-guard-log", daemon=True)
        self._refresher.start()

    def read_to_end(self, timeout_s: float = 10.0) -> bool:
        """Fold everything on the topic now (``faultlens guard status``)."""
        with self._lock:
            end = self._log.end_offsets([0])[0]
            return self._read_until(lambda: self._log.position(0) >= end, timeout_s)

    def claim(self, claim_id: str, *, job: str, nodes: Iterable[str], ts: float, job_nodes: int) -> ClaimVerdict:
        with self._lock:
            if claim_id in self.book.verdicts:
                return self.book.verdicts[claim_id]
            if not self._send(_claim_event(claim_id, job, nodes, ts, job_nodes, self.book.config)):
                return ClaimVerdict(False, "guard_unavailable", f"the guard log {self.name} did not answer within "
                                    f"{self.claim_timeout_s:.0f} s: not evicting (fail closed)")
            return self.book.verdicts[claim_id]

    def reset(self, scope: str, *, job: str = "", by: str = "", reason: str = "") -> dict[str, Any]:
        event = reset_event(scope, job=job, by=by, reason=reason)
        with self._lock:
            if not self._send(event):
                raise BusError(f"the reset did not reach the guard log {self.name}")
        return event

    def close(self) -> None:
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join(5.0)
        with self._lock:
            self._close_parts()

    def _close_parts(self) -> None:
        for part in (self._log, self._producer):
            try:
                part.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                log.debug("guard log close failed", exc_info=True)
