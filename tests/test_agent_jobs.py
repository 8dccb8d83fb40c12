"""The agent's ``jobs`` source: the launcher's job.json published at start, on change, after a broker loss.

Input: tests/fixtures/jobs/job.json (written by the simulator's LiveWriter; SOURCES.md there).
No broker: what the source emits is read from the agent's delivery queue.
"""

from __future__ import annotations

import os
from pathlib import Path

from faultlens import schema
from faultlens.collectors.agent import Agent
from faultlens.config import AgentConfig, BusConfig, Config

JOB_FILE = Path(__file__).parent / "fixtures" / "jobs" / "job.json"


def _agent(tmp_path: Path, job_file: Path | None) -> Agent:
    config = Config(bus=BusConfig(bootstrap_servers="127.0.0.1:1"),
                    agent=AgentConfig(spool_dir=str(tmp_path / "spool"), job_file=str(job_file) if job_file else ""))
    agent = Agent(config, node="n1", sources=("jobs",))
    agent._start_sources()
    return agent


def _queued(agent: Agent) -> list[schema.JobTopology]:
    with agent.delivery._qlock:
        entries, agent.delivery._queue = agent.delivery._queue, []
    return [schema.decode("jobs", e[2]) for e in entries]


def test_the_topology_is_published_at_start_on_change_and_after_a_broker_loss(tmp_path: Path) -> None:
    job = tmp_path / "job.json"
    job.write_bytes(JOB_FILE.read_bytes())
    agent = _agent(tmp_path, job)
    first = _queued(agent)
    assert [t.job for t in first] == ["llm-pretrain-3"] and first[0].tp == 8 and first[0].ts > 0
    agent._sources[0].poll(1.0)
    assert _queued(agent) == []  # unchanged: not sent again
    job.write_text(JOB_FILE.read_text().replace('"pp": 1', '"pp": 1 '))  # rewritten by the launcher
    os.utime(job, (1, 1))
    agent._sources[0].poll(2.0)
    assert [t.job for t in _queued(agent)] == ["llm-pretrain-3"]
    agent._on_broker_lost()  # the delivery saw the broker lose what it held
    assert [t.job for t in _queued(agent)] == ["llm-pretrain-3"]
    assert agent.health["jobs"].state == "ok"


def test_a_job_file_that_does_not_parse_is_reported_and_the_agent_goes_on(tmp_path: Path) -> None:
    job = tmp_path / "job.json"
    job.write_text(JOB_FILE.read_text()[:120])  # cut mid-write
    agent = _agent(tmp_path, job)
    assert _queued(agent) == []
    h = agent.health["jobs"]
    assert h.state == "error" and str(job) in h.detail and h.parse_failures == 1
    job.write_bytes(JOB_FILE.read_bytes())
    agent._sources[0].poll(1.0)
    assert [t.job for t in _queued(agent)] == ["llm-pretrain-3"] and agent.health["jobs"].state == "ok"


def test_no_job_file_is_off_not_unhealthy(tmp_path: Path) -> None:
    agent = _agent(tmp_path, None)
    assert agent.health["jobs"].state == "off" and agent.healthy
