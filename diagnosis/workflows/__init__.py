"""Incident families as workflows behind one protocol (base.Workflow); the engine routes to them.

A new family is one module here with one class (its kinds, ``decide``, ``on_tick``, and the records
it reads, if any), listed in ``build``; its settings go in settings.EngineSettings.
"""

from __future__ import annotations

from faultlens.diagnosis.jobwide import JobWideRule
from faultlens.diagnosis.settings import EngineSettings
from faultlens.diagnosis.workflows.base import BaseWorkflow, Desk, Workflow
from faultlens.diagnosis.workflows.hang import HangWorkflow
from faultlens.diagnosis.workflows.job_wide import JobWideWorkflow
from faultlens.diagnosis.workflows.machine_fault import MachineFaultWorkflow
from faultlens.diagnosis.workflows.nan_loss import NanLossWorkflow
from faultlens.diagnosis.workflows.slow_machine import SlowMachineWorkflow
from faultlens.diagnosis.workflows.user_exception import UserExceptionWorkflow

__all__ = ["BaseWorkflow", "Desk", "HangWorkflow", "JobWideWorkflow", "MachineFaultWorkflow", "NanLossWorkflow",
           "SlowMachineWorkflow", "UserExceptionWorkflow", "Workflow", "build"]


def build(settings: EngineSettings, jobwide_rules: list[JobWideRule]) -> list[Workflow]:
    """Every workflow, in routing order: a record type read by several goes to them in this order (a step:
    the hang's progress before the NaN watch; an NCCL line: the NaN lines before the tracebacks)."""
    return [HangWorkflow(settings.hang), NanLossWorkflow(), UserExceptionWorkflow(), SlowMachineWorkflow(),
            JobWideWorkflow(jobwide_rules), MachineFaultWorkflow()]
