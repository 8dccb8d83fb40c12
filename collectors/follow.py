"""Followers: deliver new lines of logs as they are written; they never parse.

* ``FileFollower(pattern)`` follows one file or a glob of files: new files are
  picked up, rotation (the path now names another inode: the old file is read to
  its end first, then the new one from 0) and truncation (size below our
  position: restart at 0) are handled, a partial last line waits for its
  newline, bytes that are not UTF-8 are decoded with replacement and counted.
  ``state()`` / ``restore()`` carry positions across agent restarts.
* The kernel log's own readers (/dev/kmsg, journalctl) are in collectors/kernel_follow.py.

Each has ``poll() -> list[str]`` (never blocks), ``fileno()`` (a descriptor that
becomes readable when there is something to read, or None) and ``close()``. The
agent's loop blocks on those descriptors (select), so a line is read when it is
written, not at the next tick: /dev/kmsg and journalctl's pipe are readable
themselves; files are watched with inotify (``ChangeWatch``, inotify_simple: the
directories of the followed files, so rotation and new files wake it too). Without
inotify (not Linux, no watches left) ``fileno()`` is None and the loop polls every
``agent.tick_s``.
"""

from __future__ import annotations

import glob as globmod
import os
import re
import stat
import struct
import time
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from faultlens.errors import NoData, SourceError

READ_CHUNK = 1 << 20
RESCAN_S = 5.0  # how often a follower looks for new/rotated files (a glob is a directory listing)
MAX_LINE_BYTES = 1 << 20  # a "line" longer than this is cut (counted in long_lines)
_HAS_MAGIC = re.compile(r"[*?\[]")


