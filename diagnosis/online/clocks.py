"""Each partition's clock for the online service's engines.

Time is a partition's stream time, the newest record time seen there, so a partition
replayed after a failover is judged on its own clock and one instance or four decide
the same. It never leads the wall clock by more than ``time.max_clock_skew_s`` (one
record stamped 2100 must not move every job of its partition to 2100).

A partition that heard nothing for ``[diagnosis] idle_clock_after_s`` of wall time (a
job whose ranks all died: CPU nodes send no GPU samples to keep its time moving) ticks
on its newest record's time plus that quiet, so its settle times still end; but at most
``idle_clock_max_s`` past that record. Silence alone must not call a hang: when nothing
at all is heard, the agents or the bus may be what stopped (a simulated fleet that ended
was restarted as hung), and a hang needs its hosts seen alive.
"""

from __future__ import annotations

import time


class PartitionClocks:
    def __init__(self, *, max_skew_s: float, idle_after_s: float, idle_max_s: float):
        self.max_skew_s = max_skew_s
        self.idle_after_s = idle_after_s
        self.idle_max_s = idle_max_s
        self.times: dict[int, float] = {}  # partition -> stream time
        self._heard: dict[int, float] = {}  # partition -> monotonic time of its newest record

    def bounded(self, ts: float) -> float:
        """A time no later than the wall clock plus the allowed skew: a job's clock never runs ahead."""
        return min(ts, time.time() + self.max_skew_s)

    def heard(self, partition: int, ts: object) -> None:
        """A record of ``partition``; ``ts`` its event time (None: a record that has none of its own)."""
        if isinstance(ts, (int, float)) and ts > self.times.get(partition, 0.0):
            self.times[partition] = self.bounded(float(ts))
        self._heard[partition] = time.monotonic()

    def restore(self, partition: int, ts: float) -> None:
        self.times[partition] = self.bounded(ts)

    def forget(self, partition: int) -> None:
        self.times.pop(partition, None)
        self._heard.pop(partition, None)

    def now(self, partition: int, mono: float) -> float | None:
        """The time ``partition``'s engines tick on (None before its first record)."""
        ts = self.times.get(partition) or None
        if ts is None or self.idle_after_s <= 0:
            return ts
        quiet = mono - self._heard.setdefault(partition, mono)
        return self.bounded(ts + min(quiet, self.idle_max_s)) if quiet >= self.idle_after_s else ts
