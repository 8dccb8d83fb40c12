"""Burst grouping: the many lines one fault produces become one burst.

A failing GPU prints an Xid 79, a "fallen off the bus" record and NVML says the
device is lost; an ECC fault prints a run of Xid 94 lines, one per channel. All
of these resolve to one incident kind on one node, so a burst is keyed by
(job, node, kind) and stays open while signals keep coming; a silence longer
than ``diagnosis.burst_gap_s`` closes it, and the next signal starts a new one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Burst:
    key: tuple[str, str | None, str]  # (job, node, kind)
    first_ts: float
    last_ts: float
    count: int = 0
    sources: dict[str, int] = field(default_factory=dict)  # rule -> lines
    alerts: list[float] = field(default_factory=list)  # ts of distinct alert-role signals
    payload: Any = None  # the incident this burst feeds (set by the incident book)


class BurstGrouper:
    """Groups signals per (job, node, kind) until ``gap_s`` of silence."""

    def __init__(self, gap_s: float = 180.0, *, alert_dedup_s: float = 1.0):
        self.gap_s = gap_s
        self.alert_dedup_s = alert_dedup_s  # continuation lines of one alert arrive together
        self._open: dict[tuple[str, str | None, str], Burst] = {}

    def add(self, job: str, node: str | None, kind: str, ts: float, rule: str,
            *, alert: bool = False) -> tuple[Burst, bool]:
        """Add one signal; returns (its burst, whether the burst is new)."""
        key = (job, node, kind)
        burst = self._open.get(key)
        new = burst is None or ts - burst.last_ts > self.gap_s
        if new:
            burst = Burst(key, ts, ts)
            self._open[key] = burst
        assert burst is not None
        burst.last_ts = max(burst.last_ts, ts)
        burst.count += 1
        burst.sources[rule] = burst.sources.get(rule, 0) + 1
        if alert and (not burst.alerts or ts - burst.alerts[-1] > self.alert_dedup_s):
            burst.alerts.append(ts)
        return burst, new

    def get(self, job: str, node: str | None, kind: str) -> Burst | None:
        return self._open.get((job, node, kind))

    def close_idle(self, now: float) -> list[Burst]:
        """Close and return bursts silent for more than ``gap_s``."""
        closed = [b for b in self._open.values() if now - b.last_ts > self.gap_s]
        for b in closed:
            del self._open[b.key]
        return closed
