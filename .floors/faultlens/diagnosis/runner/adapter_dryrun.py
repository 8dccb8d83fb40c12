"""The default adapter: says what it would do and does nothing.

It is the safe choice for a first deployment: actions, their reasons and the
nodes they name appear in the runner's log and on action-status (status
``dry_run``) without any machine being touched.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from faultlens.config import RunnerConfig
from faultlens.diagnosis.runner.adapter_base import Step
from faultlens.schema import Action


class DryRunAdapter:
    name: ClassVar[str] = "dry-run"
    executes: ClassVar[bool] = False

    def __init__(self, config: RunnerConfig):
        self.config = config

    def plan(self, action: Action, event: Mapping[str, Any]) -> list[Step]:
        return []

    @staticmethod
    def describe(action: Action) -> str:
        where = f" on {', '.join(action.nodes)}" if action.nodes else ""
        return f"would {action.type}{where} for job {action.job} (incident {action.incident_id}): {action.reason or '-'}"
