"""Incidents as an Alertmanager-compatible webhook (payload version 4).

Ops tooling already speaks Alertmanager's webhook: PagerDuty/Opsgenie bridges,
chat bots, ticket systems. Each incident becomes one alert:

* labels: ``alertname="FaultlensIncident"``, ``job``, ``node`` (the top
  suspect), ``severity``, ``category``, ``kind``, ``incident``;
* annotations: ``summary`` (the title), ``description`` (the summary and the
  first evidence lines), ``nodes`` (every suspect with its score);
* ``status``: ``resolved`` for a resolved incident, else ``firing``; ``endsAt``
  is the zero time while firing, as Alertmanager sends it;
* ``fingerprint``: a stable hash of the labels, so receivers de-duplicate the
  re-sends of an updated incident.

``AlertmanagerWebhook.send`` POSTs with urllib, a timeout, and a bounded number
of retries (connection errors, 5xx and 429 only). It returns a ``Delivery``
and never raises for a network problem: the diagnosis service counts failures
(``faultlens_webhook_failures_total``) and goes on. The bearer token is a
secret (``diagnosis.webhook_token``): never logged.

    hook = AlertmanagerWebhook.from_config(config.diagnosis)   # None when no URL is set
    if hook:
        hook.send([incident])
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson

from faultlens.config import DiagnosisConfig
from faultlens.errors import ConfigError
from faultlens.schema import Incident

log = logging.getLogger(__name__)

ALERTNAME = "FaultlensIncident"
ZERO_TIME = "0001-01-01T00:00:00Z"
MAX_EVIDENCE_LINES = 3


def _rfc3339(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat().replace("+00:00", "Z")


def _top_suspect(incident: Incident) -> dict[str, Any] | None:
    suspects = [s for s in incident.suspects if isinstance(s, dict) and s.get("node")]
    return max(suspects, key=lambda s: float(s.get("score") or 0.0)) if suspects else None


def incident_labels(incident: Incident) -> dict[str, str]:
    """The alert labels of an incident (empty values left out, as Alertmanager drops them)."""
    top = _top_suspect(incident)
    labels = {
        "alertname": ALERTNAME,
        "job": incident.job,
        "node": str(top["node"]) if top else "",
        "severity": incident.severity,
        "category": incident.category,
        "kind": incident.kind,
        "incident": incident.id,
    }
    return {k: v for k, v in labels.items() if v}


def fingerprint(labels: dict[str, str]) -> str:
    """A stable 16-hex-digit hash of a label set (same labels, same fingerprint)."""
    text = "\xff".join(f"{k}\xfe{labels[k]}" for k in sorted(labels))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def incident_alert(incident: Incident, *, external_url: str = "") -> dict[str, Any]:
    labels = incident_labels(incident)
    lines = [incident.summary] if incident.summary else []
    lines += [str(e.get("text", ""))[:300] for e in incident.evidence[:MAX_EVIDENCE_LINES] if isinstance(e, dict)]
    nodes = ", ".join(
        f"{s.get('node')} ({float(s.get('score') or 0.0):.2f})" for s in incident.suspects if isinstance(s, dict)
    )
    resolved = incident.status == "resolved"
    annotations = {"summary": incident.title, "description": "\n".join(x for x in lines if x)}
    if nodes:
        annotations["nodes"] = nodes
    return {
        "status": "resolved" if resolved else "firing",
        "labels": labels,
        "annotations": annotations,
        "startsAt": _rfc3339(incident.opened_ts),
        "endsAt": _rfc3339(incident.updated_ts) if resolved else ZERO_TIME,
        "generatorURL": f"{external_url.rstrip('/')}/?incident={incident.id}" if external_url else "",
        "fingerprint": fingerprint(labels),
    }


def _common(dicts: list[dict[str, str]]) -> dict[str, str]:
    if not dicts:
        return {}
    return {k: v for k, v in dicts[0].items() if all(d.get(k) == v for d in dicts[1:])}


def alertmanager_payload(
    incidents: Sequence[Incident], *, receiver: str = "faultlens", external_url: str = ""
) -> dict[str, Any]:
    """The webhook body (version 4) for some incidents, grouped by job as Alertmanager would."""
    alerts = [incident_alert(i, external_url=external_url) for i in incidents]
    jobs = sorted({i.job for i in incidents})
    group_labels = {"job": jobs[0]} if len(jobs) == 1 else {}
    group_key = "{}:{" + ",".join(f'{k}="{v}"' for k, v in sorted(group_labels.items())) + "}"
    return {
        "version": "4",
        "groupKey": group_key,
        "truncatedAlerts": 0,
        "status": "firing" if any(a["status"] == "firing" for a in alerts) else "resolved",
        "receiver": receiver,
        "groupLabels": group_labels,
        "commonLabels": _common([a["labels"] for a in alerts]),
        "commonAnnotations": _common([a["annotations"] for a in alerts]),
        "externalURL": external_url,
        "alerts": alerts,
    }


@dataclass(frozen=True, slots=True)
class Delivery:
    ok: bool
    attempts: int
    http_status: int | None = None
    error: str = ""


class AlertmanagerWebhook:
    """POSTs incident payloads to one URL with a timeout and bounded retries."""

    def __init__(
        self,
        url: str,
        *,
        token: str = "",
        timeout_s: float = 5.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        receiver: str = "faultlens",
        external_url: str = "",
        on_failure: Callable[[Delivery], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"webhook URL must be http(s)://host/...: {url!r}", key="diagnosis.webhook_url")
        if parts.username or parts.password:
            raise ConfigError("put webhook credentials in diagnosis.webhook_token, not in the URL",
                              key="diagnosis.webhook_url")
        if retries < 0 or timeout_s <= 0:
            raise ConfigError("webhook retries must be >= 0 and timeout_s > 0", key="diagnosis.webhook_retries")
        self.url = url
        # What logs may show: no query string (it may hold a key).
        self.safe_url = f"{parts.scheme}://{parts.netloc}{parts.path}"
        self._token = token
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.receiver = receiver
        self.external_url = external_url
        self.on_failure = on_failure
        self._sleep = sleep

    @classmethod
    def from_config(cls, cfg: DiagnosisConfig, **kwargs: Any) -> AlertmanagerWebhook | None:
        """The webhook of ``[diagnosis] webhook_url``; None when it is not set."""
        if not cfg.webhook_url:
            return None
        return cls(cfg.webhook_url, token=cfg.webhook_token, timeout_s=cfg.webhook_timeout_s,
                   retries=cfg.webhook_retries, **kwargs)

    def __repr__(self) -> str:  # the token stays out of reprs and logs
        return f"AlertmanagerWebhook(url={self.safe_url!r}, token={'***' if self._token else ''!r})"

    def send(self, incidents: Sequence[Incident]) -> Delivery:
        """POST one payload for ``incidents``; retries transient failures, never raises for them."""
        if not incidents:
            return Delivery(ok=True, attempts=0)
        body = orjson.dumps(alertmanager_payload(incidents, receiver=self.receiver, external_url=self.external_url))
        headers = {"Content-Type": "application/json", "User-Agent": "faultlens-webhook"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        delivery = Delivery(ok=False, attempts=0)
        for attempt in range(1, self.retries + 2):
            request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:  # noqa: S310 - scheme checked
                    return Delivery(ok=True, attempts=attempt, http_status=resp.status)
            except urllib.error.HTTPError as exc:
                delivery = Delivery(ok=False, attempts=attempt, http_status=exc.code, error=f"HTTP {exc.code} {exc.reason}")
                exc.close()
                if exc.code < 500 and exc.code != 429:
                    break  # the receiver rejects this payload; sending it again will not help
            except (urllib.error.URLError, TimeoutError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                delivery = Delivery(ok=False, attempts=attempt, error=f"{type(exc).__name__}: {reason}")
            if attempt <= self.retries:
                self._sleep(min(self.backoff_s * 2 ** (attempt - 1), 30.0))
        log.warning("incident webhook to %s failed after %d attempt(s): %s", self.safe_url, delivery.attempts, delivery.error)
        if self.on_failure is not None:
            self.on_failure(delivery)
        return delivery
