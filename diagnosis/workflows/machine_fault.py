"""Explicit machine fault: a kernel, NVML or fabric signal that names a machine (an Xid, ECC, a link down).

Its route decides at once (evict, reset, run diagnostics, notify; policy.toml ``[route.<kind>]``),
after the job-wide hold where a ``[[jobwide]]`` rule watches the kind. A kind whose route has a
``rooted_action`` (a hung task) also waits while the job's hang is waiting for its stacks: when the
stacks root the hang on this machine, the hang workflow takes that action on it instead. It takes
every incident kind no other workflow owns, including the unclassified ones a signature opened.
"""

from __future__ import annotations

from faultlens.diagnosis.incidents import OpenIncident
from faultlens.diagnosis.workflows.base import BaseWorkflow, Desk, carry_out, route_decision
from faultlens.vocabulary import IncidentKind

HANG_ROOT = "hang_root"  # IncidentState.pending while a machine incident waits for the job's hang's stacks


class MachineFaultWorkflow(BaseWorkflow):
    name = "machine_fault"

    def decide(self, desk: Desk, inc: OpenIncident) -> None:
        if desk.held_for_job(inc) or _waits_for_hang_root(desk, inc):
            return
        carry_out(desk, inc, route_decision(desk, inc))


def _waits_for_hang_root(desk: Desk, inc: OpenIncident) -> bool:
    """True while the job's hang, not yet decided, waits for its stacks and the incident's route has a
    ``rooted_action`` (the stacks may root the hang on this machine: one action, not two)."""
    hang_waiting = desk.policy.route(inc.kind).rooted_action is not None and not desk.state.final and any(
        o.kind == IncidentKind.HANG and o.state.pending == "hang" and not o.decided
        for o in desk.book.open_incidents(inc.job))
    if hang_waiting:
        inc.state.waiting = "waiting for the job's hang's stacks (they may root it on this machine)"
        inc.state.pending = inc.state.pending or HANG_ROOT  # not closed as quiet while it waits
    elif inc.state.pending == HANG_ROOT:
        inc.state.pending = inc.state.waiting = None
    return hang_waiting
