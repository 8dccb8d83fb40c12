"""Each agent record once in the lake, whatever was sent twice (issue 24.9).

The agent stamps every record with a natural key, ``(node, epoch, seq)`` per kind, in
the ``faultlens-seq`` header (collectors/spool.py: ``Delivery``): ``epoch`` is the agent
process's start (µs), ``seq`` counts that process's records of the kind from 1. When a
broker loses records it had acknowledged, the agent sends again everything it sent in
its resend window; the stream processor drops each record whose key it has already
taken (``SeqLedger.take``).

What the lake holds is known per key as a contiguous high-water mark plus the few seqs
above it (out of order after a resend, or past a real gap), so the state stays small.
It is committed with the lake: each processor commit writes ``_seq/s-<commit>.json``
(the marks of the keys that commit touched, and the broker's topic ids its offsets refer
to) before the commit's manifest, and a
processor that takes partitions merges every such file whose commit is in the
manifest, in commit order. A file whose commit never happened (a crash between the
two writes) is ignored, like the data files it describes.

The topic ids let the processor tell a new log from the old one: a memory-only broker
restarted empty numbers offsets from 0 again, and once the new log is longer than the
old committed offset, a seek there would silently skip its start. A topic whose id
differs from the one recorded is read from its beginning (its stamped records are
de-duplicated here).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SEQ_HEADER = "faultlens-seq"  # b"<epoch>:<seq>:<node>"
SEQ_DIR = "_seq"
MAX_ABOVE = 100_000  # seqs held above a gap; past this the gap is given up as lost (counted)
Key = tuple[str, int, str]  # (node, epoch, kind)


def parse_seq(headers: Any) -> tuple[str, int, int] | None:
    """(node, epoch, seq) from a record's headers, or None (not an agent record, or a malformed stamp)."""
    for k, v in headers or ():
        if k == SEQ_HEADER:
            try:
                epoch, seq, node = bytes(v).decode("utf-8").split(":", 2)
                return node, int(epoch), int(seq)
            except (ValueError, UnicodeDecodeError, TypeError):
                return None
    return None


@dataclass(slots=True)
class Mark:
    """Seqs taken for one key: every seq <= ``high``, plus ``above``."""

    high: int = 0
    above: set[int] = field(default_factory=set)

    def has(self, seq: int) -> bool:
        return seq <= self.high or seq in self.above

    def add(self, seq: int) -> int:
        """Take ``seq``; returns seqs given up as lost to keep ``above`` bounded."""
        if seq == self.high + 1:
            self.high = seq
            above = self.above
            while self.high + 1 in above:
                self.high += 1
                above.discard(self.high)
            return 0
        self.above.add(seq)
        if len(self.above) <= MAX_ABOVE:
            return 0
        lowest = min(self.above)
        lost = lowest - self.high - 1
        self.high = lowest - 1
        self.add(lowest)
        self.above.discard(lowest)
        return lost

    def merge(self, other: Mark) -> None:
        """Take every seq ``other`` holds."""
        if other.high > self.high:
            self.high = other.high
            self.above = {s for s in self.above if s > self.high}
            while self.high + 1 in self.above:
                self.high += 1
                self.above.discard(self.high)
        for s in other.above:
            if not self.has(s):
                self.add(s)

    def to_list(self) -> list[int]:
        return [self.high, *sorted(self.above)]

    @classmethod
    def from_list(cls, values: list[int]) -> Mark:
        return cls(int(values[0]), {int(v) for v in values[1:]})


class SeqLedger:
    """The natural keys taken so far: ``take`` says whether a record is new."""

    def __init__(self) -> None:
        self.marks: dict[Key, Mark] = {}
        self.given_up = 0
        self.topic_ids: dict[str, str] = {}  # topic -> broker id, as of the newest commit (see ``write``)

    def take(self, key: Key, seq: int) -> bool:
        """True (and remembered) when ``(key, seq)`` is new; False for a duplicate."""
        mark = self.marks.get(key)
        if mark is None:
            mark = self.marks[key] = Mark()
        elif mark.has(seq):
            return False
        self.given_up += mark.add(seq)
        return True

    def add_all(self, taken: Iterable[tuple[Key, int]]) -> set[Key]:
        """Take every ``(key, seq)``; returns the keys touched."""
        touched: set[Key] = set()
        for key, seq in taken:
            self.take(key, seq)
            touched.add(key)
        return touched

    def copy(self) -> SeqLedger:
        out = SeqLedger()
        out.marks = {k: Mark(m.high, set(m.above)) for k, m in self.marks.items()}
        out.topic_ids = dict(self.topic_ids)
        return out

    # -- the lake's copy

    def write(self, lake_root: Path, commit_id: str, keys: Iterable[Key], topic_ids: dict[str, str]) -> None:
        """``_seq/s-<commit_id>.json``: the marks of ``keys`` and the broker's topic ids the commit's
        offsets refer to (temporary file, fsync, rename)."""
        rows = [[node, epoch, kind, *self.marks[(node, epoch, kind)].to_list()] for node, epoch, kind in keys
                if (node, epoch, kind) in self.marks]
        if not rows and topic_ids == self.topic_ids:
            return
        self.topic_ids = dict(topic_ids)
        d = lake_root / SEQ_DIR
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".s-{commit_id}.json.tmp"
        with open(tmp, "w") as f:
            f.write(json.dumps({"marks": rows, "topics": topic_ids}, separators=(",", ":")))  # json.dump to a file: ~10x slower
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, d / f"s-{commit_id}.json")

    @classmethod
    def load(cls, lake_root: Path, committed: set[str]) -> SeqLedger:
        """The marks of every committed ``_seq`` file, merged (marks only grow: the union is the latest)."""
        out = cls()
        d = lake_root / SEQ_DIR
        if not d.is_dir():
            return out
        latest = ""
        for path in d.glob("s-*.json"):
            commit_id = path.stem[2:]
            if commit_id not in committed:
                continue  # a crash between this file and its manifest: the commit never happened
            try:
                doc = json.loads(path.read_text())
                if isinstance(doc, list):  # the first format: marks only
                    doc = {"marks": doc}
                if commit_id > latest and doc.get("topics"):  # commit ids start with the time: the newest wins
                    latest, out.topic_ids = commit_id, {str(k): str(v) for k, v in doc["topics"].items()}
                for node, epoch, kind, *marks in doc.get("marks", []):
                    out.marks.setdefault((str(node), int(epoch), str(kind)), Mark()).merge(Mark.from_list(marks))
            except (OSError, ValueError, TypeError, AttributeError) as exc:
                log.warning("%s: unreadable de-duplication marks (%s); their records may be kept twice", path, exc)
        return out


