"""Runner adapters by name, chosen by ``runner.adapter``.

| name        | module                 | does |
|-------------|------------------------|------|
| dry-run     | adapter_dryrun         | logs what it would do (default) |
| slurm       | adapter_slurm          | scontrol drain + requeue |
| kubernetes  | adapter_kubernetes     | kubectl cordon + taint |
| command     | adapter_command        | a hook program gets the action JSON on stdin |
"""

from __future__ import annotations

from faultlens.config import RunnerConfig
from faultlens.diagnosis.runner.adapter_base import Adapter
from faultlens.diagnosis.runner.adapter_command import CommandAdapter
from faultlens.diagnosis.runner.adapter_dryrun import DryRunAdapter
from faultlens.diagnosis.runner.adapter_kubernetes import KubernetesAdapter
from faultlens.diagnosis.runner.adapter_slurm import SlurmAdapter
from faultlens.errors import ConfigError

ADAPTERS: dict[str, type] = {
    DryRunAdapter.name: DryRunAdapter,
    SlurmAdapter.name: SlurmAdapter,
    KubernetesAdapter.name: KubernetesAdapter,
    CommandAdapter.name: CommandAdapter,
}


def make_adapter(config: RunnerConfig, name: str | None = None) -> Adapter:
    """The adapter ``name`` (default: config.adapter), built from the runner config."""
    name = name or config.adapter
    cls = ADAPTERS.get(name)
    if cls is None:
        raise ConfigError(f"unknown adapter {name!r}; known: {', '.join(ADAPTERS)}", key="runner.adapter")
    return cls(config)
