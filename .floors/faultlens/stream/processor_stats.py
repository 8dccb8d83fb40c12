"""The stream processor's counters (stream/processor.py), mirrored to Prometheus.

Split from the processor so that its module holds the ingest mechanics only.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from faultlens import schema
from faultlens.metrics import ServiceMetrics


class ProcessorStats:
    """Counters of one processor; mirrored to Prometheus when a registry is given.

    No process-wide registry: pass ``prometheus_client.CollectorRegistry()``.
    """

    def __init__(self, registry: Any = None):
        self.messages: Counter[str] = Counter()  # kind -> messages consumed
        self.rows: Counter[str] = Counter()  # lake table -> rows committed
        self.dead_letters: Counter[str] = Counter()  # reason -> messages
        self.quarantined: Counter[tuple[str, str, str]] = Counter()  # (kind, field, reason) -> fields nulled
        self.unknown_fields: Counter[tuple[str, str]] = Counter()  # (kind, key) -> messages with it
        self.lag: dict[tuple[str, int], int] = {}
        self.commits = 0
        self.orphans_deleted = 0
        self.duplicates_dropped: Counter[str] = Counter()  # kind -> agent records the lake had already (stream/dedupe.py)
        self.started = time.monotonic()
        self.assigned_at: float | None = None  # monotonic time of the first partition assignment
        self.first_message_at: float | None = None  # monotonic time the first message was polled
        self.last_commit_at: float | None = None
        self.poll_thread_cpu_s = 0.0  # CPU time of the thread that polls (kafka-python parsing)
        # Prometheus: the shared families of faultlens.metrics.ServiceMetrics (the names the
        # shipped alert rules use), registered on the given registry.
        self._prom = None
        if registry is not None:

            self._prom = registry if isinstance(registry, ServiceMetrics) else ServiceMetrics("stream", registry)

    def consumed(self, kind: str, n: int) -> None:
        self.messages[kind] += n
        if self._prom:
            self._prom.messages_consumed.labels(topic=kind).inc(n)

    def committed(self, rows: dict[str, int], dead: Counter[str]) -> None:
        self.commits += 1
        self.last_commit_at = time.monotonic()
        self.rows.update(rows)
        self.dead_letters.update(dead)
        if self._prom:
            for t, n in rows.items():
                self._prom.rows_written.labels(table=t).inc(n)
            for r, n in dead.items():
                self._prom.dead_letters.labels(topic="*", reason=r).inc(n)

    def decoded(self, kind: str, quarantine: list[schema.Quarantine], unknown: dict[str, int]) -> None:
        """Fields the decoder nulled (by kind, field, reason) and unknown keys it ignored, as committed."""
        for q in quarantine:
            self.quarantined[(kind, q.field, q.reason)] += 1
        for key, n in unknown.items():
            self.unknown_fields[(kind, key)] += n
        if self._prom:
            for q in quarantine:
                self._prom.fields_quarantined.labels(topic=kind, field=q.field, reason=q.reason).inc()
            for key, n in unknown.items():
                self._prom.unknown_fields.labels(topic=kind, field=key).inc(n)

    def set_lag(self, lag: dict[tuple[str, int], int]) -> None:
        self.lag = lag
        if self._prom:
            for (t, p), n in lag.items():
                self._prom.consumer_lag.labels(topic=t, partition=str(p)).set(n)

    @property
    def total_lag(self) -> int:
        return sum(self.lag.values())

    def snapshot(self) -> dict[str, Any]:
        return {
            "messages": dict(self.messages),
            "rows": dict(self.rows),
            "dead_letters": dict(self.dead_letters),
            "quarantined": sum(self.quarantined.values()),
            "lag": self.total_lag,
            "commits": self.commits,
            "orphans_deleted": self.orphans_deleted,
            "duplicates_dropped": sum(self.duplicates_dropped.values()),
            "uptime_s": round(time.monotonic() - self.started, 1),
        }


