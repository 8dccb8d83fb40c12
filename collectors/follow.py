"""Followers: deliver new lines of logs as they are written; they never parse.

* ``FileFollower(pattern)`` follows one file or a glob of files: new files are
  picked up, rotation (the path now names another inode: the old file is read to
  its end first, then the new one from 0) and truncation (size below our
  position: restart at 0) are handled, a partial last line waits for its
  newline, bytes that are not UTF-8 are decoded with replacement and counted.
  ``state()`` / ``restore()`` carry positions across agent restarts.
* ``KmsgReader(path)`` reads /dev/kmsg records (``pri,seq,ts_us,flags;message``
  plus dictionary lines that start with a space), from the device (one record
  per read, non-blocking) or from a recorded file in that format.
* ``JournalReader()`` runs ``journalctl -k -f -o json`` and turns each entry
  into a syslog-style line (collectors.kernel_text.parse_journal_entry).

Each has ``poll() -> list[str]`` (never blocks), ``fileno()`` (a descriptor that
becomes readable when there is something to read, or None) and ``close()``. The
agent's loop blocks on those descriptors (select), so a line is read when it is
written, not at the next tick: /dev/kmsg and journalctl's pipe are readable
themselves; files are watched with inotify (``ChangeWatch``, inotify_simple: the
directories of the followed files, so rotation and new files wake it too). Without
inotify (not Linux, no watches left) ``fileno()`` is None and the loop polls every
``agent.tick_s``. The three share one module because they share the decode and
partial-line rules.
"""

from __future__ import annotations

import glob as globmod
import json
import os
import re
import shutil
import stat
import struct
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from faultlens.collectors.kernel_text import parse_journal_entry
from faultlens.errors import NoData, SourceError
from faultlens.lifeline import spawn

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

_ESCAPE_RE = re.compile(rb"\\x([0-9a-fA-F]{2})")


def _unescape(b: bytes) -> bytes:
    """/dev/kmsg escapes non-printable bytes as ``\\xNN``."""
    if b"\\x" not in b:
        return b
    return _ESCAPE_RE.sub(lambda m: bytes([int(m.group(1), 16)]), b)


class KmsgReader:
    """/dev/kmsg records as lines ``pri,seq,ts_us,flags;message`` (KernelParser reads them).

    Dictionary lines (`` SUBSYSTEM=pci``, `` DEVICE=+pci:...``) are dropped from the
    text; a message with an embedded newline becomes a record line plus indented
    continuation lines. Sequence gaps (records overwritten before we read them,
    EPIPE from the device) are counted in ``missed``.
    """

    def __init__(self, path: str = "/dev/kmsg", *, from_end: bool = True):
        self.path = path
        self.missed = 0
        self.records = 0
        self.invalid_utf8_lines = 0
        self._last_seq: int | None = None
        self._fd: int | None = None
        self._file: FileFollower | None = None
        try:
            st = os.stat(path)
        except OSError as exc:
            raise NoData(f"{path}: {exc.strerror}") from None
        if stat.S_ISCHR(st.st_mode):
            try:
                self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            except OSError as exc:
                raise NoData(f"{path} not readable: {exc.strerror}") from None
            if from_end:
                os.lseek(self._fd, 0, os.SEEK_END)
        else:
            self._file = FileFollower(path, from_end=from_end)
            self._pending: list[bytes] = []

    def fileno(self) -> int | None:
        """The device (readable when a record is waiting), or the recorded file's watch."""
        if self._fd is not None:
            return self._fd
        return self._file.fileno() if self._file is not None else None

    def poll(self) -> list[str]:
        out: list[str] = []
        if self._fd is not None:
            while True:
                try:
                    rec = os.read(self._fd, 8192)
                except BlockingIOError:
                    break
                except BrokenPipeError:  # the ring buffer overwrote records we had not read
                    self.missed += 1
                    continue
                except OSError as exc:
                    raise SourceError(f"{self.path}: {exc.strerror}") from None
                if not rec:
                    break
                lines = rec.rstrip(b"\n").split(b"\n")
                self._record(lines[0], out)
        else:
            assert self._file is not None
            for line in self._file.poll():
                if line.startswith(" "):
                    continue  # dictionary line of the record above
                self._record(line.encode("utf-8", "surrogateescape"), out)
        return out

    def _record(self, head: bytes, out: list[str]) -> None:
        self.records += 1
        prefix, sep, msg = head.partition(b";")
        if sep:
            parts = prefix.split(b",")
            if len(parts) >= 3 and parts[1].isdigit():
                seq = int(parts[1])
                if self._last_seq is not None and seq > self._last_seq + 1:
                    self.missed += seq - self._last_seq - 1
                self._last_seq = seq
        raw = _unescape(head)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            self.invalid_utf8_lines += 1
            text = raw.decode("utf-8", "replace")
        first, *rest = text.split("\n")
        out.append(first)
        out.extend(" " + r for r in rest if r)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._file is not None:
            self._file.close()


