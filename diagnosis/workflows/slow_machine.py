"""Slow machine: a machine that is slow, not dead (fail-slow, thermal throttling, a degraded PCIe link).

Its route's eviction goes through the adaptation planner (remedy.adapt_or_evict), which may keep the
job on a new parallel plan when that beats evicting by predicted goodput; and a slow machine gets one
decision: a second incident on the same machine (the step-time model's fail_slow beside the throttle
counters' thermal_throttle) joins the one already decided instead of taking a second remedy.
"""

from __future__ import annotations

from faultlens.diagnosis.decision import Decision
from faultlens.diagnosis.incidents import OpenIncident
from faultlens.diagnosis.remedy import ADAPTABLE_KINDS, adapt_or_evict
from faultlens.diagnosis.workflows.base import BaseWorkflow, Desk, carry_out, route_decision
from faultlens.vocabulary import ActionType


class SlowMachineWorkflow(BaseWorkflow):
    name = "slow_machine"
    kinds = frozenset(ADAPTABLE_KINDS)

    def decide(self, desk: Desk, inc: OpenIncident) -> None:
        if desk.held_for_job(inc):
            return
        decision = route_decision(desk, inc)
        if isinstance(decision, Decision) and decision.type == ActionType.EVICT_NODES:
            if _joined_earlier_decision(desk, inc, decision):
                return
            job = desk.state.jobs.get(inc.job)
            decision = adapt_or_evict(inc, decision, topology=job.topology if job else None, config=desk.config,
                                      now=desk.state.now, final=desk.state.final)
        taken = carry_out(desk, inc, decision)
        if taken is not None and taken.type in (ActionType.EVICT_NODES, ActionType.ADAPT_PARALLELISM):
            for node in taken.nodes:
                desk.state.slow_remedy.setdefault(inc.job, {}).setdefault(node, (taken.type, inc.id))


def _joined_earlier_decision(desk: Desk, inc: OpenIncident, decision: Decision) -> bool:
    """Every machine of ``decision`` already took a remedy for another incident: ``inc`` joins it. True: joined."""
    taken = desk.state.slow_remedy.get(inc.job, {})
    earlier = [taken[n] for n in decision.nodes if n in taken and taken[n][1] != inc.id]
    if not decision.nodes or len(earlier) < len(decision.nodes):
        return False
    action, host_id = earlier[0]
    host = desk.book.incidents.get(host_id)
    inc.decided.add(decision.type)
    inc.status, inc.state.folded_into, inc.state.waiting, inc.dirty = "resolved", host_id, None, True
    inc.summary = (f"the same slow machine as incident {host_id}, which already took {action}: one decision per "
                   "slow machine")
    if host is not None:
        host.note_muted(inc.kind, f"incident {inc.id} ({inc.kind})", "one_decision_per_slow_machine",
                        inc.opened_ts, node=inc.node)
    return True
