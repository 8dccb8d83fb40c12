"""Delivery that survives broker outages: a bounded on-disk spool in front of the producer.

``Spool`` is a directory of segment files (``seg-000000000001.spool``...) holding
encoded records as frames ``[u8 kind index][u16 key len][u32 value len][key][value]``,
and a ``cursor`` file (segment, offset) of the first record not yet delivered.
Records are appended in order and read back in order; a restarted agent replays
what its predecessor left.

The bound (``max_bytes``) drops the OLDEST segment when exceeded: the newest
records describe the fault that is happening now, which is what diagnosis needs
when the broker returns; the oldest are the most likely to be stale. What is
dropped is counted (``dropped_records``, ``dropped_bytes``) and reported in the
agent's health and /metrics.

Delivery in front of it: collectors/delivery.py.
"""

from __future__ import annotations

import builtins
import logging
import os
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from faultlens.stream.topics import NAMES

log = logging.getLogger(__name__)

_HEAD = struct.Struct(">BHI")
_STAMP = struct.Struct(">QQ")  # (epoch, seq) after the head when the kind byte has STAMPED set
STAMPED = 0x80
_KIND_INDEX = {k: i for i, k in enumerate(NAMES)}
Stamp = tuple[int, int]  # (epoch, seq): the record's natural key with its node (see ``Delivery``)
# (kind, key, value) or (kind, key, value, stamp)
Entry = tuple[str, str | None, bytes] | tuple[str, str | None, bytes, Stamp]


