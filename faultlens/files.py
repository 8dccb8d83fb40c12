"""Durable file replacement: readers see the old file whole or the new one whole, after a crash too.

The runner's ledger, the guard log and the lake rewrite files in place of old ones; each writes
a temporary file beside the target, syncs it, renames it over the target and syncs the folder
(the rename itself is only durable once the folder is).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_lines(path: Path, lines: Iterable[bytes]) -> None:
    """Replace ``path`` by ``lines`` (each without its newline) durably and at once."""
    tmp = path.with_name(path.name + ".compact")
    with tmp.open("wb") as f:
        f.write(b"".join(line + b"\n" for line in lines))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
