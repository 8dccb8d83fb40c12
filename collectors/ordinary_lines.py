"""The ordinary-line fast path shared by the kernel and NCCL parsers (``feed_many``).

Most lines of a node's logs are everyday noise that no catalog entry can match.
``feed_many`` finds the chunk's hot lines in one scan (``patterns.HotFilter``),
holds the runs of cold lines between them unparsed, and lets the parser settle
them: as ordinary (counted, never built) unless a later line continues their
record. A parser supplies the three steps below; the result equals feeding every
line through the parser's ``feed``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from itertools import islice
from typing import Any

from faultlens.collectors.patterns import HotFilter

CHUNK_LINES = 4096  # lines scanned at once: bounds memory for a 100 MB file fed as one iterable
COLD_MAX = (
    512  # ordinary lines held back (a later line may continue their record) before they are settled
)


def blank_lines(lines: list[str]) -> int:
    """How many of ``lines`` are empty or whitespace (``not line.strip()``), counted in C."""
    return lines.count("") + sum(map(str.isspace, lines))


class FastPathParser(ABC):
    """Base of a line parser with ``feed_many``; subclasses set ``_hot``, ``_cold`` and ``lines``."""

    _hot: HotFilter
    _cold: list[str]
    lines: int

    @abstractmethod
    def _settle_full(self, out: list[Any]) -> None:
        """``COLD_MAX`` lines are held: settle them (the record they end with may stay held)."""

    @abstractmethod
    def _settle_before_hot(self, out: list[Any]) -> None:
        """A hot line follows the held lines: settle them all."""

    @abstractmethod
    def _feed_hot(self, out: list[Any], line: str) -> None:
        """Parse one hot line in full, appending what it completes to ``out``."""

    def feed_many(
        self, lines: Iterable[str], on_error: Callable[[str, Exception], None] | None = None
    ) -> list[Any]:
        """Many lines at once. Returns, in line order, records and ints: an int ``n``
        stands for the next ``n`` lines, which belong to no returned record (ordinary
        or empty lines; ``ordinary_lines`` counts the ordinary ones). ``on_error``:
        a line whose parse raises is reported there (and is in no result) instead
        of stopping the batch."""
        out: list[Any] = []
        it = iter(lines)
        while chunk := list(islice(it, CHUNK_LINES)):
            prev = 0
            for i in (*self._hot.hot_indexes(chunk), len(chunk)):
                if i > prev:
                    self._hold(out, chunk, prev, i, on_error)
                if i < len(chunk):
                    line = chunk[i]
                    try:
                        if self._cold:
                            self._settle_before_hot(out)
                        self._feed_hot(out, line)
                    except Exception as exc:
                        if on_error is None:
                            raise
                        on_error(line, exc)
                prev = i + 1
            self.lines += len(chunk)
        return out

    def _hold(
        self,
        out: list[Any],
        chunk: list[str],
        start: int,
        stop: int,
        on_error: Callable[[str, Exception], None] | None,
    ) -> None:
        """Hold the cold lines ``chunk[start:stop]``, settling each time ``COLD_MAX`` are held."""
        while start < stop:
            take = min(
                stop - start, max(1, COLD_MAX - len(self._cold))
            )  # a held record may fill it
            self._cold.extend(chunk[start : start + take])
            start += take
            if len(self._cold) >= COLD_MAX:
                try:
                    self._settle_full(out)
                except Exception as exc:
                    if on_error is None:
                        raise
                    on_error(chunk[start - 1], exc)