class Spool:
    """Bounded, ordered, restart-safe on-disk queue of ``(kind, key, value)`` entries."""

    def __init__(self, directory: str | os.PathLike[str], *, max_bytes: int, segment_bytes: int | None = None):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = int(max_bytes)
        self.segment_bytes = int(segment_bytes or max(4096, min(8 << 20, self.max_bytes // 8)))
        self.dropped_records = 0
        self.dropped_bytes = 0
        self.spooled_records = 0
        self.replayed_records = 0
        self.corrupt_bytes = 0
        self._lock = threading.Lock()
        self._segments = sorted(int(p.stem.split("-")[1]) for p in self.dir.glob("seg-*.spool"))
        self._sizes = {s: self._path(s).stat().st_size for s in self._segments}
        self._counts: dict[int, int] = {}
        self._cursor = self._read_cursor()
        self._writer: Any = None
        self._active_since = time.time()  # when the segment appended to was started (or this process began)
        self._roll = False  # the next append starts a new segment (drop_older_than: a window of sent records)
        self._cut_torn_tail()

    def _cut_torn_tail(self) -> None:
        """A kill -9 mid-append leaves a partial last frame: cut it, or the frames this agent
        appends after it would be unreadable (the reader stops at the torn one)."""
        if not self._segments:
            return
        seg = self._segments[-1]
        before, end = self.corrupt_bytes, 0
        for _entry, after in self._iter_segment(seg, 0):
            end = after
        self.corrupt_bytes = before  # counted once, below
        size = self._sizes[seg]
        if end < size:
            self.corrupt_bytes += size - end
            with open(self._path(seg), "r+b") as f:
                f.truncate(end)
            self._sizes[seg] = end
            log.warning("spool %s: cut a torn last record (%d bytes) left by a crash", self._path(seg).name, size - end)

    def _path(self, seg: int) -> Path:
        return self.dir / f"seg-{seg:012d}.spool"

    def _read_cursor(self) -> tuple[int, int]:
        try:
            seg, off = (self.dir / "cursor").read_text().split()
            return int(seg), int(off)
        except (OSError, ValueError):
            return (self._segments[0], 0) if self._segments else (0, 0)

    def _write_cursor(self) -> None:
        tmp = self.dir / "cursor.tmp"
        tmp.write_text(f"{self._cursor[0]} {self._cursor[1]}\n")
        os.replace(tmp, self.dir / "cursor")

    # ------------------------------------------------------------------ figures
    @property
    def bytes(self) -> int:
        return sum(self._sizes.values()) - (self._cursor[1] if self._cursor[0] in self._sizes else 0)

    def __len__(self) -> int:
        """Records waiting (counted by reading the segments; for tests and health)."""
        with self._lock:
            return sum(1 for _ in self._iter_from(self._cursor))

    def empty(self) -> bool:
        with self._lock:
            if not self._segments:
                return True
            seg, off = self._cursor
            return all(s < seg or (s == seg and self._sizes[s] <= off) for s in self._segments)

    # ------------------------------------------------------------------ writing
    def append(self, entries: list[Entry]) -> None:
        """Append in order; drop the oldest segments beyond the bound."""
        if not entries:
            return
        with self._lock:
            buf = bytearray()
            n = 0
            for entry in entries:
                kind, key, value = entry[0], entry[1], entry[2]
                k = (key or "").encode()[:65535]
                if len(entry) == 4:
                    buf += _HEAD.pack(_KIND_INDEX[kind] | STAMPED, len(k), len(value))
                    buf += _STAMP.pack(*entry[3])  # type: ignore[misc]
                else:
                    buf += _HEAD.pack(_KIND_INDEX[kind], len(k), len(value))
                buf += k
                buf += value
                n += 1
                if len(buf) >= self.segment_bytes:
                    self._write(bytes(buf), n)
                    buf.clear()
                    n = 0
            if buf:
                self._write(bytes(buf), n)
            self.spooled_records += len(entries)
            self._enforce_bound()

    def _write(self, data: builtins.bytes, n: int) -> None:
        if not self._segments or self._sizes[self._segments[-1]] >= self.segment_bytes or self._roll:
            seg = (self._segments[-1] + 1) if self._segments else max(1, self._cursor[0])
            self._roll, self._active_since = False, time.time()
            if self._writer is not None:
                self._writer.close()
            self._segments.append(seg)
            self._sizes[seg] = 0
            self._writer = open(self._path(seg), "ab")  # noqa: SIM115 - the active segment
            if len(self._segments) == 1 and self._cursor != (seg, 0):
                self._cursor = (seg, 0)  # the spool was empty: read from this segment's start
                self._write_cursor()
        seg = self._segments[-1]
        if self._writer is None:
            self._writer = open(self._path(seg), "ab")  # noqa: SIM115
        self._writer.write(data)
        self._writer.flush()
        self._sizes[seg] += len(data)
        self._counts[seg] = self._counts.get(seg, 0) + n

    def _enforce_bound(self) -> None:
        while len(self._segments) > 1 and sum(self._sizes.values()) > self.max_bytes:
            seg = self._segments.pop(0)
            start = self._cursor[1] if self._cursor[0] == seg else 0
            dropped = sum(1 for _ in self._iter_segment(seg, start))
            self.dropped_records += dropped
            self.dropped_bytes += self._sizes[seg] - start
            del self._sizes[seg]
            self._counts.pop(seg, None)
            self._path(seg).unlink(missing_ok=True)
            if self._cursor[0] <= seg:
                self._cursor = (self._segments[0], 0)
                self._write_cursor()
            log.warning("spool over its bound (%d bytes): dropped the oldest segment, %d records", self.max_bytes, dropped)

    # ------------------------------------------------------------------ reading
    def _iter_segment(self, seg: int, start: int) -> Iterator[tuple[Entry, int]]:
        """Entries of one segment from ``start``, each with the offset after it."""
        try:
            data = self._path(seg).read_bytes()
        except FileNotFoundError:
            return
        off = start
        while off + _HEAD.size <= len(data):
            ki, kl, vl = _HEAD.unpack_from(data, off)
            body = off + _HEAD.size + (_STAMP.size if ki & STAMPED else 0)
            end = body + kl + vl
            if end > len(data) or (ki & ~STAMPED) >= len(NAMES):
                self.corrupt_bytes += len(data) - off  # a torn write at a crash: the rest is unusable
                return
            key = data[body: body + kl].decode("utf-8", "replace") or None
            if ki & STAMPED:
                stamp: Stamp = _STAMP.unpack_from(data, off + _HEAD.size)
                yield (NAMES[ki & ~STAMPED], key, data[body + kl: end], stamp), end
            else:
                yield (NAMES[ki], key, data[body + kl: end]), end
            off = end

    def _iter_from(self, cursor: tuple[int, int]) -> Iterator[tuple[Entry, int]]:
        for seg in list(self._segments):
            if seg < cursor[0]:
                continue
            yield from self._iter_segment(seg, cursor[1] if seg == cursor[0] else 0)

    def peek(self, max_records: int) -> tuple[list[Entry], tuple[int, int]]:
        """Up to ``max_records`` oldest entries and the cursor to ``commit`` once they are delivered."""
        with self._lock:
            out: list[Entry] = []
            cursor = self._cursor
            for seg in list(self._segments):
                if seg < cursor[0]:
                    continue
                start = cursor[1] if seg == cursor[0] else 0
                for entry, end in self._iter_segment(seg, start):
                    out.append(entry)
                    cursor = (seg, end)
                    if len(out) >= max_records:
                        return out, cursor
                if seg == self._segments[-1]:
                    break
                cursor = (seg, self._sizes.get(seg, 0))
            return out, cursor

    def commit(self, cursor: tuple[int, int], n: int) -> None:
        """Mark entries up to ``cursor`` delivered; delete fully delivered segments."""
        with self._lock:
            if cursor[0] < self._cursor[0]:
                return  # the bound dropped those segments meanwhile
            self._cursor = cursor
            self.replayed_records += n
            while self._segments and (self._segments[0] < cursor[0] or (
                    self._segments[0] == cursor[0] and self._sizes[cursor[0]] <= cursor[1] and len(self._segments) > 1)):
                seg = self._segments.pop(0)
                self._sizes.pop(seg, None)
                self._counts.pop(seg, None)
                self._path(seg).unlink(missing_ok=True)
            if len(self._segments) == 1 and self._sizes[self._segments[0]] <= cursor[1]:
                # everything delivered: start the next segment fresh
                seg = self._segments.pop()
                if self._writer is not None:
                    self._writer.close()
                    self._writer = None
                self._sizes.pop(seg, None)
                self._path(seg).unlink(missing_ok=True)
                self._cursor = (seg + 1, 0)
            self._write_cursor()

    def drop_older_than(self, wall_ts: float) -> int:
        """Delete whole segments last written before ``wall_ts`` (never the one being written);
        the retained log of sent records (``Delivery``) keeps a time window this way, and a segment
        being written that was started before ``wall_ts`` is closed (the next append starts another),
        so a quiet node's window does not wait for a full segment. Returns records dropped."""
        with self._lock:
            if self._segments and self._active_since < wall_ts and self._sizes.get(self._segments[-1], 0) > 0:
                self._roll = True
            dropped = 0
            while len(self._segments) > 1:
                seg = self._segments[0]
                try:
                    if self._path(seg).stat().st_mtime >= wall_ts:
                        break
                except FileNotFoundError:
                    pass
                start = self._cursor[1] if self._cursor[0] == seg else 0
                dropped += sum(1 for _ in self._iter_segment(seg, start))
                self._segments.pop(0)
                self._sizes.pop(seg, None)
                self._counts.pop(seg, None)
                self._path(seg).unlink(missing_ok=True)
                self._cursor = (self._segments[0], 0)
                self._write_cursor()
            return dropped

    def close(self) -> None:
        with self._lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
