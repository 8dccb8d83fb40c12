"""Remedies that need more than the policy's route: adapting instead of evicting, NaN loss's culprit.

* ``adapt_or_evict``: a slow (not dead) machine; the adaptation planner may keep the job
  running on a new parallel plan when that beats evicting it by predicted goodput.
* ``nan_culprits``: NaN/Inf loss; the machines to suspect first (a rank that went bad
  before the others, ECC/Xid/GPU evidence on a node of the job in the window).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from faultlens.config import Config
from faultlens.diagnosis.adaptation import choose_remediation
from faultlens.diagnosis.decision import Decision, Hold
from faultlens.diagnosis.incidents import OpenIncident
from faultlens.diagnosis.nanloss import NanWatch
from faultlens.diagnosis.policy import Policy
from faultlens.schema import Finding
from faultlens.stream.topology import Topology
from faultlens.vocabulary import ActionType, FaultKind, IncidentKind, LineAction

if TYPE_CHECKING:
    from faultlens.diagnosis.engine import JobState

log = logging.getLogger(__name__)

# Incident kinds where a machine is slow rather than dead: the planner may keep it.
ADAPTABLE_KINDS = frozenset({IncidentKind.FAIL_SLOW, IncidentKind.THERMAL_THROTTLE, IncidentKind.PCIE_DEGRADATION})
# Incident kinds whose evidence on a machine, in the window of a NaN loss, names that machine.
NAN_MACHINE_KINDS = frozenset({
    IncidentKind.ECC_UNCORRECTABLE, IncidentKind.ROW_REMAP_FAILURE, IncidentKind.ROW_REMAP_PENDING,
    IncidentKind.RETIRED_PAGES, IncidentKind.GPU_HARDWARE, IncidentKind.GPU_LOST, IncidentKind.NVLINK_ERROR,
    IncidentKind.PCIE_DEGRADATION})
NAN_WINDOW_S = 900.0
_REMEDIES = frozenset({ActionType.EVICT_NODES, ActionType.ADAPT_PARALLELISM})


def adapt_or_evict(inc: OpenIncident, decision: Decision, *, topology: Topology | None, config: Config,
                   now: float, final: bool) -> Decision | Hold:
    """A slow (not dead) machine: ask the adaptation planner whether keeping the job
    running on a new plan beats evicting it, by predicted goodput over the horizon.

    Needs the job's topology and a measured slowdown (the fail-slow detector's
    figures in the evidence); without them the explicit rule's eviction stands, and
    when the planner finds that nothing pays off the eviction stands too (the
    machine is faulty; a person can still choose to keep it)."""
    if not config.adaptation.enabled or topology is None:
        return decision
    taken = inc.decided & _REMEDIES
    if taken:
        return Hold(f"one remedy per incident: {', '.join(sorted(taken))} already taken")
    measured = next((e for e in reversed(inc.evidence)
                     if str(e.get("source", "")).startswith("model:") and "slowdown" in (e.get("figures") or {})), None)
    if measured is None:
        # ByteRobust confirms a throttling gray failure against the job's throughput before
        # acting: wait a while for the step-time detector to measure the slowdown.
        waited = now - inc.opened_ts
        if final or waited >= config.adaptation.confirm_wait_s:
            return decision
        return Hold(f"confirming the slowdown against the job's steps ({waited:.0f}/"
                    f"{config.adaptation.confirm_wait_s:.0f} s) before choosing eviction or adaptation")

    finding = Finding(ts=float(measured.get("ts", now)), kind=FaultKind.FAIL_SLOW, category=inc.category,
                      severity="critical", action=LineAction.EVICT_NODE, confidence=decision.confidence,
                      source=str(measured.get("source")), rule=str(measured.get("rule", "")),
                      text=str(measured.get("text", "")), node=measured.get("node"), job=inc.job,
                      gpu=measured.get("gpu"), rank=measured.get("rank"), figures=dict(measured["figures"]))
    try:
        action = choose_remediation(finding, topology, config=config, incident_id=inc.id, now=now)
    except (ValueError, KeyError) as exc:
        log.warning("adaptation planner could not plan for %s: %s", inc.id, exc)
        return decision
    if action.type == ActionType.ADAPT_PARALLELISM:
        return Decision(ActionType.ADAPT_PARALLELISM, tuple(decision.nodes), action.reason, decision.confidence,
                        plan=action.plan)
    return Decision(decision.type, decision.nodes, decision.reason, decision.confidence, plan=action.plan)


def nan_culprits(inc: OpenIncident, nan: NanWatch, topology: Topology | None,
                 incidents: Iterable[OpenIncident],
                 evidence: Iterable[tuple[float, str, str, str]] = ()) -> tuple[dict[str, str], str]:
    """NaN/Inf loss: node -> why it is suspected (marked on the incident as suspects), and what the
    search found when no machine is named. A rank that went bad first, then ECC/Xid/GPU evidence
    on one of the job's machines within ``NAN_WINDOW_S`` of the NaN."""
    culprits: dict[str, str] = {}
    ranks, why = nan.culprit_ranks()
    nodes = {topology.placement.get(r, (None, None))[0] for r in ranks} if topology else set()
    if len(nodes) > 1 and not nan.named:
        # A bad GPU poisons its own rank first; ranks of several machines going bad first together are the
        # job's own change read at different steps (a learning-rate edit on a real DDP job, issue 35).
        why = f"{why}; those ranks are on {len(nodes)} machines: no one machine went first"
        ranks = []
    for r in ranks:
        node = topology.placement.get(r, (None, None))[0] if topology else None
        if node:
            culprits.setdefault(node, why)
            inc.suspect(node, 0.8, why, rank=r)
    for other in incidents:
        if other.job == inc.job and other.node and other.kind in NAN_MACHINE_KINDS \
                and abs(other.opened_ts - inc.opened_ts) <= NAN_WINDOW_S:
            reason = f"{other.kind} on {other.node} in the window (incident {other.id})"
            culprits.setdefault(other.node, reason)
            inc.suspect(other.node, 0.85, reason)
    for ts, node, kind, text in evidence:  # informational lines that opened no incident (Xid 63)
        if abs(ts - inc.opened_ts) <= NAN_WINDOW_S and (topology is None or node in topology.nodes):
            reason = f"{kind} evidence on {node} in the window (an informational line: {text.strip()[:120]})"
            culprits.setdefault(node, reason)
            inc.suspect(node, 0.8, reason)
    return culprits, why




def decide_nan(inc: OpenIncident, job: JobState, policy: Policy, incidents: Iterable[OpenIncident],
               evicted: set[str], *, wait_s: float) -> Decision | None:
    """NaN/Inf loss: a machine first (a rank that went bad first, ECC/Xid on a node in the window),
    else stop-time checks on the whole job; never no action. Decides once, after ``wait_s`` more seconds
    (every rank's report of the step settles); None while waiting, once decided, or when the machine
    named was already evicted by its own incident (then the summary says so)."""
    if inc.decided or inc.state.nan_search:
        return None
    if wait_s > 0:
        inc.state.waiting = f"waiting {wait_s:.0f} s more for every rank's steps before naming the first"
        return None
    culprits, why = nan_culprits(inc, job.nan, job.topology, incidents, getattr(job, "machine_evidence", ()))
    inc.state.nan_search = "culprit" if culprits else why
    inc.state.waiting = None
    if culprits and set(culprits) <= evicted:  # the machine's own incident already evicted it: explained
        inc.summary = f"NaN/Inf loss explained by the eviction of {', '.join(sorted(culprits))} " \
                      f"({'; '.join(culprits.values())})"
        inc.dirty = True
        return None
    return policy.decide_nan(inc, culprits, job.nodes)
