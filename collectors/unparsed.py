"""The one error path for input that does not parse: an ``Unparsed`` record and a counter.

Every parser is total: for any line it returns records, nothing, or -- when it
raises, or the line cannot be read as text at all -- an ``Unparsed`` with the
reason. ``explain`` shows such a line as category ``unparsed`` with that reason;
the batch reader (``faultlens diagnose DIR``) lists them in its report. The run
always goes on: one corrupt line never stops a post-mortem.

``read_lines`` is the reader both use: lines from a binary file object, decoded
with replacement characters, a line over ``MAX_LINE_BYTES`` cut there (so a
100 MB line costs 1 MiB of memory, not 100 MB); ``sniff_binary`` says when a
file is not text at all (NUL bytes, or mostly bytes that are not UTF-8).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

MAX_LINE_BYTES = 1 << 20  # as collectors/follow.py: a longer line is cut here and not parsed
MAX_LINE_CHARS = MAX_LINE_BYTES
RAW_CLIP = 400  # characters of the raw text an Unparsed keeps
KEEP = 1000  # Unparsed records an UnparsedLog keeps (it counts them all)
SNIFF_BYTES = 8192
MAX_DIGITS = 18  # a number field longer than this is no number a log means (and would not fit 64 bits)

LONG_LINE = "line too long"
NOT_TEXT = "not a text file"


def clip(text: str, limit: int = RAW_CLIP) -> str:
    """``text`` cut to ``limit`` characters, saying how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit:,} more characters]"


def reason_of(exc: BaseException) -> str:
    """A one-line reason for an exception a parser raised."""
    msg = str(exc).replace("\n", " ")
    return clip(f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__, 200)


@dataclass(frozen=True, slots=True)
class Unparsed:
    """One unit of input that gave no record: where it was, why, and its text (clipped)."""

    source: str  # kernel | nccl | steps | stack | nvsmi | gpu | a file path
    line_no: int | None
    reason: str
    raw: str

    @classmethod
    def of(cls, source: str, line_no: int | None, reason: str, raw: str | bytes) -> Unparsed:
        if isinstance(raw, (bytes, bytearray)):
            raw = bytes(raw[: RAW_CLIP * 4]).decode("utf-8", "replace") + ("..." if len(raw) > RAW_CLIP * 4 else "")
        return cls(source, line_no, reason, clip(raw))

    def __str__(self) -> str:
        where = f"{self.source}:{self.line_no}" if self.line_no is not None else self.source
        return f"{where}: {self.reason}: {self.raw!r}" if self.raw else f"{where}: {self.reason}"

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "line_no": self.line_no, "reason": self.reason, "raw": self.raw}


@dataclass
class UnparsedLog:
    """Counts every Unparsed (in all and per reason) and keeps the first ``keep``."""

    keep: int = KEEP
    count: int = 0
    by_reason: Counter[str] = field(default_factory=Counter)
    first: list[Unparsed] = field(default_factory=list)

    def add(self, source: str, line_no: int | None, reason: str, raw: str | bytes = "") -> Unparsed:
        u = Unparsed.of(source, line_no, reason, raw)
        self.count += 1
        self.by_reason[_reason_key(reason)] += 1
        if len(self.first) < self.keep:
            self.first.append(u)
        return u

    def summary(self, few: int = 5) -> list[str]:
        """Markdown lines: the count, the reasons, the first ``few``."""
        if not self.count:
            return []
        out = [f"{self.count:,} input line(s) or file(s) did not parse (kept as unparsed, the run went on).", ""]
        out += [f"- {n:,} x {r}" for r, n in self.by_reason.most_common(10)]
        out += ["", f"First {min(few, len(self.first))}:", ""]
        out += [f"- `{str(u)[:300].replace('`', chr(39))}`" for u in self.first[:few]]
        return out


def _reason_key(reason: str) -> str:
    """The reason without its particulars (numbers, paths, quoted values), to count alike reasons together."""
    head, _, rest = reason.partition(": ")
    if head.endswith(("Error", "Exception")) and rest:  # an exception: its type and the start of its message
        return f"{head}: {_PARTICULARS.split(rest, maxsplit=1)[0][:60].strip()}"
    return _DETAIL.split(reason, maxsplit=1)[0]


_PARTICULARS = re.compile(r" \(|: |\d")
_DETAIL = re.compile(r" \(|: ")


def to_int(text: str | None) -> int | None:
    """A matched number as an int; None when there is none, it is not decimal, or it has more than MAX_DIGITS digits."""
    if not text:
        return None
    if not text.isdecimal() or len(text) > MAX_DIGITS:
        return None
    return int(text)


