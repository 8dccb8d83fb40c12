"""A command hook: one configured program receives every action as JSON on stdin.

faultlens never changes a training framework itself. A site's own tooling
(a restart script, a launcher that applies an adapt_parallelism plan, a ticket
bot) is plugged in as ``runner.hook_command``, an argv template split like a
shell line but never run by a shell. Placeholders ``{type}``, ``{job}``,
``{incident}`` and ``{action}`` are replaced inside arguments; the whole
CloudEvent (with the action as ``data``) arrives on stdin. Exit status 0 means
done; anything else is reported as failed with the tail of stderr.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import orjson

from faultlens.config import RunnerConfig
from faultlens.diagnosis.runner.adapter_base import (
    Step,
    check_nodes,
    fill_template,
    parse_template,
    template_values,
)
from faultlens.errors import ConfigError
from faultlens.schema import Action


class CommandAdapter:
    name: ClassVar[str] = "command"
    executes: ClassVar[bool] = True

    def __init__(self, config: RunnerConfig):
        self.config = config
        self.template = parse_template(config.hook_command, key="runner.hook_command")
        if not self.template:
            raise ConfigError("the command adapter needs runner.hook_command", key="runner.hook_command")

    def plan(self, action: Action, event: Mapping[str, Any]) -> list[Step]:
        check_nodes(action.nodes, required=False)
        values = template_values(action)
        return [Step(fill_template(self.template, values), stdin=orjson.dumps(dict(event)))]
