"""/metrics is served from a per-service registry and parses as the Prometheus text format."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from faultlens import schema
from faultlens.metrics import MetricsServer, ServiceMetrics, observe_consumer_lag
from faultlens.stream.bus import Consumer, Producer, ensure_topics


def _scrape(url: str) -> tuple[str, dict[tuple[str, tuple], float]]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        ctype = resp.headers["Content-Type"]
        text = resp.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return ctype, samples


def test_metrics_are_served_and_parse() -> None:
    m = ServiceMetrics("stream")
    m.rows_written.labels(table="gpu").inc(800)
    m.dead_letters.labels(topic="faultlens.gpu", reason="malformed_json").inc(2)
    m.parse_failures.labels(source="kernel").inc()
    m.incidents_open.labels(category="pcie").set(1)
    m.actions.labels(type="evict_nodes", status="emitted").inc()
    m.consumer_lag.labels(topic="faultlens.gpu", partition="3").set(42)
    with MetricsServer(m.registry, port=0) as server:
        assert server.url.startswith("http://127.0.0.1:")
        ctype, samples = _scrape(server.url)
    assert ctype.startswith("text/plain")
    assert samples[("faultlens_lake_rows_written_total", (("table", "gpu"),))] == 800
    assert samples[("faultlens_dead_letters_total", (("reason", "malformed_json"), ("topic", "faultlens.gpu")))] == 2
    assert samples[("faultlens_parse_failures_total", (("source", "kernel"),))] == 1
    assert samples[("faultlens_incidents_open", (("category", "pcie"),))] == 1
    assert samples[("faultlens_actions_total", (("status", "emitted"), ("type", "evict_nodes")))] == 1
    assert samples[("faultlens_consumer_lag_messages", (("partition", "3"), ("topic", "faultlens.gpu")))] == 42
    assert any(name == "faultlens_service_info" and dict(labels)["service"] == "stream" for name, labels in samples)


def test_only_metrics_is_served_and_stop_frees_the_port() -> None:
    server = MetricsServer(ServiceMetrics("agent").registry, port=0)
    port = server.start()
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5)
    assert info.value.code == 404
    info.value.close()
    server.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_two_services_in_one_process_keep_their_own_registries() -> None:
    a, b = ServiceMetrics("agent"), ServiceMetrics("diagnosis")
    a.messages_produced.labels(topic="faultlens.gpu").inc(5)
    assert b"faultlens_messages_produced_total{topic=\"faultlens.gpu\"} 5.0" in a.exposition()
    assert b"faultlens.gpu" not in b.exposition()


@pytest.mark.broker
def test_consumer_lag_is_measured_against_the_real_broker(bus) -> None:
    ensure_topics(bus, names=("kernel",))
    with Producer(bus) as producer:
        # One record batch per message: Tansu's ListOffsets answers the last batch's base
        # offset + 1, so several records in one batch would look like a smaller lag there.
        for i in range(7):
            producer.send(schema.KernelEvent(ts=float(i), node="n001", kind="other", raw=f"line {i}"))
            producer.flush()
    m = ServiceMetrics("stream")
    consumer = Consumer(bus, ["kernel"], group_id=None)
    try:
        deadline = time.monotonic() + 20
        total = observe_consumer_lag(m, consumer.raw)
        while total != 7 and time.monotonic() < deadline:
            time.sleep(0.2)
            total = observe_consumer_lag(m, consumer.raw)
        assert total == 7
        got = []
        while len(got) < 7 and time.monotonic() < deadline:
            got += consumer.poll(500)
        assert observe_consumer_lag(m, consumer.raw) == 0
    finally:
        consumer.close()


def test_the_pipeline_watches_its_own_lag() -> None:
    """Issue 37.3: diagnosis's event time behind the wall clock is a gauge, warned once per crossing."""
    from faultlens.diagnosis.online.alerts import LagWatch

    m = ServiceMetrics("diagnosis")
    now = [1_800_000_000.0]
    watch = LagWatch(60.0, m, clock=lambda: now[0])
    assert watch.observe([now[0] - 5.0, now[0] - 12.0]) == 12.0 and not watch.behind  # the partition most behind
    assert m.consumer_lag_s._value.get() == 12.0
    for lag in (90.0, 120.0, 30.0, 75.0):
        watch.observe([now[0] - lag])
    assert watch.crossings == 2 and watch.behind and m.consumer_lag_s._value.get() == 75.0
    assert watch.observe([]) == 75.0  # no partition with data: the last figure stands
    off = LagWatch(0.0, None, clock=lambda: now[0])
    assert off.observe([now[0] - 999.0]) == 999.0 and not off.behind  # bound 0: measured, never behind
