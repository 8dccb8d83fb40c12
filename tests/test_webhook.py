"""Alertmanager v4 webhook for incidents, POSTed to a local HTTP server."""

from __future__ import annotations

import http.server
import json
import logging
import threading
from collections.abc import Iterator

import pytest

from faultlens import schema
from faultlens.config import load_config
from faultlens.diagnosis.webhook import (
    ZERO_TIME,
    AlertmanagerWebhook,
    alertmanager_payload,
    fingerprint,
)
from faultlens.errors import ConfigError
from faultlens.stream.bus.embedded_broker import free_port


class Receiver:
    """A real HTTP server on 127.0.0.1 that records requests and answers with scripted codes."""

    def __init__(self, codes: list[int] | None = None):
        self.requests: list[dict] = []
        self.codes = list(codes or [])
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.requests.append({"path": self.path, "headers": dict(self.headers), "body": json.loads(body)})
                code = receiver.codes.pop(0) if receiver.codes else 200
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/alerts"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver() as r:
        yield r


def _incident(status: str = "open", **kw) -> schema.Incident:
    base = dict(id="inc-9", job="j1", opened_ts=1_700_000_000.0, updated_ts=1_700_000_600.0, status=status,
                category="gpu_memory", kind="ecc_uncorrectable", title="Uncorrectable ECC error on n012 GPU 5",
                severity="critical", confidence=0.99, summary="Xid 48 and the DBE counter rose by 2.",
                suspects=[{"node": "n011", "score": 0.2, "reason": "same job"},
                          {"node": "n012", "gpu": 5, "score": 0.99, "reason": "Xid 48"}],
                evidence=[{"ts": 1_700_000_000.0, "source": "kernel", "text": "NVRM: Xid (PCI:0000:b1:00): 48, pid=77"}])
    base.update(kw)
    return schema.Incident(**base)


def test_the_payload_reaches_the_receiver_in_alertmanager_v4_shape(receiver) -> None:
    hook = AlertmanagerWebhook(receiver.url, token="s3cret-token", external_url="http://explorer:8501")
    delivery = hook.send([_incident()])
    assert delivery.ok and delivery.attempts == 1 and delivery.http_status == 200
    (req,) = receiver.requests
    assert req["path"] == "/alerts" and req["headers"]["Authorization"] == "Bearer s3cret-token"
    assert req["headers"]["Content-Type"] == "application/json"
    body = req["body"]
    assert body["version"] == "4" and body["status"] == "firing" and body["receiver"] == "faultlens"
    assert body["groupLabels"] == {"job": "j1"} and body["groupKey"] == '{}:{job="j1"}'
    (alert,) = body["alerts"]
    assert alert["status"] == "firing"
    assert alert["labels"] == {"alertname": "FaultlensIncident", "job": "j1", "node": "n012", "severity": "critical",
                               "category": "gpu_memory", "kind": "ecc_uncorrectable", "incident": "inc-9"}
    assert alert["annotations"]["summary"] == "Uncorrectable ECC error on n012 GPU 5"
    assert "Xid 48 and the DBE counter" in alert["annotations"]["description"]
    assert "NVRM: Xid (PCI:0000:b1:00): 48" in alert["annotations"]["description"]
    assert alert["startsAt"] == "2023-11-14T22:13:20Z" and alert["endsAt"] == ZERO_TIME
    assert alert["generatorURL"] == "http://explorer:8501/?incident=inc-9"
    assert alert["fingerprint"] == fingerprint(alert["labels"]) and len(alert["fingerprint"]) == 16
    assert body["commonLabels"] == alert["labels"]


