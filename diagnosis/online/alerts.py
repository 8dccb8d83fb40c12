"""What the online service tells people about its outputs: metrics and the Alertmanager webhook.

Each output sent counts in the service's metrics (messages by topic, actions by type, incidents open
by category); each incident also goes to the webhook (diagnosis.webhook), posted from a thread of its
own so that a slow receiver never delays an action.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from faultlens.config import DiagnosisConfig
from faultlens.diagnosis.webhook import AlertmanagerWebhook

log = logging.getLogger(__name__)


class OutputAlerts:
    """``observe(output)`` for every output sent; ``start(stop)`` runs the webhook's thread until ``stop``."""

    def __init__(self, config: DiagnosisConfig, metrics: Any, open_incidents: Callable[[], list[Any]]):
        self.webhook = AlertmanagerWebhook.from_config(config)  # a bad URL or token fails here, at start
        self.metrics = metrics  # faultlens.metrics.ServiceMetrics, or None
        self._open_incidents = open_incidents
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=1000)
        self._categories_seen: set[str] = set()

    def observe(self, out: Any) -> None:
        kind = type(out).KIND
        if self.metrics is not None:
            self.metrics.messages_produced.labels(topic=kind).inc()
            if kind == "actions":
                self.metrics.actions.labels(type=out.type, status="emitted").inc()
            elif kind == "incidents":
                open_by_category: dict[str, int] = collections.Counter(i.category for i in self._open_incidents())
                for category in set(open_by_category) | self._categories_seen:
                    self.metrics.incidents_open.labels(category=category).set(open_by_category.get(category, 0))
                self._categories_seen |= set(open_by_category)
        if kind == "incidents" and self.webhook is not None:
            try:
                self._queue.put_nowait(out)
            except queue.Full:
                if self.metrics is not None:
                    self.metrics.webhook_failures.inc()

    def start(self, stop: threading.Event) -> None:
        if self.webhook is not None:
            threading.Thread(target=self._loop, args=(stop,), name="faultlens-webhook", daemon=True).start()

    def _loop(self, stop: threading.Event) -> None:
        webhook = self.webhook
        assert webhook is not None
        while not stop.is_set() or not self._queue.empty():
            try:
                incident = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            delivery = webhook.send([incident])
            if not delivery.ok:
                log.warning("incident webhook failed after %d attempt(s): %s", delivery.attempts, delivery.error)
                if self.metrics is not None:
                    self.metrics.webhook_failures.inc()


class LagWatch:
    """The pipeline watches itself: how far event time is behind the wall clock (the partition most
    behind; faultlens_consumer_lag_seconds), warned once per crossing of ``bound_s`` ([diagnosis]
    max_evidence_age_s: past it evictions go out as notify "stale"; alert FaultlensDiagnosisBehind)."""

    def __init__(self, bound_s: float, metrics: Any, clock: Callable[[], float] = time.time):
        self.bound_s = bound_s
        self.metrics = metrics
        self.clock = clock
        self.lag_s = 0.0
        self.behind = False
        self.crossings = 0

    def observe(self, stream_times: list[float]) -> float:
        if not stream_times:
            return self.lag_s
        self.lag_s = max(0.0, self.clock() - min(stream_times))
        if self.metrics is not None:
            self.metrics.consumer_lag_s.set(self.lag_s)
        behind = bool(self.bound_s) and self.lag_s > self.bound_s
        if behind and not self.behind:
            self.crossings += 1
            log.warning("diagnosis is %.0f s behind the wall clock, past diagnosis.max_evidence_age_s %g s: "
                        "evictions go out as notify (stale) until it catches up", self.lag_s, self.bound_s)
        elif self.behind and not behind:
            log.warning("diagnosis caught up: %.0f s behind the wall clock", self.lag_s)
        self.behind = behind
        return self.lag_s
