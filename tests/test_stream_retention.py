"""Lake retention (issue 37.1): per table by age and by size, whole hours dropped atomically, never
under a query of the explorer."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from faultlens.cli import main
from faultlens.config import RetentionConfig
from faultlens.errors import ConfigError
from faultlens.schema import GpuSample, GpuState, KernelEvent
from faultlens.stream.lake import LakeWriter
from faultlens.stream.retention import EXPIRED_DIR, apply_retention, bounds, reading
from faultlens.ui import lake as ui_lake

NOW = 1_780_000_000.0 // 3600 * 3600  # an hour boundary
DAY = 86400.0


def _lake(path: Path, days: int = 4) -> Path:
    """One GPU sample and one kernel line per hour for ``days`` days before NOW."""
    w = LakeWriter(path)
    hours = [NOW - (h + 0.5) * 3600 for h in range(days * 24)]
    w.write("gpu", [GpuSample(ts=ts, node="n001", gpus=[GpuState(index=0, uuid="GPU-0", temp_c=60.0)]) for ts in hours])
    w.write("kernel", [KernelEvent(ts=ts, node="n001", kind="other", raw=f"line {ts} " + "x" * 200) for ts in hours])
    return path


def _hours(lake: Path, table: str) -> int:
    return len(list((lake / table).glob("date=*/hour=*")))


def test_age_and_size_bounds_per_table(tmp_path: Path) -> None:
    lake = _lake(tmp_path / "lake")
    assert _hours(lake, "gpu") == _hours(lake, "kernel") == 96
    kernel_bytes = sum(f.stat().st_size for f in (lake / "kernel").rglob("*.parquet"))
    per_hour = kernel_bytes / 96
    cfg = RetentionConfig(max_age_days=2, tables=(f"kernel=0:{per_hour * 24.5 / 1e9}",))
    report = apply_retention(lake, cfg, now=NOW)
    assert not report.skipped
    assert _hours(lake, "gpu") == 2 * 24  # hours ending more than 2 days ago are gone
    assert _hours(lake, "kernel") == 24  # no age bound; the newest that fit the size bound
    assert report.dropped_hours == {"gpu": 48, "kernel": 72}
    assert report.kept_bytes["kernel"] <= per_hour * 24.5
    assert not list((lake / "gpu").glob("date=*")) or all(any(d.iterdir()) for d in (lake / "gpu").glob("date=*"))
    assert not (lake / EXPIRED_DIR).exists() or not any((lake / EXPIRED_DIR).iterdir())
    # what is left still reads
    con = ui_lake.connect(lake)
    try:
        assert ui_lake.fetch_rows(con, "SELECT count(*) FROM gpu")[0][0] == 2 * 24
    finally:
        con.close()
    # the newest hour is never dropped, whatever the bound
    apply_retention(lake, RetentionConfig(max_age_days=0.0001, max_gb=1e-9), now=NOW + 30 * DAY)
    assert _hours(lake, "gpu") == 1 and _hours(lake, "kernel") == 1


def test_a_drop_waits_for_a_query_and_skips_when_it_does_not_end(tmp_path: Path) -> None:
    lake = _lake(tmp_path / "lake", days=2)
    apply_retention(lake, RetentionConfig(max_age_days=30), now=NOW)  # makes the lock file; drops nothing
    con = ui_lake.connect(lake)
    in_query = threading.Event()
    release = threading.Event()

    def long_query() -> None:
        with reading(lake):
            in_query.set()
            release.wait(10)

    t = threading.Thread(target=long_query)
    t.start()
    try:
        assert in_query.wait(5)
        report = apply_retention(lake, RetentionConfig(max_age_days=1, lock_wait_s=0.5), now=NOW)
        assert report.skipped and _hours(lake, "gpu") == 48  # nothing dropped under the query
        threading.Timer(0.3, release.set).start()
        started = time.monotonic()
        report = apply_retention(lake, RetentionConfig(max_age_days=1, lock_wait_s=10), now=NOW)
        assert not report.skipped and time.monotonic() - started >= 0.2 and _hours(lake, "gpu") == 24
        assert ui_lake.fetch_rows(con, "SELECT count(*) FROM gpu")[0][0] == 24
    finally:
        release.set()
        t.join(10)
        con.close()


def test_bad_table_bounds_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="TABLE=DAYS"):
        bounds(RetentionConfig(tables=("gpu",)))
    _lake(tmp_path / "lake", days=3)
    assert main(["stream", "--retention", "--lake", str(tmp_path / "lake"), "--set", "retention.max_age_days=1"]) == 0
    # the real clock: every hour of the fixture lake is years old, the newest is kept
    assert _hours(tmp_path / "lake", "gpu") == 1
