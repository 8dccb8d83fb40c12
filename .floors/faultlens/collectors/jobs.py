"""The agent's ``jobs`` source: publishes the job's topology from the file the launcher writes.

Diagnosis needs each job's topology (ranks -> node, GPU; TP/PP/DP) on the compacted
``jobs`` topic. The launcher (or a Slurm prolog, a Kubernetes init container) writes it
as ``job.json`` (the batch directory's format, DESIGN.md); the agent of every node of
the job publishes it (keyed by job: copies replace each other):

* when the agent starts, and whenever the file changes (mtime or size);
* again when the broker has lost what it held (``republish``: the agent's delivery saw
  a partition's offsets go back; a memory-only broker restarted empty forgets the jobs
  topic, and diagnosis would then judge the job's nodes without their job).

A file that does not parse is reported (state ``error``, the reason) and kept unread
until it changes; the agent goes on.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from faultlens import schema
from faultlens.collectors.batch import read_job
from faultlens.collectors.sources import AgentServices, Source, SourceBase, register_source
from faultlens.errors import SchemaError

log = logging.getLogger(__name__)


class JobFileSource(SourceBase):
    """Publishes ``options["path"]`` (else ``agent.job_file``) as a ``JobTopology``."""

    name = "jobs"

    def __init__(self, agent: AgentServices, options: dict[str, Any]):
        super().__init__(agent, options)
        self.path: str = options.get("path") or agent.config.agent.job_file
        self._seen: tuple[float, int] | None = None
        self.published = 0

    def start(self, positions: dict[str, Any]) -> None:
        if not self.path:
            self.agent.set_state(self.name, "off", "no job file configured")
            return
        self.agent.set_state(self.name, "ok", f"publishing {self.path}")
        self.poll(0.0)

    def poll(self, now: float) -> None:
        if not self.path:
            return
        try:
            st = os.stat(self.path)
        except OSError:
            return  # not written yet: the launcher writes it when the job starts
        seen = (st.st_mtime, st.st_size)
        if seen != self._seen:
            self._seen = seen
            self.publish()

    def republish(self) -> None:
        """The broker lost its topics: publish the topology again."""
        if self.path and self._seen is not None:
            self.publish()

    def publish(self) -> None:

        try:
            topo = read_job(Path(self.path))
        except (OSError, ValueError, TypeError, SchemaError) as exc:
            self.agent.parse_failure(self.name)
            self.agent.set_state(self.name, "error", f"{self.path}: {exc}"[:300])
            return
        if topo.ts <= 0:
            topo = schema.replace(topo, ts=self.agent.clock())
        self.agent.emit_many([topo])
        self.published += 1
        self.agent.set_state(self.name, "ok", f"publishing {self.path}")
        self.agent.success(self.name, records=1)


def _agent_source(agent: AgentServices, options: dict[str, Any]) -> Source:
    return JobFileSource(agent, options)


register_source("jobs", _agent_source)