class ChangeWatch:
    """inotify: ``fileno()`` is readable after a followed file grew or its directory changed.

    Two kinds of watch: each followed file for ``IN_MODIFY`` (other files' writes in a busy
    directory such as /var/log do not wake the agent), and the directories of the pattern
    for files created, moved or deleted (rotation, a new file of a glob). ``drain()`` reads
    the pending events (the descriptor stays readable until then) and says whether one
    was about the directory (the follower then looks for new files at once). Events are
    read as raw bytes: a busy log gives a few hundred a second.
    """

    _EVENT = struct.Struct("iIII")  # wd, mask, cookie, name length (struct inotify_event)

    def __init__(self) -> None:
        from inotify_simple import INotify, flags

        self.file_mask = int(flags.MODIFY)
        self.dir_mask = int(flags.CREATE | flags.MOVED_TO | flags.MOVED_FROM | flags.DELETE | flags.ONLYDIR)
        self._dir_events = int(flags.CREATE | flags.MOVED_TO | flags.MOVED_FROM | flags.DELETE | flags.IGNORED
                               | flags.Q_OVERFLOW)
        self._ignored = int(flags.IGNORED)
        self._ino = INotify(nonblocking=True)
        self._fd = int(self._ino.fileno())
        self._dirs: dict[str, int] = {}
        self.errors = 0

    @classmethod
    def open(cls) -> ChangeWatch | None:
        """A watch, or None where inotify is not available (the follower polls then)."""
        try:
            return cls()
        except (ImportError, OSError, AttributeError):
            return None

    def fileno(self) -> int:
        return self._fd

    def watch_dir(self, directory: str) -> None:
        """Watch ``directory`` for new, moved and deleted files (again: no-op); a missing one is left to the rescans."""
        if directory not in self._dirs:
            try:
                self._dirs[directory] = self._ino.add_watch(directory, self.dir_mask)
            except OSError:
                self.errors += 1  # missing, unreadable, or out of watches: the rescan still finds files

    def watch_file(self, path: str) -> None:
        """Watch ``path`` (the inode it names now) for writes."""
        try:
            self._ino.add_watch(path, self.file_mask)
        except OSError:
            self.errors += 1

    def drain(self) -> bool:
        """Read the pending events; True when one was about a directory (a file created, moved, deleted)."""
        data = bytearray()
        while True:
            try:
                chunk = os.read(self._fd, 65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                return False
            if not chunk:
                break
            data += chunk
        new = False
        off, size, ev = 0, len(data), self._EVENT
        while off + ev.size <= size:
            wd, mask, _cookie, name_len = ev.unpack_from(data, off)
            off += ev.size + name_len
            if mask & self._dir_events:
                new = True
                if mask & self._ignored:  # a watched directory went away: watch it again once it is back
                    self._dirs = {d: w for d, w in self._dirs.items() if w != wd}
        return new

    def close(self) -> None:
        try:
            self._ino.close()
        except OSError:
            pass


def _static_dir(pattern: str) -> str:
    """The deepest directory of a path or glob with no wildcard in it."""
    parts = pattern.split(os.sep)
    keep = []
    for part in parts[:-1]:
        if _HAS_MAGIC.search(part):
            break
        keep.append(part)
    return os.sep.join(keep) or ("/" if pattern.startswith("/") else ".")


@dataclass
class _File:
    path: str
    fh: BinaryIO
    inode: int
    pos: int = 0
    partial: bytearray = field(default_factory=bytearray)


class FileFollower:
    """Follow a file or glob of files. ``poll()`` returns the complete lines written since.

    ``from_end``: files present at the first poll start at their end (a live
    agent does not replay history); files that appear later are read from 0.
    """

    def __init__(self, pattern: str, *, from_end: bool = False, rescan_interval_s: float = 2.0,
                 watch: bool = True):
        self.pattern = pattern
        self.from_end = from_end
        self.rescan_interval_s = rescan_interval_s
        self._watch = ChangeWatch.open() if watch else None
        self._files: dict[str, _File] = {}
        self._restored: dict[str, tuple[int, int]] = {}
        self._last_scan = -1e18
        self._first = True
        self.lines = 0
        self.bytes = 0
        self.invalid_utf8_lines = 0
        self.long_lines = 0
        self.truncations = 0
        self.rotations = 0
        self.errors = 0
        self.last_error: str | None = None

    # ------------------------------------------------------------------ discovery
    def _paths(self) -> list[str]:
        if _HAS_MAGIC.search(self.pattern):
            return sorted(globmod.glob(self.pattern, recursive=True))
        return [self.pattern] if os.path.exists(self.pattern) else []

    def _open(self, path: str, at_end: bool) -> None:
        try:
            fh = open(path, "rb")  # noqa: SIM115 - kept open while following
            st = os.fstat(fh.fileno())
        except OSError as exc:
            self._error(f"{path}: {exc}")
            return
        if not stat.S_ISREG(st.st_mode):
            fh.close()
            return
        pos = 0
        saved = self._restored.pop(path, None)
        if saved is not None and saved[0] == st.st_ino and saved[1] <= st.st_size:
            pos = saved[1]
        elif at_end:
            pos = st.st_size
        fh.seek(pos)
        self._files[path] = _File(path, fh, st.st_ino, pos)
        if self._watch is not None:
            self._watch.watch_file(path)

    def _error(self, msg: str) -> None:
        self.errors += 1
        self.last_error = msg

    @property
    def files(self) -> list[str]:
        return sorted(self._files)

    def fileno(self) -> int | None:
        """Readable once a watched directory changed (None: no inotify, poll on a timer)."""
        return self._watch.fileno() if self._watch is not None else None

    # ------------------------------------------------------------------ reading
    def poll(self) -> list[str]:
        """Complete lines appended since the last poll, in file order (per file)."""
        now = time.monotonic()
        w = self._watch
        rescan = w is not None and w.drain()
        if rescan or now - self._last_scan >= self.rescan_interval_s or self._first:
            self._last_scan = now
            if w is not None:
                w.watch_dir(_static_dir(self.pattern))
            for p in self._paths():
                if p not in self._files:
                    self._open(p, self.from_end and self._first)
                    if w is not None:
                        w.watch_dir(os.path.dirname(p) or ".")
            self._first = False
        out: list[str] = []
        for path in list(self._files):
            self._poll_file(self._files[path], out)
        return out

    def _poll_file(self, f: _File, out: list[str]) -> None:
        try:
            st = os.stat(f.path)
        except FileNotFoundError:
            st = None
        except OSError as exc:
            self._error(f"{f.path}: {exc}")
            return
        if st is not None and st.st_ino == f.inode and st.st_size < f.pos:
            # truncated in place (copytruncate, `> file`): start over
            self.truncations += 1
            f.fh.seek(0)
            f.pos = 0
            f.partial.clear()
        self._read(f, out)
        if st is None or st.st_ino != f.inode:
            # rotated (renamed away or deleted): the old inode is read to its end above
            self._emit_partial(f, out)
            f.fh.close()
            del self._files[f.path]
            if st is not None:
                self.rotations += 1
                self._open(f.path, at_end=False)
                nf = self._files.get(f.path)
                if nf is not None:
                    self._read(nf, out)

    def _read(self, f: _File, out: list[str]) -> None:
        while True:
            try:
                chunk = f.fh.read(READ_CHUNK)
            except OSError as exc:
                self._error(f"{f.path}: {exc}")
                return
            if not chunk:
                return
            f.pos += len(chunk)
            self.bytes += len(chunk)
            if f.partial:
                chunk = bytes(f.partial) + chunk
                f.partial.clear()
            end = chunk.rfind(b"\n") + 1
            tail = chunk[end:]
            if end:
                self._decode_block(chunk[:end - 1], out)
            if len(tail) > MAX_LINE_BYTES:
                self.long_lines += 1
                out.append(self._decode(tail))
            elif tail:
                f.partial += tail
            if len(chunk) < READ_CHUNK:
                return

    def _emit_partial(self, f: _File, out: list[str]) -> None:
        if f.partial:
            out.append(self._decode(bytes(f.partial)))
            f.partial.clear()

    def _decode_block(self, block: bytes, out: list[str]) -> None:
        """Complete lines of one read, decoded at once (per line only when some are not UTF-8)."""
        try:
            text = block.decode("utf-8")
        except UnicodeDecodeError:
            for raw in block.split(b"\n"):
                out.append(self._decode(raw))
            return
        lines = text.split("\n")
        self.lines += len(lines)
        if "\r" in text:
            lines = [ln[:-1] if ln.endswith("\r") else ln for ln in lines]
        out.extend(lines)

    def _decode(self, raw: bytes) -> str:
        self.lines += 1
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.invalid_utf8_lines += 1
            return raw.decode("utf-8", "replace")

    def flush_partial(self) -> list[str]:
        """Lines still waiting for their newline (e.g. at shutdown)."""
        out: list[str] = []
        for f in self._files.values():
            self._emit_partial(f, out)
        return out

    # ------------------------------------------------------------------ state
    def state(self) -> dict[str, list[int]]:
        """path -> [inode, position of the last complete line] (JSON-friendly)."""
        return {p: [f.inode, f.pos - len(f.partial)] for p, f in self._files.items()}

    def restore(self, state: dict[str, list[int]]) -> None:
        """Resume from ``state()`` of an earlier run (same inode: continue there)."""
        self._restored = {p: (int(v[0]), int(v[1])) for p, v in state.items()}

    def close(self) -> None:
        for f in self._files.values():
            try:
                f.fh.close()
            except OSError:
                pass
        self._files.clear()
        if self._watch is not None:
            self._watch.close()
            self._watch = None


# --------------------------------------------------------------------------- /dev/kmsg

# ---------------------------------------------------------------- agent sources
# A followed log is a source: a follower delivers lines, a parser (kernel, NCCL) turns
# them into records, the agent ships what is not ordinary. The "kernel" and "nccl"
# sources are registered by their parser modules (collectors/kernel.py, nccl.py).
# A record held for its continuation lines is shipped once its log has been quiet this
# long: printk and NCCL write a record's lines together, so a short wait suffices.
RECORD_QUIET_S = 0.1



class FollowedSource:
    """A source that follows files (or kmsg/journal) and hands new lines to ``feed``."""

    name = ""

    def __init__(self, agent: Any, options: dict[str, Any]):
        self.agent = agent
        self.options = options
        self.follower: Any = None

    def open_reader(self, positions: dict[str, Any]) -> tuple[Any, str] | None:
        """The follower and a description of what it follows; None when nothing is configured."""
        pattern = self.options.get("glob") or ""
        if not pattern:
            self.agent.set_state(self.name, "off", "no glob configured")
            return None

        f = FileFollower(pattern, from_end=self.agent.from_end, rescan_interval_s=RESCAN_S)
        f.restore(positions)
        return f, pattern

    def start(self, positions: dict[str, Any]) -> None:
        try:
            opened = self.open_reader(positions)
        except NoData as exc:
            self.agent.set_state(self.name, "no_data", str(exc))
            return
        if opened is not None:
            self.follower, detail = opened
            self.agent.set_state(self.name, "ok", f"following {detail}")

    def poll(self, now: float) -> None:
        f = self.follower
        if f is None:
            return
        try:
            lines = f.poll()
        except (SourceError, OSError) as exc:
            self.agent.set_state(self.name, "error", str(exc))
            return
        if getattr(f, "last_error", None):
            self.agent.set_state(self.name, "error", f.last_error)
            f.last_error = None
        elif self.agent.health[self.name].state == "error":
            self.agent.set_state(self.name, "ok")
        if lines:
            self.agent.success(self.name, lines=len(lines), records=self.feed(lines, now), now=now)
        else:
            self.idle(now)

    def fileno(self) -> int | None:
        """A descriptor readable when the follower has something new (the agent's loop blocks on it)."""
        fileno = getattr(self.follower, "fileno", None)
        return fileno() if fileno is not None else None

    def feed(self, lines: list[str], now: float) -> int:
        """Turn new lines into records and emit them; returns how many were emitted."""
        raise NotImplementedError

    def idle(self, now: float) -> None:
        """Nothing new this tick."""

    def holding(self) -> bool:
        return False

    def positions(self) -> dict[str, Any] | None:
        state = getattr(self.follower, "state", None)  # files have positions; kmsg and the journal do not
        return state() if callable(state) else None

    def drain(self) -> None:
        pass

    def close(self) -> None:
        if self.follower is not None:
            self.follower.close()




class LogSource(FollowedSource):
    """A followed log parsed by a kernel/NCCL parser (``feed_many``, ``finish``, ``kinds``)."""

    def __init__(self, agent: Any, options: dict[str, Any], name: str, parser: Any, record_cls: Any):
        super().__init__(agent, options)
        self.name = name
        self.parser = parser
        self.record_cls = record_cls
        self._last_line = 0.0

    def feed(self, lines: list[str], now: float) -> int:
        self._last_line = now
        n = self.agent.ship_log_lines(self.name, self.parser, lines, self._unparsed)
        close = getattr(self.parser, "close_single_line", None)
        if close is not None:  # a fault line no continuation can follow (Xid, SXid): no quiet wait
            n += self.agent.ship_parsed(self.name, self.parser, close())
        return n

    def _unparsed(self, line: str, exc: Exception) -> Any:
        """A line the parser failed on, kept as an ``unparsed`` record with the reason."""
        return self.record_cls(ts=self.agent.clock(), node=self.agent.node, kind="unparsed", raw=line, message=line,
                               fields={"parse_error": f"{type(exc).__name__}: {exc}"[:300]})

    def idle(self, now: float) -> None:
        if now - self._last_line >= RECORD_QUIET_S:
            self._last_line = now
            self.drain()

    def holding(self) -> bool:
        return getattr(self.parser, "_pending", None) is not None

    def drain(self) -> None:
        p = self.parser
        n = self.agent.ship_parsed(self.name, p, p.flush() if self.agent.ship_ordinary else p.finish())
        if n:
            self.agent.success(self.name, records=n)