# --------------------------------------------------------------------------- journalctl


class JournalReader:
    """``journalctl -k -f -o json`` as a subprocess; entries become syslog-style lines."""

    def __init__(self, *, command: list[str] | None = None):
        exe = shutil.which("journalctl")
        if command is None and exe is None:
            raise NoData("journalctl not found")
        self.command = command or [str(exe), "-k", "-f", "-o", "json", "-n", "0"]
        self.bad_entries = 0
        self._buf = bytearray()
        try:
            self.proc = spawn(self.command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # dies with the agent
        except OSError as exc:
            raise NoData(f"cannot run journalctl: {exc}") from None
        assert self.proc.stdout is not None
        os.set_blocking(self.proc.stdout.fileno(), False)

    def fileno(self) -> int | None:
        """journalctl's output pipe."""
        return self.proc.stdout.fileno() if self.proc.stdout is not None and self.proc.returncode is None else None

    def poll(self) -> list[str]:
        exited = self.proc.poll() is not None  # checked before reading: what it wrote is read below
        self._drain()
        out = self._lines()
        if exited and not out and not self._buf:
            err = (self.proc.stderr.read() if self.proc.stderr else b"").decode("utf-8", "replace").strip()
            raise SourceError(f"journalctl exited with {self.proc.returncode}: {err[:300]}")
        return out

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        while True:
            try:
                chunk = os.read(self.proc.stdout.fileno(), READ_CHUNK)
            except BlockingIOError:
                break
            if not chunk:
                break
            self._buf += chunk

    def _lines(self) -> list[str]:
        out: list[str] = []
        if self._buf:
            *lines, tail = bytes(self._buf).split(b"\n")
            self._buf = bytearray(tail)
            for raw in lines:
                if not raw.strip():
                    continue
                try:
                    entry = json.loads(raw)
                except ValueError:
                    self.bad_entries += 1
                    out.append(raw.decode("utf-8", "replace"))  # kept: the parser files it as "other"
                    continue
                if isinstance(entry, dict):
                    out.append(parse_journal_entry(entry))
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        for s in (self.proc.stdout, self.proc.stderr):
            if s is not None:
                s.close()


# ---------------------------------------------------------------- agent sources
# A followed log is a source: a follower delivers lines, a parser (kernel, NCCL) turns
# them into records, the agent ships what is not ordinary. The "kernel" and "nccl"
# sources are registered by their parser modules (collectors/kernel.py, nccl.py).
KERNEL_FILES = ("/var/log/kern.log", "/var/log/messages", "/var/log/syslog")
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


class KernelLogSource(LogSource):
    """The kernel log: /dev/kmsg, the journal or a file (``agent.kernel_follow``), parsed by KernelParser."""

    def open_reader(self, positions: dict[str, Any]) -> tuple[Any, str] | None:
        src = self.options.get("path") or self.agent.config.agent.kernel_follow
        from_end = self.agent.from_end
        tried: list[str] = []
        if src in ("auto", "kmsg"):
            try:
                return KmsgReader("/dev/kmsg", from_end=from_end), "/dev/kmsg"
            except NoData as exc:
                tried.append(str(exc))
                if src == "kmsg":
                    raise
        if src in ("auto", "journal"):
            try:
                return JournalReader(), "journalctl -k -f"
            except NoData as exc:
                tried.append(str(exc))
                if src == "journal":
                    raise
        if src == "auto":
            path = next((p for p in KERNEL_FILES if os.access(p, os.R_OK)), None)
            if path is None:
                raise NoData("no readable kernel log: " + "; ".join(tried + [f"none of {', '.join(KERNEL_FILES)}"]))
            src = path
        if not os.path.exists(src) and not _HAS_MAGIC.search(src):
            self.agent.say_once("kernel.missing", 30, "kernel: %s does not exist yet; waiting for it", src)
        f = FileFollower(src, from_end=from_end, rescan_interval_s=RESCAN_S)
        f.restore(positions)
        return f, src

    def poll(self, now: float) -> None:
        if not self.parser.gpu_map and self.agent.gpu_map:
            self.parser.gpu_map = dict(self.agent.gpu_map)  # PCI bus -> GPU index, once NVML has answered
        super().poll(now)


def boot_time() -> float | None:
    """Unix time of boot (/proc/stat btime): turns dmesg/kmsg uptimes into timestamps."""
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        return None
    return None
