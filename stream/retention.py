"""Lake retention: each table kept to an age and a size, old hours dropped whole.

A 200k-GPU fleet writes ~20 MB/s of GPU samples; without a bound the lake only
grows. Per table (``[retention]`` in faultlens.config: ``max_age_days``,
``max_gb``, and per-table ``tables = ["gpu=7:500"]``):

1. hours whose end is older than the age bound are dropped;
2. then, while the table is over its size bound, its oldest hours are dropped
   (never the newest hour: the bound cannot stop ingest).

A drop is atomic and never happens under a query: with the lake's reader lock
held exclusively (``reading`` takes it shared around each of the explorer's and
the report's queries; a drop waits ``lock_wait_s`` for them, then skips the
round), each hour directory is renamed into ``_manifest/expired/`` (one rename:
a reader sees the hour whole or not at all), then deleted; an emptied date
directory goes too. A crash between the two leaves only ``_manifest/expired/``,
which the next round empties. Each round also folds the processor's de-duplication
marks (``_seq/``) into one file and forgets restarted agents' old epochs
(``compact_seq_files``, ``seq_keep_s``). Run it where compaction runs
(``faultlens stream --retention``, e.g. hourly from cron).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from faultlens.config import RetentionConfig
from faultlens.errors import ConfigError
from faultlens.files import fsync_dir
from faultlens.stream.dedupe import SeqCompaction, compact_seq_files
from faultlens.stream.lake import MANIFEST_DIR

LOCK_FILE = f"{MANIFEST_DIR}/readers.lock"
EXPIRED_DIR = f"{MANIFEST_DIR}/expired"


@dataclass(frozen=True)
class Bound:
    max_age_s: float  # 0: none
    max_bytes: int  # 0: none


@dataclass
class RetentionReport:
    dropped_hours: dict[str, int] = field(default_factory=dict)  # table -> hours dropped
    dropped_bytes: int = 0
    kept_bytes: dict[str, int] = field(default_factory=dict)  # table -> bytes left
    skipped: bool = False  # readers held the lock past lock_wait_s: nothing dropped this round
    seq: SeqCompaction | None = None  # the _seq files folded (stream/dedupe.py)


def bounds(cfg: RetentionConfig) -> tuple[Bound, dict[str, Bound]]:
    """The default bound and the per-table ones; ConfigError naming a malformed ``tables`` entry."""
    default = Bound(cfg.max_age_days * 86400.0, int(cfg.max_gb * 1e9))
    per: dict[str, Bound] = {}
    for item in cfg.tables:
        name, sep, rest = item.partition("=")
        days, _, gb = rest.partition(":")
        try:
            if not sep or not name.strip():
                raise ValueError
            per[name.strip()] = Bound(float(days) * 86400.0, int(float(gb or cfg.max_gb) * 1e9))
        except ValueError:
            raise ConfigError(f"expected TABLE=DAYS or TABLE=DAYS:GB, got {item!r}", key="retention.tables") from None
    return default, per


@contextlib.contextmanager
def _lock(lake: Path, mode: int) -> Iterator[bool]:
    path = lake / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as fh:
        try:
            fcntl.flock(fh.fileno(), mode)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def reading(lake: str | os.PathLike[str]) -> Iterator[None]:
    """Around one query of the lake: no hour is dropped while it runs."""
    lake = Path(lake)
    if not (lake / MANIFEST_DIR).is_dir():  # nothing committed, nothing dropped yet: no lock file to make
        yield
        return
    with _lock(lake, fcntl.LOCK_SH):
        yield


def _hours(table_dir: Path) -> list[tuple[float, Path, int]]:
    """(hour start, directory, bytes) of every hour of a table, oldest first."""
    out = []
    for d in table_dir.glob("date=*/hour=*"):
        try:
            day = dt.datetime.strptime(d.parent.name[5:], "%Y-%m-%d").replace(tzinfo=dt.UTC)
            start = day.timestamp() + 3600 * int(d.name[5:])
        except ValueError:
            continue
        size = sum(f.stat().st_size for f in d.glob("*.parquet"))
        out.append((start, d, size))
    return sorted(out)


def _drop(lake: Path, hour_dir: Path) -> None:
    expired = lake / EXPIRED_DIR
    expired.mkdir(parents=True, exist_ok=True)
    table, date = hour_dir.parent.parent.name, hour_dir.parent.name
    gone = expired / f"{table}-{date}-{hour_dir.name}-{uuid.uuid4().hex[:8]}"
    os.replace(hour_dir, gone)  # one rename: the hour leaves every glob at once
    fsync_dir(hour_dir.parent)
    shutil.rmtree(gone, ignore_errors=True)
    with contextlib.suppress(OSError):
        hour_dir.parent.rmdir()  # the date, once its last hour is gone


def apply_retention(lake_path: str | os.PathLike[str], cfg: RetentionConfig, *,
                    now: float | None = None) -> RetentionReport:
    """Drop what the bounds no longer keep, table by table; see the module docstring."""
    lake = Path(lake_path)
    now = time.time() if now is None else now
    default, per = bounds(cfg)
    report = RetentionReport()
    shutil.rmtree(lake / EXPIRED_DIR, ignore_errors=True)  # a crash's leftovers
    deadline = time.monotonic() + cfg.lock_wait_s
    while True:
        with _lock(lake, fcntl.LOCK_EX | fcntl.LOCK_NB) as held:
            if held:
                for table_dir in sorted(p for p in lake.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))):
                    _apply_table(lake, table_dir, per.get(table_dir.name, default), now, report)
                # commit ids carry the wall clock, whatever ``now`` the tables were judged at
                report.seq = compact_seq_files(lake, committed_ids(lake), now=time.time(), keep_s=cfg.seq_keep_s)
                return report
        if time.monotonic() >= deadline:
            report.skipped = True
            return report
        time.sleep(0.2)


def committed_ids(lake: Path) -> set[str]:
    """Every commit id the processor's manifest holds."""
    files = [str(f) for f in (lake / MANIFEST_DIR).glob("m-*.parquet")]
    if not files:
        return set()
    return {c for c in pq.ParquetDataset(files).read(columns=["commit_id"]).column("commit_id").to_pylist() if c}


def _apply_table(lake: Path, table_dir: Path, bound: Bound, now: float, report: RetentionReport) -> None:
    hours = _hours(table_dir)
    total = sum(h[2] for h in hours)
    dropped = 0
    for i, (start, d, size) in enumerate(hours):
        newest = i == len(hours) - 1
        too_old = bound.max_age_s > 0 and start + 3600 <= now - bound.max_age_s
        too_big = bound.max_bytes > 0 and total > bound.max_bytes
        if newest or not (too_old or too_big):
            break
        _drop(lake, d)
        total -= size
        report.dropped_bytes += size
        dropped += 1
    if dropped:
        report.dropped_hours[table_dir.name] = dropped
    report.kept_bytes[table_dir.name] = total
