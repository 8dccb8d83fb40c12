"""Compaction: merge the small files of a closed table hour into one.

Safe against crashes and against the manifest:

1. Only committed files take part (processor files the manifest names, and
   ``w-``/``c-`` files), and only in hours untouched for ``min_age_s``.
2. The merged rows go to a hidden temporary file, fsynced.
3. A redo record ``_manifest/compactions/<id>.json`` {new, tmp, old: [...]} is
   written atomically: from here on the compaction *will* complete.
4. The temporary file is renamed to ``c-<id>.parquet``, the old files are
   deleted, the record is deleted.

``recover`` finishes any compaction a crash interrupted after step 3 and
removes the temporary files of those interrupted before it. Readers may see an
hour's rows twice for the instant between the rename and the deletions. Run
compaction in one process per lake (``faultlens stream --compact``, e.g. hourly
from cron); the processor never rewrites files itself.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from faultlens.files import fsync_dir
from faultlens.stream.lake import MANIFEST_DIR, write_parquet_atomic

RECORD_DIR = f"{MANIFEST_DIR}/compactions"


@dataclass
class CompactionReport:
    partitions: int = 0
    files_in: int = 0
    files_out: int = 0
    recovered: int = 0


def _committed_processor_files(lake: Path) -> set[str]:
    files = list((lake / MANIFEST_DIR).glob("m-*.parquet"))
    if not files:
        return set()
    t = pq.ParquetDataset([str(f) for f in files]).read(columns=["file"])
    return {f for f in t.column("file").to_pylist() if f}


def recover(lake_path: str | os.PathLike[str]) -> int:
    """Finish compactions interrupted after their redo record; drop earlier leftovers."""
    lake = Path(lake_path)
    done = 0
    pending_tmps = set()
    for rec_path in sorted((lake / RECORD_DIR).glob("*.json")):
        rec = json.loads(rec_path.read_text())
        new, tmp = lake / rec["new"], lake / rec["tmp"]
        pending_tmps.add(tmp)
        if not new.exists() and tmp.exists():
            os.replace(tmp, new)
        if new.exists():
            for old in rec["old"]:
                (lake / old).unlink(missing_ok=True)
        rec_path.unlink()
        done += 1
    for tmp in lake.glob("*/date=*/hour=*/.c-*.parquet.tmp"):
        if tmp not in pending_tmps:
            tmp.unlink(missing_ok=True)
    return done


def compact_lake(lake_path: str | os.PathLike[str], *, min_age_s: float = 3600.0, min_files: int = 4) -> CompactionReport:
    """Compact every table hour of the lake with at least ``min_files`` committed files."""
    lake = Path(lake_path)
    report = CompactionReport(recovered=recover(lake))
    committed = _committed_processor_files(lake)
    now = time.time()
    for hour_dir in sorted(lake.glob("*/date=*/hour=*")):
        if hour_dir.parts[-3] == MANIFEST_DIR:
            continue
        files = []
        for f in sorted(hour_dir.glob("*.parquet")):
            rel = f.relative_to(lake).as_posix()
            if f.name.startswith(("w-", "c-")) or rel in committed:
                files.append(f)
        if len(files) < min_files or max(f.stat().st_mtime for f in files) > now - min_age_s:
            continue
        compact_files(lake, files)
        report.partitions += 1
        report.files_in += len(files)
        report.files_out += 1
    return report


def compact_files(lake: Path, files: list[Path]) -> Path:
    """Merge ``files`` (one table hour) into one ``c-<id>.parquet``; see the module docstring."""
    cid = uuid.uuid4().hex
    hour_dir = files[0].parent
    new = hour_dir / f"c-{cid}.parquet"
    tmp = hour_dir / f".{new.name}.tmp"
    merged = pa.concat_tables([pq.read_table(f) for f in files], promote_options="default")
    write_parquet_atomic(tmp, merged)  # lands at `tmp` itself: hidden until renamed
    record = {"new": new.relative_to(lake).as_posix(), "tmp": tmp.relative_to(lake).as_posix(),
              "old": [f.relative_to(lake).as_posix() for f in files]}  # fmt: skip
    rec_dir = lake / RECORD_DIR
    rec_dir.mkdir(parents=True, exist_ok=True)
    rec_tmp = rec_dir / f".{cid}.json.tmp"
    with open(rec_tmp, "w") as fh:
        json.dump(record, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(rec_tmp, rec_dir / f"{cid}.json")
    fsync_dir(rec_dir)
    os.replace(tmp, new)
    fsync_dir(hour_dir)
    for f in files:
        f.unlink(missing_ok=True)
    (rec_dir / f"{cid}.json").unlink()
    return new
