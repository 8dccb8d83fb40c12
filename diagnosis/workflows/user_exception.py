"""User exception: the same Python exception raised by the user's code on the ranks (not the infrastructure's).

It reads the ranks' tracebacks, waits ``exception_settle_s`` for the other ranks' (they arrive within
seconds), then takes the route's decision (rollback_code when enough ranks raised it); the ranks that
raise it after the decision are counted on the incident and raise its confidence.
"""

from __future__ import annotations

from typing import Any

from faultlens.diagnosis.decision import Decision
from faultlens.diagnosis.exceptions import user_exception
from faultlens.diagnosis.incidents import OpenIncident, Signal
from faultlens.diagnosis.workflows.base import BaseWorkflow, Desk, carry_out, route_decision
from faultlens.diagnosis.workflows.lines import mark_estimated
from faultlens.schema import NcclEvent
from faultlens.vocabulary import ActionType, IncidentKind


class UserExceptionWorkflow(BaseWorkflow):
    name = "user_exception"
    kinds = frozenset({IncidentKind.USER_EXCEPTION})
    reads: tuple[type, ...] = (NcclEvent,)

    def observe(self, desk: Desk, record: Any, job: str) -> bool:
        fp = user_exception(record)
        if fp is None:
            return False
        sig = Signal(ts=record.ts, job=job, kind=IncidentKind.USER_EXCEPTION, role="job", confidence=0.5,
                     rule="engine:python_exception", source="nccl", text=record.raw, node=record.node,
                     rank=record.rank)
        mark_estimated(sig, record)
        inc = desk.file(sig, decide=False)
        if inc is None:
            return True
        ranks = inc.state.exception_ranks
        ranks.setdefault(fp, set()).add(record.rank if record.rank is not None else hash((record.node, record.pid)))
        desk.decide(inc)
        if ActionType.ROLLBACK_CODE in inc.decided:
            # decided at the first traceback; the ranks that raised it since are counted on the incident
            again = route_decision(desk, inc)
            if isinstance(again, Decision) and again.type == ActionType.ROLLBACK_CODE:
                inc.summary, inc.confidence, inc.dirty = again.reason, max(inc.confidence, again.confidence), True
        return True

    def decide(self, desk: Desk, inc: OpenIncident) -> None:
        if desk.held_for_job(inc):
            return
        settle, st = desk.settings.exception_settle_s, desk.state
        if not st.final and st.now - inc.opened_ts < settle:
            inc.state.waiting = f"waiting {settle:.0f} s for the other ranks' tracebacks"
            return
        carry_out(desk, inc, route_decision(desk, inc))
