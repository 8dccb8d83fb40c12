"""Log lines to signals: what the engine does with a kernel or NCCL line no workflow took for itself.

The policy's signal matchers read the line (with the signature catalog's finding); a line the catalog
calls informational opens nothing (its machine evidence is kept for the NaN search); a signature no
policy signal names opens one unclassified incident that takes the signature's own action.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from faultlens.collectors.signatures import classify
from faultlens.diagnosis.incidents import Signal
from faultlens.diagnosis.policy import SignalMatcher, unmatched_but_actionable
from faultlens.diagnosis.remedy import NAN_MACHINE_KINDS
from faultlens.schema import KernelEvent, NcclEvent
from faultlens.vocabulary import IncidentKind

MACHINE_EVIDENCE_KEPT = 64  # informational machine lines a job keeps for the NaN search


def line_signal(matcher: SignalMatcher, record: KernelEvent | NcclEvent, job_name: str, job_state: Callable[[str], Any],
                finding: Any, classified: bool, counts: dict[str, int]) -> Signal | None:
    """The signal a line files (None: nothing to act on). ``job_state``: the job's state by name (its
    machine evidence), ``finding``: the signature catalog's, ``classified``: the catalog read the line."""
    signal = matcher.match_record(record, job_name, finding=finding)
    if signal is not None and finding is None and classified and signal.role != "info" and _catalog_says_benign(record):
        # One verdict: the catalog found nothing to act on in this line (an informational entry such as
        # Xid 63, a row marked for remapping), so it opens no incident here either (explain says none).
        counts["benign_lines"] = counts.get("benign_lines", 0) + 1
        if signal.node and signal.kind in NAN_MACHINE_KINDS:
            kept = job_state(job_name).machine_evidence
            kept.append((signal.ts, signal.node, signal.kind, record.raw[:300]))
            del kept[:-MACHINE_EVIDENCE_KEPT]
        return None
    if signal is None and finding is not None and unmatched_but_actionable(record, finding):
        # A signature no policy signal names: one unclassified incident that takes the signature's own
        # action (route action "signature"), under the route's confidence floor and the guard rails.
        signal = Signal(ts=record.ts, job=job_name, kind=IncidentKind.UNCLASSIFIED, role="cause",
                        confidence=finding.confidence, rule=f"classify:{finding.rule}", source=finding.source,
                        text=record.raw, node=record.node, rank=record.rank, category=finding.category,
                        severity=finding.severity, action=finding.action, signature=finding.rule)
    if signal is None:
        return None
    if finding is not None:
        signal.figures.setdefault("meaning", getattr(finding, "text", "")[:300])
        signal.category = finding.category
    mark_estimated(signal, record)
    stalled_s = _stalled_s(record)
    if stalled_s is not None:
        signal.figures["stall_began_ts"] = record.ts - stalled_s  # the stall began a timeout before the line
    if signal.kind == IncidentKind.HANG:
        signal.role = "job"  # a watchdog timeout says the job hangs, not where
    return signal


def _catalog_says_benign(record: KernelEvent | NcclEvent) -> bool:
    """The signature catalog has an entry for this line and it says there is nothing to act on (explain's
    info/none verdict), as opposed to a line the catalog does not know (the policy's own patterns decide)."""
    c = classify(record)  # stateless: a repeat that escalates already gave a finding
    return c.rule is not None and (c.benign or c.category == "none")


def _stalled_s(record: KernelEvent | NcclEvent) -> float | None:
    """How long the collective a watchdog line names had been stuck: its ``ran for`` figure, else its timeout."""
    if not isinstance(record, NcclEvent):
        return None
    ms = record.ran_for_ms if record.ran_for_ms and record.ran_for_ms > 0 else record.timeout_ms
    return ms / 1000.0 if ms and ms > 0 else None


def mark_estimated(signal: Signal, record: KernelEvent | NcclEvent) -> None:
    """A log time the batch reader estimated (boot-relative dmesg, an untimed line) says so in the evidence."""
    if record.fields.get("ts_estimated"):
        signal.figures["ts_estimated"] = True
        signal.figures["ts_anchor"] = record.fields.get("ts_anchor", "")
