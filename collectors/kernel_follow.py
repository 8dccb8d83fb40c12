"""The kernel log's own followers: /dev/kmsg, ``journalctl -k``, and the agent's ``kernel`` source.

* ``KmsgReader(path)`` reads /dev/kmsg records (``pri,seq,ts_us,flags;message``
  plus dictionary lines that start with a space), from the device (one record
  per read, non-blocking) or from a recorded file in that format.
* ``JournalReader()`` runs ``journalctl -k -f -o json`` and turns each entry
  into a syslog-style line (collectors.kernel_text.parse_journal_entry).
* ``KernelLogSource`` picks one (``agent.kernel_follow``: auto, kmsg, journal or a
  file) and feeds its lines to the kernel parser.

They deliver lines like the file follower (collectors/follow.py: ``poll``, ``fileno``,
``close``) and share its decode and partial-line rules.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
from typing import Any

from faultlens.collectors.follow import _HAS_MAGIC, READ_CHUNK, RESCAN_S, FileFollower, LogSource
from faultlens.collectors.kernel_text import parse_journal_entry
from faultlens.errors import NoData, SourceError
from faultlens.lifeline import spawn

KERNEL_FILES = ("/var/log/kern.log", "/var/log/messages", "/var/log/syslog")


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
