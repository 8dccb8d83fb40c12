"""NCCL / torch.distributed log parsing (``NCCL_DEBUG=INFO|WARN`` output, ProcessGroupNCCL
watchdog lines, IB completion errors, Python tracebacks, C++ terminate blocks).

``NcclParser`` is stateful like the kernel parser: a Python traceback (multi-line,
possibly ``[rankN]:``-prefixed) becomes one record whose ``exception`` is the final
``Type: message``; C++ ``terminate called ...`` / ``frame #N`` blocks are one record.
Rank and host come from the launcher prefix, NCCL's ``host:pid:tid [dev]`` prefix and
``[Rank N]`` in torch messages. What a record is comes from
the [[kind]] entries of collectors/catalogs/nccl.toml; what it means is faultlens.collectors.signatures.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from faultlens.collectors.container_logs import unwrap_container
from faultlens.collectors.follow import LogSource
from faultlens.collectors.ordinary_lines import FastPathParser, blank_lines
from faultlens.collectors.patterns import CATALOGS, KindTable, hot_regex, load_kind_table
from faultlens.collectors.sources import (
    AgentServices,
    LogParser,
    Source,
    register_log_parser,
    register_source,
)
from faultlens.collectors.unparsed import to_int
from faultlens.schema import NcclEvent

LAUNCHER_RE = re.compile(r"^(?:\[\d+\]\s+)?(?:\[(?:default|rank)(\d+)\]:|\[1,(\d+)\]<std(?:out|err)>:)\s?")
SRUN_LABEL_RE = re.compile(r"^\s{0,5}(\d{1,6}): (?=\S)")
ISO_PREFIX_RE = re.compile(r"^\[?(\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d)(?:[,.](\d+))?\]?(?:\s+-\s+|\s+)")
C10_RE = re.compile(r"^\[([EWIFD])(?:(\d\d)(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d+))?)?(?: \d+)? ?([\w./]+:\d+)\]\s?")
NCCL_RE = re.compile(r"^(?P<host>[^\s:\[]+) ?:(?P<pid>\w+):(?P<tid>\d+) \[(?P<dev>\d+)\] (?:(?P<src>\S+:\d+) )?NCCL (?P<level>INFO|WARN|ERROR|TRACE)\s?(?P<msg>.*)$")
NCCL_NOPID_RE = re.compile(r"^(?P<host>[^\s:\[]+?)(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\] (?:(?P<src>\S+:\d+) )?NCCL (?P<level>INFO|WARN|ERROR|TRACE)\s?(?P<msg>.*)$")
RETURN_RE = re.compile(r"NCCL INFO \S+:\d+ -> (\d+)")
RANK_RE = re.compile(r"\[(?:PG [^\]]*?)?Rank (\d+)\]")
EXC_RE = re.compile(r"^(?P<type>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit|Failure|Timeout|Warning)|(?:[a-z_]\w*\.)+[A-Z]\w*)(?::\s?(?P<msg>.*))?$")
NCCL_RESULT_RE = re.compile(r"^nccl\w+: ")
HINT_RE = re.compile(r"^(?:CUDA kernel errors might be asynchronously reported|For debugging consider passing CUDA_LAUNCH_BLOCKING|Compile with `TORCH_USE_CUDA_DSA`|Last error:|Exception raised from |frame #\d+:|what\(\):)")
MAX_RECORD_LINES = 400
# Fast path: what, besides the catalog's words, can make a line more than an ordinary
# one-line record: block starts (tracebacks, C++ terminate), NCCL WARN/ERROR, return
# codes (`file.cc:12 -> 2`), exception type names (EXC_RE), bad bytes, indentation
# (a leading space, or two spaces anywhere: "\n " and "  ") and, on the raw line,
# dotted type names (`a.b.SomeError`). Patterns are written literal-first so that
# `re` skips to the literal (patterns.HotFilter): `\wwarning` as `warning(?<=\wwarning)`.
HOT_WORDS = ("traceback", "terminate called", "frame #", "nccl warn", "nccl error", "last error", "\n ", "  ")
HOT_PATTERNS = (r"warning(?<=\wwarning)", r"exit(?<=\wexit)", r"interrupt(?<=\winterrupt)", r" -> (?<=\d -> )\d")
HOT_RAW = (r"\.[A-Z]",)
TS_HINT_RE = re.compile(r"^(?:\[\d+\]\s+)?(?:\[(?:default|rank)\d+\]:|\[1,\d+\]<std(?:out|err)>:)?\s?(?:\[?\d{4}-\d\d-\d\d|\[[EWIFD]\d{4} )")


@lru_cache(maxsize=1)
def nccl_kinds() -> KindTable:
    return load_kind_table(CATALOGS / "nccl.toml")


@dataclass(slots=True)
class _Line:
    content: str
    rank: int | None = None
    ts: float | None = None
    level: str | None = None
    host: str | None = None
    pid: int | None = None
    nccl: bool = False
    fields: dict = field(default_factory=dict)


@dataclass(slots=True)
class _Pending:
    first: _Line
    block: str  # line | traceback | cpp
    lines: list[str] = field(default_factory=list)
    contents: list[str] = field(default_factory=list)
    exception: str | None = None
    after_last_error: bool = False


class NcclParser(FastPathParser):
    """Lines in, ``NcclEvent`` records out (``feed`` / ``flush``).

    ``feed_many(lines)`` / ``finish()``: the fast path (see KernelParser): a line
    that cannot be anything but an ordinary one-line record is counted in
    ``ordinary_lines`` and never parsed; results equal ``feed`` on every line.
    """

    def __init__(self, node: str = "", *, job: str | None = None, year: int | None = None, default_ts: float = 0.0):
        self.node = node
        self.job = job
        self.year = year or dt.datetime.now(dt.UTC).year
        self.kinds = nccl_kinds()
        self._pending: _Pending | None = None
        self._last_ts = default_ts
        self._cold: list[str] = []
        self._hot = hot_regex(self.kinds.words() + list(HOT_WORDS), patterns=HOT_PATTERNS, raw=HOT_RAW)
        self.lines = 0
        self.records = 0
        self.ordinary_lines = 0

    def _line(self, raw: str) -> _Line:
        rank = None
        s, wrapped_ts = unwrap_container(raw)
        if s[:1].isdigit() or s[:1] == " ":
            m = SRUN_LABEL_RE.match(s)  # srun --label: "3: <the rank's line>"
            if m:
                rank = to_int(m.group(1))
                s = s[m.end():]
        if s.startswith("["):
            m = LAUNCHER_RE.match(s)
            if m:
                rank = to_int(m.group(1) or m.group(2))
                s = s[m.end():]
        ln = _Line(s, rank, wrapped_ts)
        if s[:1].isdigit() or s.startswith("[2") or s.startswith("[1"):
            m = ISO_PREFIX_RE.match(s)
            if m:
                try:
                    t = dt.datetime.strptime(m.group(1).replace(" ", "T"), "%Y-%m-%dT%H:%M:%S").replace(tzinfo=dt.UTC)
                    ln.ts = t.timestamp() + (float("0." + m.group(2)) if m.group(2) else 0.0)
                except (ValueError, OverflowError):  # not a real date: keep the text, no time
                    pass
                s = s[m.end():]
        if s.startswith("[") and len(s) > 2 and s[1] in "EWIFD":
            m = C10_RE.match(s)
            if m:
                ln.level = {"E": "ERROR", "W": "WARN", "I": "INFO", "F": "FATAL", "D": "DEBUG"}[m.group(1)]
                if m.group(2):
                    try:
                        t = dt.datetime(self.year, int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5)), int(m.group(6)), tzinfo=dt.UTC)
                        ln.ts = t.timestamp() + (float("0." + m.group(7)) if m.group(7) else 0.0)
                    except (ValueError, OverflowError):
                        pass
                ln.fields["src"] = m.group(8)
                s = s[m.end():]
        if " NCCL " in s:
            m = NCCL_RE.match(s) or NCCL_NOPID_RE.match(s)
            if m:
                ln.nccl = True
                ln.host = m.group("host")
                ln.pid = to_int(m.group("pid"))
                ln.level = m.group("level")
                ln.fields["cuda_dev"] = to_int(m.group("dev"))
                if m.group("src"):
                    ln.fields["src"] = m.group("src")
                # keep NCCL's own text (source file, level, message): the source file says what failed
                s = s[m.start("src") if m.group("src") else m.start("level") - 5:]
        if ln.rank is None:
            r = RANK_RE.search(s)
            if r:
                ln.rank = to_int(r.group(1))
        ln.content = s
        return ln

    def reset(self) -> None:
        """Forget the open record and held lines (after a line the parser failed on: collectors/unparsed.py)."""
        self._pending = None
        self._cold = []

    def feed(self, raw: str) -> list[NcclEvent]:
        out: list = []
        if self._cold:
            self._settle(out)
        self.lines += 1
        out.extend(self._feed(raw))
        return [r for r in out if not isinstance(r, int)]

    def _settle_full(self, out: list) -> None:
        self._settle(out)

    def _settle_before_hot(self, out: list) -> None:
        self._settle(out)

    def _feed_hot(self, out: list, line: str) -> None:
        out.extend(self._feed(line))
        if not line.strip():
            out.append(1)

    def release(self) -> list[NcclEvent | int]:
        """Settle held lines now (a live source calls this after each batch)."""
        out: list[NcclEvent | int] = []
        if self._cold:
            self._settle(out)
        return out

    def finish(self) -> list[NcclEvent | int]:
        """``flush`` for ``feed_many``."""
        out: list[NcclEvent | int] = []
        if self._cold:
            self._settle(out)
        out.extend(self._flush())
        return out

    def _settle(self, out: list) -> None:
        """Held lines: those that continue an open multi-line block are parsed; the rest are ordinary."""
        cold, self._cold = self._cold, []
        i, n = 0, len(cold)
        p0 = self._pending
        if p0 is not None and p0.block != "line":
            while i < n and self._pending is p0:
                out.extend(self._feed(cold[i]))
                if not cold[i].strip():
                    out.append(1)
                i += 1
        p = self._pending
        if p is not None and p is not p0 and p.block == "line" and i > 0:
            self._pending = None  # opened by a held line: an ordinary one-line record
            out.append(1)
            self.ordinary_lines += 1
        elif p is not None and i < n:
            if p.block != "line":  # not expected: parse the rest in full rather than guess
                for ln in cold[i:]:
                    out.extend(self._feed(ln))
                    if not ln.strip():
                        out.append(1)
                return
            out.extend(self._flush())  # a one-line record ends at the next line
        rest = cold[i:]
        if rest:
            out.append(len(rest))
            self.ordinary_lines += len(rest) - blank_lines(rest)
            for ln in reversed(rest):
                if TS_HINT_RE.match(ln):
                    ts = self._line(ln.rstrip("\r\n")).ts
                    if ts is not None:
                        self._last_ts = ts
                        break

    def _feed(self, raw: str) -> list[NcclEvent]:
        raw = raw.rstrip("\r\n")
        if not raw.strip():
            return self._flush()
        ln = self._line(raw)
        c = ln.content
        p = self._pending
        indented = c[:1] in (" ", "\t")
        cs = c.strip()
        if p is not None and len(p.lines) < MAX_RECORD_LINES and not ln.nccl:
            if p.block == "traceback":
                if p.exception is None:
                    if indented or cs.startswith("^") or cs.startswith("~"):
                        return self._append(p, raw, c)
                    m = EXC_RE.match(cs)
                    if m or cs.startswith("File "):
                        p.exception = cs if m else None
                        return self._append(p, raw, c)
                    # a non-indented source line quoted before the exception (trimmed tracebacks)
                    if not ln.level and len(p.lines) < 3 and EXC_RE.match(cs) is None and ": " not in cs[:40]:
                        return self._append(p, raw, c)
                elif NCCL_RESULT_RE.match(cs) or HINT_RE.match(cs) or p.after_last_error:
                    p.after_last_error = cs.startswith("Last error:")
                    return self._append(p, raw, c)
            elif p.block == "cpp":
                if indented or HINT_RE.match(cs) or p.after_last_error:
                    p.after_last_error = False
                    return self._append(p, raw, c)
            elif p.block == "error":
                if NCCL_RESULT_RE.match(cs) or HINT_RE.match(cs) or p.after_last_error:
                    p.after_last_error = cs.startswith("Last error:")
                    return self._append(p, raw, c)
        out = self._flush()
        if ln.ts is not None:
            self._last_ts = ln.ts
        if cs.startswith("Traceback (most recent call last)") or (indented and not ln.nccl):
            block = "traceback"
        elif cs.startswith(("terminate called after throwing", "Exception raised from ", "frame #")):
            block = "cpp"
        elif EXC_RE.match(cs) or "NCCL error" in cs:
            block = "error"
        else:
            block = "line"
        self._pending = _Pending(ln, block, [raw], [c])
        if block == "error" and EXC_RE.match(cs):
            self._pending.exception = cs
        return out

    def _append(self, p: _Pending, raw: str, content: str) -> list[NcclEvent]:
        p.lines.append(raw)
        p.contents.append(content)
        return []

    def flush(self) -> list[NcclEvent]:
        """The record still open (held ordinary lines are settled and left out)."""
        if self._cold:
            return [r for r in self.finish() if not isinstance(r, int)]
        return self._flush()

    def _flush(self) -> list[NcclEvent]:
        p = self._pending
        if p is None:
            return []
        self._pending = None
        self.records += 1
        return [self._build(p)]

    def parse(self, lines: Iterable[str]) -> Iterator[NcclEvent]:
        for line in lines:
            yield from self.feed(line)
        yield from self.flush()

    def _build(self, p: _Pending) -> NcclEvent:
        first = p.first
        message = "\n".join(p.contents)
        fields = dict(first.fields)
        kind, m = self.kinds.match(message)
        op = seq = timeout = ran = None
        if kind == "watchdog_timeout" and m is not None:
            seq = to_int(m.group("seq"))
            op = m.group("op")
            timeout = to_int(m.group("timeout"))
            ran = to_int(m.group("ran"))
        elif kind == "watchdog_exception" and m is not None:
            seq = to_int(m.group("seq"))
            for k in ("enq", "done"):
                if m.group(k):
                    fields["last_enqueued" if k == "enq" else "last_completed"] = to_int(m.group(k))
        elif m is not None:
            for k, v in m.groupdict().items():
                if v is not None:
                    fields[k] = v if (n := to_int(v)) is None else n
        if first.nccl and first.level == "INFO" and kind in ("socket_error", "ib_error", "comm_abort"):
            kind = "other"  # NCCL's INFO lines narrate normal teardown; errors come at WARN
        if kind == "other":
            if p.block == "traceback":
                kind = "traceback"
            elif p.block == "cpp":
                kind = "cpp_exception"
            elif p.exception:
                kind = "exception"
            elif first.nccl:
                c = first.content
                if first.level == "WARN" or first.level == "ERROR":
                    kind = "nccl_warn"
                elif (ret := RETURN_RE.search(c)) is not None:
                    kind = "nccl_return"
                    fields["return_code"] = to_int(ret.group(1))
                else:
                    kind = "nccl_info"
        rank = first.rank
        if rank is None:
            r = RANK_RE.search(message)
            if r:
                rank = to_int(r.group(1))
        return NcclEvent(
            ts=first.ts if first.ts is not None else self._last_ts,
            node=self.node,
            kind=kind,
            raw="\n".join(p.lines),
            message=message,
            level=first.level,
            rank=rank,
            host=first.host,
            pid=first.pid,
            job=self.job,
            op_type=op,
            seq_num=seq,
            timeout_ms=timeout,
            ran_for_ms=ran,
            exception=p.exception,
            fields=fields,
        )




def _agent_source(agent: AgentServices, options: dict[str, Any]) -> Source:
    """The agent's ``nccl`` source: NCCL/torch logs followed (collectors/follow.py; options: ``glob``
    overrides ``agent.nccl_glob``), parsed here."""
    opts = {"glob": agent.config.agent.nccl_glob, **options}
    return LogSource(agent, opts, "nccl", NcclParser(agent.node, job=agent.job), NcclEvent)


register_source("nccl", _agent_source)


def _make_parser(node: str = "", *, job: str | None = None, year: int | None = None, default_ts: float = 0.0,
                 **_: Any) -> NcclParser:
    return NcclParser(node, job=job, year=year, default_ts=default_ts)


register_log_parser(LogParser("nccl", _make_parser, nccl_kinds, ("nccl/*.log",)))

