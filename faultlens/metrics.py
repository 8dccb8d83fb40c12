"""Prometheus metrics for the faultlens services, one registry per service.

Nothing is registered at import time and the prometheus_client global
``REGISTRY`` is never used: each service builds its own ``ServiceMetrics``
(which owns a ``CollectorRegistry``), updates the families it needs, and serves
them with ``MetricsServer``. Two services in one process (the demo, the tests)
therefore never collide.

Usage::

    from faultlens.metrics import MetricsServer, ServiceMetrics, observe_consumer_lag

    metrics = ServiceMetrics("stream")                  # its own CollectorRegistry
    server = MetricsServer(metrics.registry, port=9400)  # 127.0.0.1 unless host= is given
    server.start()                                       # port=0: a free port, see server.port
    metrics.messages_consumed.labels(topic="faultlens.gpu").inc(n)
    metrics.rows_written.labels(table="gpu").inc(rows)
    metrics.dead_letters.labels(topic="faultlens.gpu", reason="malformed_json").inc()
    observe_consumer_lag(metrics, consumer.raw)          # a kafka-python KafkaConsumer
    ...
    server.stop()                                        # or: with MetricsServer(...) as server:

Families (every name starts with ``faultlens_``; label names in braces):

| attribute          | metric                                   | type    | who sets it |
|--------------------|------------------------------------------|---------|-------------|
| info               | faultlens_service_info{service,version}  | gauge=1 | ServiceMetrics itself |
| messages_produced  | faultlens_messages_produced_total{topic} | counter | agent, diagnosis, runner |
| messages_consumed  | faultlens_messages_consumed_total{topic} | counter | stream, diagnosis, runner |
| consumer_lag       | faultlens_consumer_lag_messages{topic,partition} | gauge | consumers, via observe_consumer_lag |
| consumer_lag_s     | faultlens_consumer_lag_seconds                   | gauge | diagnosis: wall clock - event time  |
| rows_written       | faultlens_lake_rows_written_total{table} | counter | stream processor |
| dead_letters       | faultlens_dead_letters_total{topic,reason} | counter | whoever dead-letters |
| parse_failures     | faultlens_parse_failures_total{source}   | counter | agent parsers (kernel, nccl, steps, stacks) |
| fields_quarantined | faultlens_fields_quarantined_total{topic,field,reason} | counter | stream processor: fields the decoder nulled |
| unknown_fields     | faultlens_unknown_fields_total{topic,field} | counter | stream processor: unknown keys the decoder ignored |
| source_up          | faultlens_source_up{source}              | gauge   | agent: 1 delivering, 0 failing or no data |
| last_event_ts      | faultlens_last_event_timestamp_seconds{source} | gauge | agent: unix time of the last record read |
| incidents_open     | faultlens_incidents_open{category}       | gauge   | diagnosis |
| actions            | faultlens_actions_total{type,status}     | counter | diagnosis (status="emitted"), runner (done, failed, dry_run, refused, duplicate) |
| webhook_failures   | faultlens_webhook_failures_total         | counter | diagnosis (Alertmanager webhook) |
| actions_suppressed | faultlens_actions_suppressed_total{reason} | counter | diagnosis: actions the guard suppressed or downgraded (duplicate, confidence, job_cap, fleet_cap, breaker, storm, guard_unavailable) |
| guard_breakers_open | faultlens_guard_breakers_open{scope}    | gauge   | diagnosis: open breakers, scope fleet (0/1) or job (how many jobs) |
| checkpoints_unreadable | faultlens_checkpoints_unreadable_total{what} | counter | diagnosis: checkpoints/markers that did not read (job started afresh) |

deploy/prometheus/faultlens-alerts.yml holds alert rules over these names:
renaming one is a contract change.
"""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from faultlens import __version__

log = logging.getLogger(__name__)

__all__ = ["MetricsServer", "ServiceMetrics", "observe_consumer_lag"]


