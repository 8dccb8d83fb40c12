"""Changelog reads off the service's thread: a moved job's state comes back while the other jobs run.

When a rebalance gives an instance new repartition partitions, their jobs'
checkpoints are read from ``diag-changelog`` (diagnosis.state). That read
waits on the broker (seconds for a long changelog on a broker that does not
compact), and done on the service's thread it stopped every job the instance
already had. Here one worker thread reads with its own ``ChangelogReader``,
every partition asked for meanwhile in one pass (a join or a failover moves
several at once: read one after another, the last of eight waited 1.5 s on a
loaded machine); the service installs what came back at the top of a round
(``done()``). Until then the partition's records are not applied: the
service seeks them back (``DiagnosisService._refetch``) and commits nothing
there, so nothing is lost or applied twice.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from faultlens.diagnosis.online.state import ChangelogReader, Restored
from faultlens.errors import BusError
from faultlens.stream.bus.consume_loop import close_quietly

log = logging.getLogger(__name__)

# (partition, what was read or the error that stopped it, monotonic time the read was asked for)
Outcome = tuple[int, Restored | BusError, float]


class BackgroundRestorer:
    """``submit(p)`` queues a read; ``done()`` hands back what finished; ``cancel(p)``: a revoked partition."""

    def __init__(self, open_reader: Callable[[], ChangelogReader], *, eager: bool = False):
        """``eager``: open the reader now (on the worker thread), not at the first read: a client's
        start-up (~1 s on the embedded broker) is then not part of the first restore."""
        self._open_reader = open_reader
        self._reader: ChangelogReader | None = None
        self._todo: queue.Queue[tuple[int, float] | None] = queue.Queue()
        self._done: queue.Queue[Outcome] = queue.Queue()
        self._lock = threading.Lock()
        self._wanted: dict[int, float] = {}  # partition -> when asked; a cancelled one is dropped
        if eager:
            self._todo.put((-1, 0.0))  # open the reader first
        self._thread = threading.Thread(target=self._run, name="faultlens-restore", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> set[int]:
        with self._lock:
            return set(self._wanted)

    def submit(self, partition: int) -> None:
        with self._lock:
            if partition in self._wanted:
                return
            self._wanted[partition] = asked = time.monotonic()
        self._todo.put((partition, asked))

    def cancel(self, partition: int) -> None:
        with self._lock:
            self._wanted.pop(partition, None)

    def done(self) -> list[Outcome]:
        """Reads finished since the last call, for partitions still wanted (in the order they finished)."""
        out: list[Outcome] = []
        while True:
            try:
                p, result, asked = self._done.get_nowait()
            except queue.Empty:
                return out
            with self._lock:
                if self._wanted.get(p) != asked:
                    continue  # revoked (or asked again) while it was read
                del self._wanted[p]
            out.append((p, result, asked))

    def wait(self, timeout_s: float) -> bool:
        """Block until nothing is pending (tests, shutdown); True when so."""
        deadline = time.monotonic() + timeout_s
        while self._todo.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._todo.unfinished_tasks

    def _run(self) -> None:
        while True:
            items = [self._todo.get()]
            while True:  # everything asked meanwhile is read in the same pass (a join moves several)
                try:
                    items.append(self._todo.get_nowait())
                except queue.Empty:
                    break
            try:
                if None in items:
                    return
                self._read([i for i in items if i is not None])
            finally:
                for _ in items:
                    self._todo.task_done()

    def _read(self, items: list[tuple[int, float]]) -> None:
        if any(p < 0 for p, _ in items):  # eager: open the reader (or at the first read, if this fails)
            try:
                self._reader = self._reader or self._open_reader()
            except Exception as exc:  # noqa: BLE001 - the first read tries again and reports
                log.warning("changelog reader not opened ahead: %r", exc)
        with self._lock:
            wanted = {p: asked for p, asked in items if p >= 0 and self._wanted.get(p) == asked}
        if not wanted:
            return
        results: dict[int, Restored | BusError]
        try:
            if self._reader is None:
                self._reader = self._open_reader()
            results = dict(self._reader.read_many(sorted(wanted)))
        except BusError as exc:
            # A fresh client next time: this one may be stuck on the old cluster.
            close_quietly(self._reader)
            self._reader = None
            results = dict.fromkeys(wanted, exc)
        except Exception as exc:  # noqa: BLE001 - the service decides; the worker keeps going
            log.exception("restore of partitions %s failed", sorted(wanted))
            results = dict.fromkeys(wanted, BusError(f"restore of partitions {sorted(wanted)} failed: {exc!r}"))
        for p, result in results.items():
            self._done.put((p, result, wanted[p]))

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join(5.0)
        close_quietly(self._reader)
        self._reader = None
