"""How a stream processor runs inside its Python process: the record-batch CRC check and the
garbage collector's first generation, both of which cost ingest more than its own work.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator


def have_c_crc32c() -> bool:
    try:
        import crc32c  # noqa: F401 - kafka-python uses it when present
    except ImportError:
        return False
    return True


# kafka-python checks record-batch CRC32C in pure Python unless the `crc32c`
# package is installed: ~1 ms per 4 KB message, 20x the rest of the work. Without
# it we leave the check to TCP and the broker (documented in stream/README.md).
CHECK_CRCS = have_c_crc32c()

# CPython's first garbage-collector generation is collected every 700 tracked allocations
# by default; a poll of 10,000 records (a headers list and tuple each, at least) survives
# several of those, and every ten of them may end in a full collection of the whole heap
# (~80 ms under load, twice in a 30,000-message backlog: benchmarks/ingest.py). While a
# processor runs, the first generation waits for this many allocations instead (the
# thresholds of the process are restored when the last running processor returns).
GC_GEN0_THRESHOLD = 50_000
_gc_lock = threading.Lock()
_gc_users: list[tuple[int, ...]] = []  # the thresholds before the first running processor changed them


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """Raise the gen-0 threshold for the duration (nested and concurrent runs share one change)."""
    with _gc_lock:
        before = gc.get_threshold()
        _gc_users.append(before)
        if len(_gc_users) == 1 and before[0] < GC_GEN0_THRESHOLD:
            gc.set_threshold(GC_GEN0_THRESHOLD, *before[1:])
    try:
        yield
    finally:
        with _gc_lock:
            first = _gc_users[0]
            _gc_users.pop()
            if not _gc_users:
                gc.set_threshold(*first)