def sniff_binary(head: bytes) -> str | None:
    """Why ``head`` (a file's first bytes) is not text, or None when it is.

    Runs of NUL bytes alone do not make a file binary: a syslog file after a hard reset
    often holds a block of them, and the lines around it still matter. What is left
    without them must be text: mostly UTF-8 and few control characters.
    """
    if not head:
        return None
    rest = head.replace(b"\x00", b"")
    if len(rest) < min(64, len(head)):
        return f"{NOT_TEXT} (binary: {len(head) - len(rest):,} of its first {len(head):,} bytes are NUL)"
    text = rest.decode("utf-8", "replace")
    odd = text.count("\ufffd") + sum(1 for c in text if c < " " and c not in _TEXT_CONTROLS)
    if odd > len(text) // 10:
        return f"{NOT_TEXT} (binary: {odd:,} of its first {len(head):,} bytes are control bytes or not UTF-8)"
    return None


_TEXT_CONTROLS = "\t\n\r\x0b\x0c\x1b"


def read_byte_lines(fh: IO[bytes], *, max_bytes: int | None = None, chunk_bytes: int = 32 * 1024) -> Iterator[bytes]:
    """The lines of a binary file object without their line break; a line over MAX_LINE_BYTES is
    cut to MAX_LINE_BYTES + 1 bytes (the rest is read and dropped, never held), so ``too_long``
    still says so downstream while memory stays bounded.

    Read in chunks split on line breaks, not a ``readline`` a line: a 2,048-GPU post-mortem reads ~3 million
    NVML lines, and the per-line call was ~10% of it. ``read1`` where the object has it, so that a pipe's
    lines come as they arrive (``faultlens explain -``). A chunk's lines are held until they are taken, and
    a big post-mortem merges 1,024 nodes' files at once: chunks of 1 MB held 2.6 GB at 8,192 GPUs, 32 KB ~32 MB."""
    limit = (MAX_LINE_BYTES if max_bytes is None else max_bytes) + 1
    read = getattr(fh, "read1", fh.read)
    head = b""  # the start of the line not ended yet
    cut = False  # that line is over the limit: its first ``limit`` bytes are kept, the rest dropped
    while True:
        chunk = read(chunk_bytes)
        if not chunk:
            break
        if cut:
            end = chunk.find(b"\n")
            if end < 0:
                continue
            yield head
            head, cut, chunk = b"", False, chunk[end + 1:]
        lines = chunk.split(b"\n")
        if head:
            lines[0] = head + lines[0]
        head = lines.pop()
        for line in lines:
            yield line if len(line) <= limit else line[:limit]
        if len(head) > limit:
            head, cut = head[:limit], True
    if head:
        yield head


def read_lines(fh: IO[bytes], on_bad_text: Callable[[int, bytes], None] | None = None) -> Iterator[str]:
    """``read_byte_lines`` as UTF-8 text (bytes that are not UTF-8 replaced: ``on_bad_text(line_no, raw)`` is told)."""
    for no, raw in enumerate(read_byte_lines(fh), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            line = raw.decode("utf-8", "replace")
            if on_bad_text is not None:
                on_bad_text(no, raw)
        yield line[:-1] if line.endswith("\r") else line


def too_long(line: str) -> bool:
    return len(line) > MAX_LINE_CHARS


def guarded_parse(parser: Any, lines: Iterable[str], source: str, log: UnparsedLog,
                  errors: list[str] | None = None) -> Iterator[Any]:
    """``parser.parse(lines)`` that never raises: a line the parser fails on (or one too long to
    parse) goes to ``log`` (and ``errors``, as text) with the reason, the open record is closed
    (a too-long line ends it like a blank line), and the rest go on."""

    def bad(no: int | None, reason: str, raw: str = "") -> None:
        u = log.add(source, no, reason, raw)
        if errors is not None:
            errors.append(str(u))

    for no, line in enumerate(lines, 1):
        if too_long(line):
            bad(no, f"{LONG_LINE} (over {MAX_LINE_BYTES:,} bytes; not parsed)", line)
            line = ""
        try:
            got = parser.feed(line)
        except Exception as exc:  # noqa: BLE001 - one bad line must not stop the file
            bad(no, reason_of(exc), line)
            got = recover(parser)
        yield from got
    try:
        got = parser.flush()
    except Exception as exc:  # noqa: BLE001
        bad(None, f"at the end of the input: {reason_of(exc)}")
        got = []
        parser.reset()
    yield from got


def recover(parser: Any) -> list[Any]:
    """After a failed ``feed``: the records the parser still holds, then a clean state."""
    try:
        got: list[Any] = list(parser.flush())
    except Exception:  # noqa: BLE001 - whatever it held is lost with the line
        got = []
    parser.reset()
    return got
