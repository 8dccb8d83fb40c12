"""Kubernetes: cordon the blamed nodes and taint them with runner.k8s_taint.

``kubectl cordon -- <node>`` stops new pods landing there; ``kubectl taint nodes
--overwrite -- <node> <taint>`` says why, and with effect ``NoExecute`` also moves
pods without a toleration off the node. Restarting the job itself belongs to
the job's operator (PyTorchJob, JobSet...): use the command adapter for that.

| action           | commands |
|------------------|----------|
| evict_nodes      | cordon + taint each node |
| run_diagnostics  | cordon + taint each node; runner.diagnostics_command per node when set |
| notify           | none: only the status |
| restart_job, rollback_code, adapt_parallelism | refused |
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

from faultlens.config import RunnerConfig
from faultlens.diagnosis.runner.adapter_base import (
    Refused,
    Step,
    check_nodes,
    fill_template,
    parse_template,
    template_values,
)
from faultlens.errors import ConfigError
from faultlens.schema import Action
from faultlens.vocabulary import ActionType

# key[=value]:Effect, with the key and value syntax of Kubernetes labels.
TAINT_RE = re.compile(
    r"^(?:[a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
    r"(?:=[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?:(?:NoSchedule|PreferNoSchedule|NoExecute)$"
)


class KubernetesAdapter:
    name: ClassVar[str] = "kubernetes"
    executes: ClassVar[bool] = True

    def __init__(self, config: RunnerConfig, *, kubectl: str = "kubectl"):
        if not TAINT_RE.match(config.k8s_taint):
            raise ConfigError(f"not a taint (key[=value]:NoSchedule|PreferNoSchedule|NoExecute): {config.k8s_taint!r}",
                              key="runner.k8s_taint")
        self.config = config
        self.kubectl = kubectl
        self.diagnostics = parse_template(config.diagnostics_command, key="runner.diagnostics_command")

    def _isolate(self, node: str) -> list[Step]:
        return [
            # Options first, then "--": what follows is never read as an option.
            Step((self.kubectl, "cordon", "--", node)),
            Step((self.kubectl, "taint", "nodes", "--overwrite", "--", node, self.config.k8s_taint)),
        ]

    def plan(self, action: Action, event: Mapping[str, Any]) -> list[Step]:
        if action.type == ActionType.NOTIFY:
            return []
        if action.type in (ActionType.EVICT_NODES, ActionType.RUN_DIAGNOSTICS):
            nodes = check_nodes(action.nodes, required=True)
            steps = [s for n in nodes for s in self._isolate(n)]
            if action.type == "run_diagnostics" and self.diagnostics:
                values = template_values(action)
                steps += [Step(fill_template(self.diagnostics, {**values, "node": n})) for n in nodes]
            return steps
        raise Refused(f"{action.type} is not supported by the kubernetes adapter; use the command adapter")