def commit_time_s(commit_id: str) -> float:
    """When a processor commit was made: its id starts with the time in hex ns (stream/processor.py)."""
    try:
        return int(commit_id[:-8], 16) / 1e9
    except ValueError:
        return 0.0


@dataclass
class SeqCompaction:
    files_in: int = 0
    files_removed: int = 0
    keys_kept: int = 0
    keys_dropped: int = 0


def compact_seq_files(lake_root: Path, committed: set[str], *, now: float, keep_s: float = 86_400.0) -> SeqCompaction:
    """Fold every committed ``_seq`` file into one (named by the newest commit: ``load`` merges the
    union, so the fold reads the same) and forget what no resend can need any more.

    A key (node, agent epoch, kind) is kept when it is its node's and kind's newest epoch, or a commit
    touched it within ``keep_s`` (an agent resends ``agent.resend_window_s`` back, its spool what the
    broker never took: both far shorter); an older epoch of a restarted agent is dropped. Files of
    commits older than the newest that the manifest does not hold (a crash between the file and its
    manifest) go too; a file newer than the newest committed one (a commit in flight) is left alone.
    The snapshot is written first (temporary file, fsync, rename), then the folded files removed: a
    crash between leaves files whose union is the same."""
    report = SeqCompaction()
    d = lake_root / SEQ_DIR
    if not d.is_dir():
        return report
    files = {p.stem[2:]: p for p in d.glob("s-*.json")}
    done = sorted(c for c in files if c in committed)
    if not done:
        return report
    newest = done[-1]
    marks: dict[Key, Mark] = {}
    touched: dict[Key, float] = {}
    topic_ids: dict[str, str] = {}
    for commit_id in done:
        try:
            doc = json.loads(files[commit_id].read_text())
        except (OSError, ValueError) as exc:
            log.warning("%s: unreadable de-duplication marks (%s); kept as it is", files[commit_id], exc)
            return report
        if isinstance(doc, list):
            doc = {"marks": doc}
        if doc.get("topics"):
            topic_ids = {str(k): str(v) for k, v in doc["topics"].items()}
        # a snapshot keeps each key's own last-touch time; a commit's file is touched at its commit
        stamps = doc.get("touched") or {}
        for node, epoch, kind, *values in doc.get("marks", []):
            key = (str(node), int(epoch), str(kind))
            marks.setdefault(key, Mark()).merge(Mark.from_list(values))
            when = float(stamps.get(f"{node}\t{epoch}\t{kind}", commit_time_s(commit_id)))
            touched[key] = max(touched.get(key, 0.0), when)
    report.files_in = len(done)
    newest_epoch: dict[tuple[str, str], int] = {}
    for node, epoch, kind in marks:
        newest_epoch[(node, kind)] = max(newest_epoch.get((node, kind), epoch), epoch)
    kept = [k for k in marks if k[1] == newest_epoch[(k[0], k[2])] or now - touched[k] <= keep_s]
    report.keys_kept, report.keys_dropped = len(kept), len(marks) - len(kept)
    tmp = d / f".s-{newest}.json.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps({"marks": [[n, e, k, *marks[(n, e, k)].to_list()] for n, e, k in sorted(kept)],
                   "topics": topic_ids,
                   "touched": {f"{n}\t{e}\t{k}": touched[(n, e, k)] for n, e, k in kept}}, separators=(",", ":")))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, files[newest])
    for commit_id, path in files.items():
        if commit_id < newest:  # folded, or a commit that never happened
            path.unlink(missing_ok=True)
            report.files_removed += 1
    return report
