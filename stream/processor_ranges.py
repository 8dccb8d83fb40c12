"""The offset ranges a stream processor holds per topic partition until a commit names them:
being decoded (``PendingRange``), written but not yet committed (``WrittenRange``), and the
file names that say which range a lake file holds.
"""

from __future__ import annotations

import re
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from faultlens import schema
from faultlens.stream.decode_arrow import Decoded

# <kind>-p<partition>-o<first>-<last>-<commit>[-h<hour>].parquet
PROCESSOR_FILE = re.compile(r"^(?P<kind>[a-z_-]+?)-p(?P<partition>\d+)-o(?P<first>\d+)-(?P<last>\d+)-(?P<commit>[0-9a-f]+)(?:-h\d+)?\.parquet$")


def wait_for(fut: Future[Any]) -> None:
    """Wait for a future without raising (its error surfaces where its result is used)."""
    fut.exception()


@dataclass
class PendingRange:
    kind: str
    first: int
    last: int
    decoding: list[Future[Decoded]] = field(default_factory=list)
    messages: int = 0
    chunk_first: int = -1  # first offset of ``decoding`` (ranges before it are in ``ahead``)
    rows_est: int = 0  # rows in ``decoding``, estimated
    ahead: list[Future[WrittenRange]] = field(default_factory=list)  # ranges written ahead (writer pool), not yet committed
    seqs: list[tuple[tuple[str, int, str], int]] = field(default_factory=list)  # natural keys taken (stream/dedupe.py)


@dataclass
class WrittenRange:
    """Files of one offset range, written but named by no manifest yet (the commit names them)."""

    manifest: list[dict[str, Any]]
    rows: Counter[str]
    dead: Counter[str]
    quarantine: list[schema.Quarantine]
    unknown: Counter[str]