class ServiceMetrics:
    """The metric families the faultlens services share, in a registry of their own."""

    def __init__(self, service: str, registry: CollectorRegistry | None = None):
        self.service = service
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.info = Gauge("faultlens_service_info", "The faultlens service in this process (always 1).",
                          ["service", "version"], registry=r)
        self.info.labels(service=service, version=__version__).set(1)
        self.messages_produced = Counter("faultlens_messages_produced", "Messages sent to the bus.",
                                         ["topic"], registry=r)
        self.messages_consumed = Counter("faultlens_messages_consumed", "Messages read from the bus.",
                                         ["topic"], registry=r)
        self.consumer_lag = Gauge("faultlens_consumer_lag_messages",
                                  "Messages between this consumer's position and the end of the partition.",
                                  ["topic", "partition"], registry=r)
        self.consumer_lag_s = Gauge("faultlens_consumer_lag_seconds",
                                    "Diagnosis: how far its event time is behind the wall clock (the partition "
                                    "most behind); past [diagnosis] max_evidence_age_s no eviction is taken.",
                                    registry=r)
        self.rows_written = Counter("faultlens_lake_rows_written", "Rows written to the Parquet lake.",
                                    ["table"], registry=r)
        self.dead_letters = Counter("faultlens_dead_letters", "Messages dead-lettered, by reason.",
                                    ["topic", "reason"], registry=r)
        self.fields_quarantined = Counter("faultlens_fields_quarantined",
                                          "Record fields the decoder could not read and nulled (lake table quarantine).",
                                          ["topic", "field", "reason"], registry=r)
        self.unknown_fields = Counter("faultlens_unknown_fields", "Unknown record keys the decoder ignored.",
                                      ["topic", "field"], registry=r)
        self.parse_failures = Counter("faultlens_parse_failures", "Raw lines or records that did not parse.",
                                      ["source"], registry=r)
        self.source_up = Gauge("faultlens_source_up", "1 when the collector source delivered in its last round.",
                               ["source"], registry=r)
        self.last_event_ts = Gauge("faultlens_last_event_timestamp_seconds",
                                   "Unix time of the last record a source read.", ["source"], registry=r)
        self.incidents_open = Gauge("faultlens_incidents_open", "Incidents currently open.",
                                    ["category"], registry=r)
        self.actions = Counter("faultlens_actions", "Remediation actions, by type and outcome.",
                               ["type", "status"], registry=r)
        self.checkpoints_unreadable = Counter(
            "faultlens_checkpoints_unreadable",
            "Diagnosis checkpoints or markers a restore could not read (that job started afresh), by what.",
            ["what"], registry=r)
        self.webhook_failures = Counter("faultlens_webhook_failures",
                                        "Incident webhook deliveries that failed after all retries.", registry=r)
        self.actions_suppressed = Counter("faultlens_actions_suppressed",
                                          "Actions the guard suppressed or downgraded to notify, by reason.",
                                          ["reason"], registry=r)
        self.guard_breakers_open = Gauge("faultlens_guard_breakers_open",
                                         "Open guard breakers: fleet (0 or 1), job (jobs whose breaker is open).",
                                         ["scope"], registry=r)

    def exposition(self) -> bytes:
        """The current metrics in the Prometheus text format (what /metrics serves)."""
        return generate_latest(self.registry)


def observe_consumer_lag(metrics: ServiceMetrics, consumer: Any, timeout_ms: int = 2000) -> int:
    """Set consumer_lag for each assigned partition of a kafka-python consumer; returns the total.

    Errors talking to the broker are logged and leave the gauges as they were:
    a metrics update never stops a service. Note: the embedded broker (Tansu)
    answers end offsets per record batch, so there the lag undercounts; a real
    Kafka cluster gives the true figure.
    """
    try:
        parts = list(consumer.assignment())
        if not parts:
            return 0
        ends = consumer.end_offsets(parts, timeout_ms=timeout_ms)
        total = 0
        for tp in parts:
            lag = max(0, int(ends.get(tp, 0)) - int(consumer.position(tp, timeout_ms=timeout_ms) or 0))
            metrics.consumer_lag.labels(topic=tp.topic, partition=str(tp.partition)).set(lag)
            total += lag
        return total
    except Exception as exc:  # noqa: BLE001 - kafka raises many kinds; metrics must not kill the service
        log.debug("consumer lag not updated: %s", exc)
        return -1


class MetricsServer:
    """Serves ``GET /metrics`` of one registry from a background thread.

    Binds 127.0.0.1 by default: exposing metrics beyond the host is an explicit
    choice (``host="0.0.0.0"``, e.g. in the DaemonSet). ``port=0`` picks a free
    port; ``server.port`` says which.
    """

    def __init__(self, registry: CollectorRegistry, port: int, host: str = "127.0.0.1"):
        self.registry = registry
        self.host = host
        self.requested_port = port
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("the metrics server is not started")
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def start(self) -> int:
        """Start serving; returns the bound port."""
        registry = self.registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404, "only /metrics is served here")
                    return
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - scrapes are not news
                log.debug("metrics: " + format, *args)

        self._httpd = ThreadingHTTPServer((self.host, self.requested_port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="faultlens-metrics", daemon=True)
        self._thread.start()
        log.info("metrics on %s", self.url)
        return self.port

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> MetricsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
