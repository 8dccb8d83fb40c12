"""Kernel log parsing: dmesg, ``dmesg --time-format iso``, syslog/journal, /dev/kmsg.

``KernelParser`` is stateful because kernel records span lines: an indented
continuation line (a call trace frame, the rest of a multi-line NVRM message)
belongs to the record above it, so a record is emitted when the next record
starts (or on ``flush``). Launcher prefixes such as ``[default7]:`` or
``[rank0]:`` are stripped and kept as the rank. What a record *is* comes from
the [[kind]] entries of collectors/catalogs/kernel.toml; what it *means* is faultlens.collectors.signatures.

The parser is pure text -> records; followers (collectors.follow) deliver lines.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from faultlens.collectors.kernel_follow import KernelLogSource, boot_time
from faultlens.collectors.kernel_text import (  # noqa: F401  (normalize_pci, parse_journal_entry: public here too)
    _FACILITIES,
    _KMSG_LEVELS,
    BRACKET_RE,
    CTIME_RE,
    DECODE_RE,
    DEVICE_DETAIL_RE,
    DUMP_CONT_FIRST,
    DUMP_CONT_RE,
    HOST_KERNEL_RE,
    HOST_PROGRAM_PID_RE,
    ISO_RE,
    KMSG_RE,
    LAUNCHER_RE,
    MONTHS,
    OOPS_HEADS,
    PCI_ANY_RE,
    PCI_GPU_RE,
    PRI_RE,
    RECOVERY_RE,
    REPEATED_RE,
    RFC5424_RE,
    SXID_SEV_RE,
    SYSLOG_ANY_RE,
    SYSLOG_RE,
    TASK_STATE_RE,
    XID_TAIL_RE,
    YEAR_SYSLOG_RE,
    _iso_ts,
    _kind_text,
    _pci_id,
    _split_iso,
    _strip_bracket,
    normalize_pci,
    parse_journal_entry,
)
from faultlens.collectors.ordinary_lines import FastPathParser, blank_lines
from faultlens.collectors.patterns import (
    CATALOGS,
    MATCH_LIMIT,
    KindTable,
    hot_regex,
    load_kind_table,
)
from faultlens.collectors.sources import (
    AgentServices,
    LogParser,
    Source,
    register_log_parser,
    register_source,
)
from faultlens.collectors.unparsed import to_int
from faultlens.schema import KernelEvent

MAX_RECORD_LINES = 256
MAX_UPTIME_S = 1e10  # ~300 years: a larger seconds-since-boot stamp is a mangled one
# Besides the catalog words, what makes a line take the full parse: a relative
# (dmesg -H) timestamp, which depends on the line before it (screened by its
# bracket, then matched at the start of the line), and bad bytes.
HOT_EXTRA = ((r"\[ *[+-]\d", r"^(?:\[\d+\]\s+)?(?:\[(?:default|rank|Rank )\d+\]:\s?)?(?:[a-z]+\s*:[a-z]+\s*: )?\[\s*[+-]\d"),)


@lru_cache(maxsize=1)
def kernel_kinds() -> KindTable:
    return load_kind_table(CATALOGS / "kernel.toml")


@dataclass(slots=True)
class _Head:
    """What the prefix of one physical line told us."""

    message: str
    ts: float | None
    rank: int | None = None
    host: str | None = None
    level: str | None = None
    relative: bool = False
    continuation: bool = False
    repeated: int = 0
    program: str | None = None  # the syslog/journal tag of a line another program wrote (sshd, systemd...)


@dataclass(slots=True)
class _Pending:
    head: _Head
    lines: list[str] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)
    hot: bool = True  # some line passed the fast-path filter (False: provably ordinary)


class KernelParser(FastPathParser):
    """Lines in, ``KernelEvent`` records out (``feed`` / ``flush``).

    ``boot_time`` converts dmesg's seconds-since-boot and /dev/kmsg's
    microseconds into unix time (None: leave them relative). ``year`` completes
    syslog timestamps, which have none. ``gpu_map`` maps a normalised PCI bus
    (``0000:3b:00``) to the GPU index, from NVML or a config table.

    ``feed_many(lines)`` is the fast path for bulk and live input (collectors/ordinary_lines.py):
    a line with none of the catalog's words (one Aho-Corasick scan per chunk) is held back unparsed; held lines
    are settled as ordinary (kind ``other``, counted, never built) unless a later
    line continues their record, in which case that record is parsed in full. The
    result is the same as ``feed`` on every line. ``extra_hot`` adds substrings
    (explain passes diagnosis's rules for kind ``other``).
    """

    def __init__(
        self,
        node: str = "",
        *,
        boot_time: float | None = None,
        year: int | None = None,
        gpu_map: Mapping[str, int] | None = None,
        tz: dt.tzinfo = dt.UTC,
        extra_hot: Iterable[str] = (),
    ):
        self.node = node
        self.boot_time = boot_time
        self.year = year or dt.datetime.now(dt.UTC).year
        self.gpu_map = {normalize_pci(k): v for k, v in (gpu_map or {}).items()}
        self.tz = tz
        self.kinds = kernel_kinds()
        self._pending: _Pending | None = None
        self._last_ts = 0.0
        self._last_gpu_pci: str | None = None
        self._cold: list[str] = []
        self._hot = hot_regex(self.kinds.words() + [w.lower() for w in extra_hot], HOT_EXTRA)
        self.lines = 0
        self.records = 0
        self.ordinary_lines = 0  # lines settled by the fast path without a record

    # ------------------------------------------------------------------ prefixes
    def _head(self, line: str) -> _Head:
        """The prefix of one line: time, host, level, rank; rsyslog's "message repeated
        N times: [ msg ]" unwrapped to ``msg`` with ``repeated`` = N."""
        h = self._prefix(line)
        msg = h.message
        if msg[:1] in "ml" and "message repeated" in msg[:24]:
            m = REPEATED_RE.match(msg)
            if m:
                h.message = _strip_bracket(m.group(2))
                h.repeated = to_int(m.group(1)) or 0
        return h

    def _prefix(self, line: str) -> _Head:
        rank = None
        if line.startswith("["):
            m = LAUNCHER_RE.match(line)
            if m:
                rank = to_int(m.group(1))
                line = line[m.end():]
        if not line or line[0] in " \t":
            return _Head(line.strip(), None, rank, continuation=True)
        c0 = line[0]
        if c0 == "<":
            m = RFC5424_RE.match(line)
            if m:
                ts: float | None
                try:
                    ts = _iso_ts(*_split_iso(m.group(2)), self.tz)
                except (ValueError, OverflowError):
                    ts = None
                h = self._prefix(m.group(5)) if m.group(4) != "kernel" else _Head(_strip_bracket(m.group(5)), ts)
                h.ts = ts if ts is not None else h.ts
                h.host, h.level, h.rank = m.group(3), _KMSG_LEVELS.get((to_int(m.group(1)) or 0) & 7), rank
                if m.group(4) != "kernel":
                    h.program = m.group(4)
                return h
            m = PRI_RE.match(line)
            if m:  # dmesg -r / forwarded syslog: <PRI> then the usual line
                h = self._prefix(line[m.end():])
                h.level = h.level or _KMSG_LEVELS.get((to_int(m.group(1)) or 0) & 7)
                h.rank = h.rank if h.rank is not None else rank
                return h
        if c0 == "[":
            m = BRACKET_RE.match(line)
            if m:
                secs = float(m.group(2))
                rest = m.group(3)
                if secs >= MAX_UPTIME_S:  # no uptime is this long (a mangled digit): no time
                    return _Head(rest, None, rank)
                if m.group(1):  # dmesg -H / --reltime: delta from the previous line
                    return _Head(rest, ts=self._last_ts + secs, rank=rank, relative=True)
                ts = secs + self.boot_time if self.boot_time is not None else secs
                host = None
                if "kernel:" in rest[:80]:  # journalctl -o short-monotonic: [ 12.3] host kernel: msg
                    hk = HOST_KERNEL_RE.match(rest)
                    if hk:
                        host, rest = hk.group(1), hk.group(2)
                return _Head(rest, ts=ts, rank=rank, host=host)
            m = CTIME_RE.match(line)
            if m:
                try:
                    t = dt.datetime.strptime(m.group(1), "%a %b %d %H:%M:%S %Y").replace(tzinfo=self.tz)
                except (ValueError, OverflowError):  # not a real date (a mangled month): keep the previous time
                    return _Head(m.group(2), ts=None, rank=rank)
                return _Head(m.group(2), ts=t.timestamp(), rank=rank)
        if c0.isdigit():
            m = KMSG_RE.match(line)
            if m:
                us = to_int(m.group(3))  # a number too long for a time: no time (the previous one is kept)
                usec = us / 1e6 if us is not None else None
                ts = usec + self.boot_time if usec is not None and self.boot_time is not None else usec
                level = _KMSG_LEVELS.get((to_int(m.group(1)) or 0) & 7)
                head = _Head(m.group(4), ts=ts, rank=rank, level=level)
                return head
            m = ISO_RE.match(line)
            if m:
                try:
                    ts = _iso_ts(m.group(1), m.group(2), m.group(3), self.tz)
                except (ValueError, OverflowError):  # not a real date or offset (a mangled digit): no time
                    ts = None
                rest = m.group(4)
                hk = HOST_KERNEL_RE.match(rest) if "kernel:" in rest[:80] else None
                host = program = None
                if hk:
                    host, rest = hk.group(1), hk.group(2)
                elif (hp := HOST_PROGRAM_PID_RE.match(rest)) is not None:  # journalctl -o short-iso: host prog[pid]: msg
                    host, program, rest = hp.group(1), hp.group(2), hp.group(3)
                rest = _strip_bracket(rest)
                return _Head(rest, ts=ts, rank=rank, host=host, program=program)
        if c0.islower() and line[1:7].find(":") >= 0:
            m = DECODE_RE.match(line)
            if m and m.group(1) in _FACILITIES:
                h = self._head(m.group(3))
                h.level = m.group(2)
                return h
        year = None
        if c0.isdigit() and line[4:5] == " ":
            y = YEAR_SYSLOG_RE.match(line)  # "2017 Oct  3 18:03:49.241708 host kernel: ..." (syslog with a year)
            if y:
                year, line = int(y.group(1)), line[y.end():]
        m = SYSLOG_RE.match(line)
        if m:
            ts = self._syslog_ts(m, year)
            rest = _strip_bracket(m.group(7))
            return _Head(rest, ts=ts, rank=rank, host=m.group(6))
        m = HOST_KERNEL_RE.match(line)
        if m:
            return _Head(_strip_bracket(m.group(2)), ts=None, rank=rank, host=m.group(1))
        m = SYSLOG_ANY_RE.match(line) if line[:1].isalpha() else None
        if m:
            return _Head(m.group(8), ts=self._syslog_ts(m), rank=rank, host=m.group(6), program=m.group(7))
        return _Head(line, None, rank)

    def _syslog_ts(self, m: re.Match[str], year: int | None = None) -> float | None:
        mon = MONTHS.get(m.group(1)[:3].lower())
        if mon is None:
            return None  # a localised month name: keep the previous timestamp
        try:
            t = dt.datetime(year or self.year, mon, int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5)), tzinfo=self.tz)
        except (ValueError, OverflowError):
            return None
        return t.timestamp()

    def reset(self) -> None:
        """Forget the open record and held lines (after a line the parser failed on: collectors/unparsed.py)."""
        self._pending = None
        self._cold = []

    # ------------------------------------------------------------------ records
    def feed(self, line: str) -> list[KernelEvent]:
        """One physical line; returns the records it completed (usually 0 or 1)."""
        out: list = []
        if self._cold:
            self._settle(out, keep_last=False, next_hot=True)
        self.lines += 1
        out.extend(self._feed(line.rstrip("\r\n"), True))
        return [r for r in out if not isinstance(r, int)]

    def _is_continuation(self, head: _Head, pending: bool) -> bool:
        if head.continuation or head.message[:1] in (" ", "\t"):
            return True  # a message that starts indented continues the record above
        if not pending:
            return False
        msg = head.message
        if ":   " in msg[:48] and DEVICE_DETAIL_RE.match(msg):
            return True  # "pcieport 0000:00:03.1:   device [..] error status/mask=...": the report above
        if " D " in msg[:48] and TASK_STATE_RE.match(msg):
            return True  # an older kernel's hung-task report: its task-state line, then the stack
        return msg[:1] in DUMP_CONT_FIRST and DUMP_CONT_RE.match(msg) is not None

    def _feed(self, line: str, hot: bool) -> list[KernelEvent]:
        if not line.strip():
            return self._flush()
        head = self._head(line)
        p = self._pending
        if p is not None and len(p.lines) < MAX_RECORD_LINES and (
                self._is_continuation(head, True) or (head.message.startswith("Oops: ") and p.messages[0].startswith(OOPS_HEADS))):
            p.lines.append(line)
            p.messages.append(head.message.strip())
            p.hot = p.hot or hot
            return []
        out = self._flush()
        if head.ts is None:
            head.ts = self._last_ts
        else:
            self._last_ts = head.ts
        self._pending = _Pending(head, [line], [head.message.strip()], hot)
        return out

    def close_single_line(self) -> list[KernelEvent]:
        """The open record, now, when it is one line of a kind that has no continuation lines
        (``single_line`` in kernel.toml: Xid, SXid): the agent ships a fault line as soon as
        it is read instead of waiting for the next line or a quiet spell."""
        p = self._pending
        if p is None or not p.hot or self._cold or len(p.lines) != 1:
            return []
        kind = self.kinds.match(p.messages[0])[0]
        if kind not in self.kinds.single_line_kinds:
            return []
        return self._flush()

    def flush(self) -> list[KernelEvent]:
        """The record still open (held ordinary lines are settled and left out)."""
        if self._cold or (self._pending is not None and not self._pending.hot):
            return [r for r in self.finish() if not isinstance(r, int)]
        return self._flush()

    def _flush(self) -> list[KernelEvent]:
        p = self._pending
        if p is None:
            return []
        self._pending = None
        self.records += 1
        return [self._build(p)]

    # ------------------------------------------------------------------ fast path
    def _settle_full(self, out: list) -> None:
        self._settle(out, keep_last=True)

    def _settle_before_hot(self, out: list) -> None:
        self._settle(out, keep_last=False, next_hot=True)

    def _feed_hot(self, out: list, line: str) -> None:
        line = line.rstrip("\r\n")
        out.extend(self._feed(line, True))
        if not line.strip():
            out.append(1)

    def release(self) -> list[KernelEvent | int]:
        """Settle held lines now except the record they end with (a live source calls
        this after each batch, so that a record is not held back by quiet lines)."""
        out: list[KernelEvent | int] = []
        if self._cold:
            self._settle(out, keep_last=True)
        return out

    def finish(self) -> list[KernelEvent | int]:
        """``flush`` for ``feed_many``: settles held lines, then the open record."""
        out: list[KernelEvent | int] = []
        if self._cold:
            self._settle(out, keep_last=False)
        p = self._pending
        if p is not None and not p.hot:
            self._pending = None
            self._ordinary(out, len(p.lines))
        out.extend(self._flush())
        return out

    def _ordinary(self, out: list, n: int, blank: int = 0) -> None:
        if n:
            out.append(n)
            self.ordinary_lines += n - blank

    def _settle(self, out: list, *, keep_last: bool, next_hot: bool = False) -> None:
        """Resolve the held (cold) lines as if each had gone through ``_feed``.

        Only the record the held lines end with can still change (a hot line may
        continue it): with ``next_hot`` it is parsed in full, with ``keep_last`` it
        stays held; everything before it is ordinary.
        """
        cold, self._cold = self._cold, []
        lines = cold  # held lines hold no line break: HotFilter makes such a line hot
        i, n = 0, len(lines)
        p0 = self._pending
        if p0 is not None and p0.hot:  # lines that continue a hot record belong to it
            while i < n and self._pending is p0:
                got = self._feed(lines[i], False)
                out.extend(got)
                if not lines[i].strip():
                    out.append(1)
                i += 1
            if i == n:
                return
        p = self._pending  # None, or a record made of cold lines only
        rest = lines[i:]
        if keep_last or next_hot:
            h = self._last_head(rest, p is not None)
        else:
            h = len(rest)
        if h < 0:  # every held line continues the open (cold) record
            if keep_last:
                self._cold = cold[i:]
                return
            for ln in rest:
                self._feed(ln, False)
            return
        if p is not None:
            self._pending = None
            self._ordinary(out, len(p.lines))
        self._ordinary(out, h, blank_lines(rest[:h]))
        self._advance_ts(rest, h, p is not None)
        if keep_last:
            self._cold = cold[i + h:]
            return
        for ln in rest[h:]:
            out.extend(self._feed(ln, False))
            if not ln.strip():
                out.append(1)

    def _last_head(self, rest: list[str], pending: bool) -> int:
        """Index of the line that starts the last record of ``rest`` (-1: it continues the open one)."""
        for k in range(len(rest) - 1, -1, -1):
            ln = rest[k]
            if not ln.strip():
                return k + 1
            if not self._is_continuation(self._head(ln), pending or k > 0):
                return k
        return -1 if pending else 0

    def _advance_ts(self, rest: list[str], h: int, pending: bool) -> None:
        """``_last_ts`` as the skipped lines ``rest[:h]`` would have left it (the last record head with a time)."""
        for k in range(h - 1, -1, -1):
            ln = rest[k]
            if not ln.strip():
                continue
            head = self._head(ln)
            prev_open = (k > 0 and bool(rest[k - 1].strip())) or (k == 0 and pending)
            if head.ts is not None and not self._is_continuation(head, prev_open):
                self._last_ts = head.ts
                return

    def parse(self, lines: Iterable[str]) -> Iterator[KernelEvent]:
        for line in lines:
            yield from self.feed(line)
        yield from self.flush()

    def _build(self, p: _Pending) -> KernelEvent:
        message = "\n".join(p.messages)
        head = p.head
        kind, m = self.kinds.match(_kind_text(message) if len(p.messages) > 2 else message)
        fields: dict = {}
        xid = pid = None
        pci = None
        if head.host:
            fields["host"] = head.host
        if head.program:
            fields["program"] = head.program
        if head.level:
            fields["level"] = head.level
        if head.repeated:
            fields["repeated"] = head.repeated
        if kind == "xid" and m is not None:
            xid = to_int(m.group("xid"))
            if xid is None:  # a number no Xid is (too long): the text is kept, no Xid claimed
                kind = "nvrm_other"
            pci = _pci_id(m.group("pci"), fields)
            tail = XID_TAIL_RE.match(message[m.end():MATCH_LIMIT])
            if tail:
                pid_s = tail.group("pid").strip("'<>")
                pid = to_int(pid_s)
                name = (tail.group("name") or "").strip()
                if name and name != "<unknown>":
                    fields["process"] = name
                fields["text"] = (tail.group("text") or "").strip()
            else:
                fields["text"] = message[m.end():].lstrip(", ").strip()
            if xid == 154:
                r = RECOVERY_RE.search(message[:MATCH_LIMIT])
                if r:
                    fields["recovery_from"] = r.group(2)
                    fields["recovery_action"] = r.group(4)
                    fields["recovery_code"] = int(r.group(3), 16)
        elif kind == "sxid" and m is not None:
            fields["sxid"] = to_int(m.group("sxid"))
            sw = _pci_id(m.group("pci"), fields)
            if sw:
                fields["switch_pci"] = (m.group("pci") or "").strip().lower().removeprefix("pci:")
            sev = SXID_SEV_RE.search(message[:MATCH_LIMIT])
            if sev:
                fields["sxid_severity"] = "fatal" if sev.group(1).lower() == "fatal" else "non-fatal"
        elif m is not None:
            gd = m.groupdict()
            for key in ("pid", "pid2", "pid3"):
                if gd.get(key):
                    pid = to_int(gd[key])
                    break
            for key in ("comm", "comm2", "task"):
                if gd.get(key):
                    fields["process"] = gd[key]
                    break
            if gd.get("pci"):
                pci = normalize_pci(gd["pci"])
            for key in ("server", "state", "secs", "cpu", "device", "netdev", "array"):
                if gd.get(key):
                    fields[key] = gd[key]
        if kind in ("xid", "fell_off_bus", "nvrm_other"):
            g = PCI_GPU_RE.search(message[:MATCH_LIMIT])
            if g and pci is None:
                pci = normalize_pci(g.group(1))
            if kind == "fell_off_bus" and pci is None:
                pci = self._last_gpu_pci
            if pci:
                self._last_gpu_pci = pci
        elif pci is None and kind != "other":
            a = PCI_ANY_RE.search(message[:MATCH_LIMIT])
            if a:
                fields["device_pci"] = a.group(1).lower()
        gpu = self.gpu_map.get(pci) if pci else None
        return KernelEvent(
            ts=head.ts if head.ts is not None else self._last_ts,
            node=self.node,
            kind=kind,
            raw="\n".join(p.lines),
            message=message,
            xid=xid,
            pci_bus=pci,
            gpu=gpu,
            pid=pid,
            rank=head.rank,
            fields=fields,
        )


def _agent_source(agent: AgentServices, options: dict[str, Any]) -> Source:
    """The agent's ``kernel`` source: the kernel log followed (collectors/follow.py; options: ``path``
    overrides ``agent.kernel_follow``), parsed here."""
    return KernelLogSource(agent, options, "kernel", KernelParser(agent.node, boot_time=boot_time()), KernelEvent)


register_source("kernel", _agent_source)


def _make_parser(node: str = "", *, year: int | None = None, gpu_map: Mapping[str, int] | None = None,
                 boot_time: float | None = None, extra_hot: Iterable[str] = (), **_: Any) -> KernelParser:
    return KernelParser(node, year=year, gpu_map=gpu_map, boot_time=boot_time, extra_hot=extra_hot)


register_log_parser(LogParser("kernel", _make_parser, kernel_kinds, ("kernel.log",)))

