"""Slurm: drain the blamed nodes with a reason, then requeue the job.

``scontrol update NodeName=<n> State=DRAIN Reason="faultlens <incident>: <reason>"``
lets running work finish and schedules nothing new on the node; ``sinfo -R``
shows the reason, and ``scontrol update NodeName=<n> State=RESUME`` returns it
(a person's decision, never faultlens'). The job id of an action must be the
Slurm job id (digits, or ``<id>_<task>`` for an array task).

| action           | commands |
|------------------|----------|
| evict_nodes      | drain each node; ``scontrol requeue <job>`` (runner.slurm_requeue) |
| restart_job      | ``scontrol requeue <job>`` |
| run_diagnostics  | drain each node; runner.diagnostics_command per node when set |
| notify           | none: only the status |
| rollback_code, adapt_parallelism | refused: the job's own tooling does those (command adapter) |
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from faultlens.config import RunnerConfig
from faultlens.diagnosis.runner.adapter_base import (
    Refused,
    Step,
    check_nodes,
    check_slurm_job,
    clean_text,
    fill_template,
    parse_template,
    template_values,
)
from faultlens.schema import Action


class SlurmAdapter:
    name: ClassVar[str] = "slurm"
    executes: ClassVar[bool] = True

    def __init__(self, config: RunnerConfig, *, scontrol: str = "scontrol"):
        self.config = config
        self.scontrol = scontrol
        self.diagnostics = parse_template(config.diagnostics_command, key="runner.diagnostics_command")

    def _drain(self, node: str, action: Action) -> Step:
        reason = clean_text(f"faultlens {action.incident_id}: {action.reason or action.type}")
        return Step((self.scontrol, "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"))

    def _requeue(self, job: str) -> Step:
        return Step((self.scontrol, "requeue", job))

    def plan(self, action: Action, event: Mapping[str, Any]) -> list[Step]:
        if action.type == "notify":
            return []
        if action.type == "evict_nodes":
            nodes = check_nodes(action.nodes, required=True)
            job = check_slurm_job(action.job) if self.config.slurm_requeue else ""
            steps = [self._drain(n, action) for n in nodes]
            return steps + ([self._requeue(job)] if job else [])
        if action.type == "restart_job":
            return [self._requeue(check_slurm_job(action.job))]
        if action.type == "run_diagnostics":
            nodes = check_nodes(action.nodes, required=True)
            steps = [self._drain(n, action) for n in nodes]
            if self.diagnostics:
                values = template_values(action)
                steps += [Step(fill_template(self.diagnostics, {**values, "node": n})) for n in nodes]
            return steps
        raise Refused(f"{action.type} is not supported by the slurm adapter; use the command adapter")
