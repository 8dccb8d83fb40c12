"""Job-wide events: one host-level signal on most of a job's nodes is one shared cause (diagnosis.jobwide).

Two stages around the other workflows: before the book, a node's signal of a watched kind counts towards
its rule (and joins the shared-cause incident, which is notified once when it opens); before a node's
own incident of a watched kind is decided, it waits the rule's ``hold_s`` for the job's other nodes.
The shared-cause incident itself is decided by its route like any other (the machine-fault workflow).
"""

from __future__ import annotations

from faultlens.diagnosis.decision import Decision
from faultlens.diagnosis.incidents import OpenIncident, Signal
from faultlens.diagnosis.jobwide import JobWideRule
from faultlens.diagnosis.workflows.base import BaseWorkflow, Desk
from faultlens.vocabulary import ActionType

JOBWIDE_HOLD = "jobwide_hold"  # IncidentState.pending while a node's incident waits for the job's other nodes


class JobWideWorkflow(BaseWorkflow):
    """Owns the shared-cause kinds of the catalog's ``[[jobwide]]`` rules (decided by their routes) and
    the two stages: ``file_jobwide`` before the book, ``held_for_job`` before a node's own decision."""

    name = "job_wide"

    def __init__(self, rules: list[JobWideRule]):
        self.kinds = frozenset(r.kind for r in rules)


def file_jobwide(desk: Desk, signal: Signal) -> OpenIncident | None:
    """A watched host-level signal with a node: the shared-cause incident it joined (None: it stays the node's)."""
    if not signal.node or signal.rule.startswith("jobwide:"):
        return None
    correlator = desk.state.jobwide
    rule = correlator.rule_for(signal.kind, signal.source)
    job = desk.state.jobs.get(signal.job) if rule is not None else None
    if rule is None or job is None:
        return None
    inc, opened = correlator.file(desk.book, signal, rule, job.nodes)
    if inc is not None and opened:
        desk.act(inc, Decision(ActionType.NOTIFY, (), f"job-wide {rule.kind}: {inc.summary} (nodes "
                               f"{', '.join(inc.state.affected_nodes[:16])})", inc.confidence, blame=False))
    return inc


def held_for_job(desk: Desk, inc: OpenIncident) -> bool:
    """A node's incident of a watched kind waits ``hold_s`` for the job's other nodes; True while it waits."""
    st = desk.state
    job = st.jobs.get(inc.job)
    rule = st.jobwide.rule_for(inc.kind) if inc.node is not None else None
    if rule is not None and rule.hold_s > 0 and job is not None and len(job.nodes) >= rule.min_nodes \
            and not st.final and st.now - inc.opened_ts < rule.hold_s:
        inc.state.waiting = f"waiting {rule.hold_s:.0f} s for the job's other nodes ({rule.name})"
        inc.state.pending = inc.state.pending or JOBWIDE_HOLD  # not closed as quiet while it waits
        return True  # the job's other nodes may report the same within the hold: then it is one shared cause
    if inc.state.pending == JOBWIDE_HOLD:
        inc.state.pending = None
    return False
