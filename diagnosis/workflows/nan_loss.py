"""NaN loss: a rank's loss or gradients stopped being numbers (diagnosis.nanloss, remedy.decide_nan).

It reads the steps' losses and the framework's own NaN lines (the policy catalog's ``nan_patterns``),
waits ``nan_settle_s`` (and three median steps) for every rank's report of the step, then names a
machine (the rank that went bad first, machine evidence in the window) or asks for stop-time checks
on the whole job: never no action.
"""

from __future__ import annotations

from typing import Any

from faultlens.diagnosis.incidents import OpenIncident, Signal
from faultlens.diagnosis.nanloss import rank_named_in
from faultlens.diagnosis.remedy import decide_nan
from faultlens.diagnosis.workflows.base import BaseWorkflow, Desk
from faultlens.diagnosis.workflows.lines import mark_estimated
from faultlens.schema import NcclEvent, StepTiming
from faultlens.vocabulary import IncidentKind

MAX_STEP_SIGNALS = 8  # non-finite steps filed per job: the first few say it all


class NanLossWorkflow(BaseWorkflow):
    name = "nan_loss"
    kinds = frozenset({IncidentKind.NAN_LOSS})
    reads: tuple[type, ...] = (NcclEvent, StepTiming)

    def observe(self, desk: Desk, record: Any, job: str) -> bool:
        if type(record) is StepTiming:
            self._on_step(desk, record)
            return False
        nan_re = desk.policy.catalog.nan_patterns
        if nan_re is None or not nan_re.search(record.raw):
            return False
        self._on_line(desk, record, job)
        return True

    @staticmethod
    def _on_line(desk: Desk, record: NcclEvent, job_name: str) -> None:
        """A log line saying a rank's loss or gradients went non-finite: a NaN signal naming that rank."""
        job = desk.job(job_name)
        rank = rank_named_in(record.raw, record.rank)
        if rank is not None:
            job.nan.name_rank(rank, record.raw.strip().splitlines()[0] if record.raw.strip() else record.raw)
        sig = Signal(ts=record.ts, job=job_name, kind=IncidentKind.NAN_LOSS, role="job", confidence=0.8,
                     rule="engine:nan_line", source="nccl", text=record.raw, node=record.node, rank=rank)
        mark_estimated(sig, record)
        desk.file(sig, decide=False)

    @staticmethod
    def _on_step(desk: Desk, rec: StepTiming) -> None:
        job = desk.job(rec.job)
        bad = job.nan.observe(rec)
        if bad is not None and job.nan.nan_signals < MAX_STEP_SIGNALS:
            job.nan.nan_signals += 1
            desk.file(Signal(ts=rec.ts, job=rec.job, kind=IncidentKind.NAN_LOSS, role="job", confidence=0.8,
                             rule="engine:nan_loss", source="steps", text=f"{bad} at step {rec.step} "
                             f"(rank {rec.rank} on {rec.node})", rank=rec.rank, figures={"step": rec.step}),
                      decide=False)

    def decide(self, desk: Desk, inc: OpenIncident) -> None:
        if desk.held_for_job(inc):
            return
        job = desk.state.jobs.get(inc.job)
        if job is None:
            return
        st = desk.state
        settle = max(desk.settings.nan_settle_s, 3.0 * job.progress.median_step_s())
        decision = decide_nan(inc, job, desk.policy, desk.book.incidents.values(), st.evicted.get(inc.job, set()),
                              wait_s=0.0 if st.final else settle - (st.now - inc.opened_ts))
        if decision is not None:
            desk.act(inc, decision)
