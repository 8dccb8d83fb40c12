"""Job-wide events stay job-wide: one host-level signal on most of a job's nodes is one shared cause.

A hung task (a process blocked in I/O), a filesystem error or a link going down on
one node is that node's problem; the same on most nodes of a job within minutes is
the shared storage, the network fabric or the scheduler, and no machine is at fault.
Each ``[[jobwide]]`` rule of catalogs/policy.toml names the incident kinds it watches
(``source_kinds``), the kind of the shared-cause incident it opens (``kind``), how
many of the job's nodes make it job-wide (``min_fraction`` of them and at least
``min_nodes``) within ``window_s``, and how long a node's own incident of a watched
kind waits (``hold_s``) before it is decided alone, so that the others can arrive.
The blast-radius guard stays as the second line behind it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from faultlens.diagnosis.incidents import MAX_EVIDENCE, IncidentBook, OpenIncident, Signal
from faultlens.errors import CatalogError


@dataclass(frozen=True)
class JobWideRule:
    name: str
    source_kinds: tuple[str, ...]
    kind: str
    cause: str
    min_fraction: float = 0.5
    min_nodes: int = 2
    window_s: float = 300.0
    hold_s: float = 120.0
    sources: tuple[str, ...] = ()  # signal sources that count towards the share (empty: any)

    def needed(self, job_nodes: int) -> int:
        return max(self.min_nodes, math.ceil(self.min_fraction * job_nodes))


def load_jobwide(entries: list[dict[str, Any]], path: Path | str) -> list[JobWideRule]:
    """The ``[[jobwide]]`` entries of policy.toml; a bad one fails naming file and entry."""
    rules = []
    for i, e in enumerate(entries):
        name = str(e.get("name", f"jobwide#{i}"))
        try:
            rule = JobWideRule(**{**e, "source_kinds": tuple(e.get("source_kinds", ())),
                                  "sources": tuple(e.get("sources", ()))})
        except TypeError as exc:
            raise CatalogError(str(exc), file=str(path), entry=name) from None
        if not rule.source_kinds or not 0 < rule.min_fraction <= 1 or rule.min_nodes < 2:
            raise CatalogError("a jobwide rule needs source_kinds, 0 < min_fraction <= 1 and min_nodes >= 2",
                               file=str(path), entry=name)
        rules.append(rule)
    return rules


@dataclass
class JobWideCorrelator:
    """Which nodes of a job reported a watched kind recently; says when that becomes job-wide."""

    rules: list[JobWideRule]
    seen: dict[tuple[str, str], deque[tuple[float, str]]] = field(default_factory=dict)  # (job, rule) -> (ts, node)
    open_incident: dict[tuple[str, str], str] = field(default_factory=dict)  # (job, rule) -> job-wide incident id

    def rule_for(self, kind: str, source: str | None = None) -> JobWideRule | None:
        """The rule watching ``kind`` (and, given, a signal from ``source``), or None."""
        return next((r for r in self.rules if kind in r.source_kinds
                     and (source is None or not r.sources or source in r.sources)), None)

    def note(self, job: str, rule: JobWideRule, ts: float, node: str, job_nodes: set[str]) -> list[str] | None:
        """Record one node's signal; the nodes that make it job-wide when the rule's share is reached."""
        q = self.seen.setdefault((job, rule.name), deque())
        q.append((ts, node))
        while q and ts - q[0][0] > rule.window_s:
            q.popleft()
        nodes = sorted({n for _, n in q if n in job_nodes})
        if len(job_nodes) >= rule.min_nodes and len(nodes) >= rule.needed(len(job_nodes)):
            return nodes
        return None

    def file(self, book: IncidentBook, signal: Signal, rule: JobWideRule,
             job_nodes: list[str]) -> tuple[OpenIncident | None, bool]:
        """A watched host-level signal: into the job's open shared-cause incident, or opening it once most
        of the job's nodes reported (the nodes' own incidents fold into it). Returns (the shared
        incident or None when the signal stays a node's own, whether it was opened now)."""
        if len(job_nodes) < rule.min_nodes or signal.node is None:
            return None, False
        key = (signal.job, rule.name)
        open_id = self.open_incident.get(key)
        shared = book.incidents.get(open_id) if open_id else None
        if shared is None or shared.status != "open":
            nodes = self.note(signal.job, rule, signal.ts, signal.node, set(job_nodes))
            if nodes is None:
                return None, False
        else:
            nodes = sorted(set(shared.state.affected_nodes) | {signal.node})
        redirected = Signal(ts=signal.ts, job=signal.job, kind=rule.kind, role="job",
                            confidence=max(0.7, signal.confidence), rule=f"jobwide:{rule.name}", source=signal.source,
                            text=signal.text, node=signal.node, rank=signal.rank, category=signal.category,
                            severity=signal.severity, figures={**signal.figures, "host_signal": signal.kind})
        inc = book.add(redirected)
        if inc is None:
            return None, False
        inc.state.affected_nodes = sorted(set(inc.state.affected_nodes) | set(nodes))
        inc.summary = (f"{rule.cause}: {rule.name} on {len(inc.state.affected_nodes)}/{len(job_nodes)} nodes within "
                       f"{rule.window_s:.0f} s; no machine is at fault")
        if shared is inc:
            return inc, False
        self.open_incident[key] = inc.id
        for other in book.open_incidents(signal.job):  # the nodes' own incidents fold into the shared one
            if other is inc or other.kind not in rule.source_kinds or other.node is None or other.actions:
                continue
            other.status, other.state.folded_into, other.dirty = "resolved", inc.id, True
            other.summary = f"part of the job-wide incident {inc.id} ({rule.cause})"
            inc.evidence.extend(other.evidence[: max(0, MAX_EVIDENCE - len(inc.evidence))])
        book.promote_cause(inc)
        return inc, True

    def to_dict(self) -> dict[str, Any]:
        return {"seen": [[job, rule, [list(x) for x in q]] for (job, rule), q in self.seen.items()],
                "open_incident": [[job, rule, inc] for (job, rule), inc in self.open_incident.items()]}

    def restore(self, d: dict[str, Any]) -> None:
        self.seen = {(job, rule): deque((float(t), str(n)) for t, n in q) for job, rule, q in d.get("seen", [])}
        self.open_incident = {(job, rule): inc for job, rule, inc in d.get("open_incident", [])}
