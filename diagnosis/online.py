"""The online diagnosis service: telemetry topics in, incidents/actions/commands out.

Consumes gpu, kernel, nccl, steps, stacks and jobs through stream.bus.Consumer,
feeds the same DiagnosisEngine as the batch path, ticks it once a second of
wall time, and produces its outputs with stream.bus.Producer (incidents and
actions as CloudEvents). A record that does not decode is counted and skipped.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from faultlens.config import Config
from faultlens.diagnosis.engine import Detector, DiagnosisEngine
from faultlens.diagnosis.nodehealth import NodeHealth
from faultlens.diagnosis.webhook import AlertmanagerWebhook
from faultlens.errors import SchemaError
from faultlens.stream import schema
from faultlens.stream.bus import Consumer, Producer, ensure_topics

log = logging.getLogger(__name__)
INPUT_KINDS = ("jobs", "gpu", "kernel", "nccl", "steps", "stacks")


class DiagnosisService:
    """Run with ``serve()`` (blocking) or ``start()`` / ``stop()`` (a thread, for tests and the demo)."""

    def __init__(self, config: Config, *, bootstrap: str | None = None, detectors: Sequence[Detector] = (),
                 node_health: NodeHealth | None = None, tick_interval_s: float = 1.0, poll_timeout_ms: int = 100,
                 from_beginning: bool = False, unknown_hold_s: float = 3.0, metrics: Any = None):
        self.config = config
        self.metrics = metrics  # faultlens.metrics.ServiceMetrics, or None
        self._webhook = AlertmanagerWebhook.from_config(config.diagnosis)
        # The webhook posts from a thread of its own: a slow receiver never delays an action.
        self._webhook_queue: queue.Queue[Any] = queue.Queue(maxsize=1000)
        self.bootstrap = bootstrap
        self.engine = DiagnosisEngine(config, detectors=detectors, node_health=node_health, batch=False)
        self.tick_interval_s = tick_interval_s
        self.poll_timeout_ms = poll_timeout_ms
        self.from_beginning = from_beginning
        self.unknown_hold_s = unknown_hold_s
        self._held: collections.deque[tuple[float, Any]] = collections.deque()
        self.decode_errors = 0
        self.produced = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._categories_seen: set[str] = set()
        self.ready = threading.Event()

    def _observe_output(self, out: Any) -> None:
        """Metrics (incidents open, actions by type) and the Alertmanager webhook."""
        kind = type(out).KIND
        if self.metrics is not None:
            self.metrics.messages_produced.labels(topic=kind).inc()
            if kind == "actions":
                self.metrics.actions.labels(type=out.type, status="emitted").inc()
            elif kind == "incidents":
                open_by_category: dict[str, int] = collections.Counter(
                    i.category for i in self.engine.book.open_incidents())
                for category in set(open_by_category) | self._categories_seen:
                    self.metrics.incidents_open.labels(category=category).set(open_by_category.get(category, 0))
                self._categories_seen |= set(open_by_category)
        if kind == "incidents" and self._webhook is not None:
            try:
                self._webhook_queue.put_nowait(out)
            except queue.Full:
                if self.metrics is not None:
                    self.metrics.webhook_failures.inc()

    def _webhook_loop(self) -> None:
        while not self._stop.is_set() or not self._webhook_queue.empty():
            try:
                incident = self._webhook_queue.get(timeout=0.5)
            except queue.Empty:
                continue
            delivery = self._webhook.send([incident])
            if not delivery.ok:
                log.warning("incident webhook failed after %d attempt(s): %s", delivery.attempts, delivery.error)
                if self.metrics is not None:
                    self.metrics.webhook_failures.inc()

    def _hold(self, record: Any) -> bool:
        """Hold a node's records briefly while its job is unknown (the topology may be a
        poll behind), so one fault does not open an incident under job "unknown" too.
        A node that never joins a job is diagnosed ``unknown_hold_s`` late."""
        node = getattr(record, "node", None)
        if self.unknown_hold_s <= 0 or node is None or record.KIND in ("jobs", "steps"):
            return False
        if self._held or self.engine.job_of_node(node) == "unknown":
            self._held.append((time.monotonic(), record))
            return True
        return False

    def _release(self) -> list[Any]:
        out: list[Any] = []
        now = time.monotonic()
        while self._held:
            since, record = self._held[0]
            if self.engine.job_of_node(record.node) == "unknown" and now - since < self.unknown_hold_s:
                break
            self._held.popleft()
            out.extend(self.engine.observe(record))
        return out

    def _read_topologies(self, reader: Consumer, timeout_ms: int = 0) -> list[Any]:
        """Job topologies are state, not events: they are read from the start of the jobs
        topic by a reader of their own, so a service that joins late or restarts still
        knows which node runs which job."""
        out: list[Any] = []
        for m in reader.poll(timeout_ms):
            try:
                out.extend(self.engine.observe(schema.decode("jobs", m.value)))
            except SchemaError as exc:
                self.decode_errors += 1
                log.warning("skipping undecodable job topology at offset %d: %s", m.offset, exc)
        return out

    def serve(self, *, max_seconds: float | None = None) -> None:
        ensure_topics(self.config.bus, self.bootstrap)
        jobs_reader = Consumer(self.config.bus, ["jobs"], group_id=None, bootstrap=self.bootstrap, from_beginning=True)
        consumer = Consumer(self.config.bus, [k for k in INPUT_KINDS if k != "jobs"],
                            group_id=self.config.diagnosis.group_id,
                            bootstrap=self.bootstrap, from_beginning=self.from_beginning,
                            fetch_max_wait_ms=self.poll_timeout_ms)  # a Xid must not wait out Kafka's 500 ms default
        producer = Producer(self.config.bus, self.bootstrap, linger_ms=0)
        if self._webhook is not None:
            threading.Thread(target=self._webhook_loop, name="faultlens-webhook", daemon=True).start()
        started = time.monotonic()
        last_tick = 0.0
        try:
            while not self._stop.is_set():
                outputs: list[Any] = self._read_topologies(jobs_reader)
                msgs = consumer.poll(timeout_ms=self.poll_timeout_ms)
                if not self.ready.is_set() and consumer.raw.assignment():
                    self.ready.set()
                for m in msgs:
                    try:
                        record = schema.decode(m.kind, m.value)
                    except SchemaError as exc:
                        self.decode_errors += 1
                        log.warning("skipping undecodable %s message at offset %d: %s", m.topic, m.offset, exc)
                        continue
                    if self._hold(record):
                        continue
                    outputs.extend(self.engine.observe(record))
                outputs.extend(self._release())
                now_wall = time.monotonic()
                if now_wall - last_tick >= self.tick_interval_s:
                    last_tick = now_wall
                    # Event time only (NVML samples keep it moving), so replayed data is judged on its own clock.
                    outputs.extend(self.engine.tick())
                for out in outputs:
                    producer.send(out)
                    self.produced += 1
                    self._observe_output(out)
                if self.metrics is not None and msgs:
                    for m in msgs:
                        self.metrics.messages_consumed.labels(topic=m.topic).inc()
                if outputs:
                    producer.flush(5.0)
                if msgs:
                    consumer.commit()
                if max_seconds is not None and time.monotonic() - started > max_seconds:
                    break
        finally:
            producer.close()
            consumer.close()
            jobs_reader.close()

    def start(self) -> DiagnosisService:
        self._thread = threading.Thread(target=self.serve, name="faultlens-diagnosis", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