def test_resolved_incidents_resolve_and_keep_their_fingerprint(receiver) -> None:
    hook = AlertmanagerWebhook(receiver.url)
    hook.send([_incident()])
    hook.send([_incident("resolved", updated_ts=1_700_003_600.0)])
    firing, resolved = (r["body"] for r in receiver.requests)
    assert resolved["status"] == "resolved" and resolved["alerts"][0]["endsAt"] == "2023-11-14T23:13:20Z"
    assert firing["alerts"][0]["fingerprint"] == resolved["alerts"][0]["fingerprint"]
    assert "Authorization" not in receiver.requests[0]["headers"]


def test_fingerprints_differ_between_incidents_and_groups_are_mixed() -> None:
    body = alertmanager_payload([_incident(), _incident(id="inc-10", job="j2", status="resolved")])
    a, b = body["alerts"]
    assert a["fingerprint"] != b["fingerprint"]
    assert body["status"] == "firing" and body["groupLabels"] == {}
    assert body["commonLabels"] == {"alertname": "FaultlensIncident", "node": "n012", "severity": "critical",
                                    "category": "gpu_memory", "kind": "ecc_uncorrectable"}


def test_transient_failures_are_retried_a_bounded_number_of_times() -> None:
    sleeps = []
    with Receiver(codes=[503, 429, 200]) as r:
        d = AlertmanagerWebhook(r.url, retries=3, backoff_s=0.5, sleep=sleeps.append).send([_incident()])
    assert d.ok and d.attempts == 3 and len(r.requests) == 3 and sleeps == [0.5, 1.0]
    with Receiver(codes=[503] * 10) as r:
        failures = []
        d = AlertmanagerWebhook(r.url, retries=2, sleep=lambda s: None, on_failure=failures.append).send([_incident()])
    assert not d.ok and d.attempts == 3 and len(r.requests) == 3 and d.http_status == 503 and failures == [d]


def test_a_rejected_payload_is_not_retried() -> None:
    with Receiver(codes=[400, 200]) as r:
        d = AlertmanagerWebhook(r.url, retries=3, sleep=lambda s: None).send([_incident()])
    assert not d.ok and d.attempts == 1 and d.http_status == 400 and len(r.requests) == 1


def test_an_unreachable_receiver_never_raises_and_the_token_stays_out_of_logs(caplog) -> None:
    url = f"http://127.0.0.1:{free_port()}/alerts?key=abc"
    hook = AlertmanagerWebhook(url, token="s3cret-token", retries=1, timeout_s=2, sleep=lambda s: None)
    with caplog.at_level(logging.DEBUG):
        d = hook.send([_incident()])
    assert not d.ok and d.attempts == 2 and "refused" in d.error.lower()
    for secret in ("s3cret-token", "key=abc"):
        assert secret not in caplog.text and secret not in repr(hook)


def test_bad_webhook_settings_fail_at_start() -> None:
    with pytest.raises(ConfigError, match="diagnosis.webhook_url"):
        AlertmanagerWebhook("file:///etc/passwd")
    with pytest.raises(ConfigError, match="webhook_token"):
        AlertmanagerWebhook("https://user:pw@am.example/hook")
    cfg = load_config(None, env={})
    assert AlertmanagerWebhook.from_config(cfg.diagnosis) is None


def test_describe_masks_every_secret(tmp_path) -> None:
    f = tmp_path / "faultlens.toml"
    f.write_text('[bus]\nsecurity_protocol = "SASL_SSL"\nsasl_mechanism = "SCRAM-SHA-512"\nsasl_username = "fl"\n'
                 'ssl_password = "keypass"\n[diagnosis]\nwebhook_url = "https://am.example/hook"\n'
                 'webhook_token = "tok-123"\n')
    cfg = load_config(f, env={"FAULTLENS_BUS_SASL_PASSWORD": "hunter2"})
    assert cfg.bus.sasl_password == "hunter2" and cfg.diagnosis.webhook_token == "tok-123"
    text = str(cfg.describe())
    for secret in ("hunter2", "keypass", "tok-123"):
        assert secret not in text
    assert cfg.describe()["bus"]["sasl_username"] == "fl" and cfg.describe()["bus"]["sasl_password"] == "***"
