"""Sources are plugins: the agent runs what is registered and configured, knowing none by name."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from faultlens import schema
from faultlens.collectors.agent import Agent
from faultlens.collectors.sources import (
    Source,
    SourceBase,
    register_source,
    registered,
    source_factory,
)
from faultlens.config import AgentConfig, BusConfig, Config
from faultlens.errors import ConfigError
from faultlens.schema import KernelEvent
from faultlens.stream.bus import Consumer, ensure_topics


class _Heartbeat(SourceBase):
    """A source defined outside collectors/: one kernel record per poll until told to stop."""

    name = "test_heartbeat"

    def __init__(self, agent: Any, options: dict[str, Any]):
        super().__init__(agent, options)
        self.sent = 0

    def start(self, positions: dict[str, Any]) -> None:
        self.agent.set_state(self.name, "ok", "beating")

    def poll(self, now: float) -> None:
        if self.sent < self.options["beats"]:
            self.sent += 1
            text = f"heartbeat {self.sent} from {self.agent.node}"
            self.agent.emit_many([KernelEvent(self.agent.clock(), self.agent.node, "other", text, text)])
            self.agent.success(self.name, records=1)


register_source("test_heartbeat", _Heartbeat)


def test_builtin_sources_register_themselves() -> None:
    for name in ("nvml", "kernel", "nccl", "steps", "stacks"):
        factory = source_factory(name)  # imports faultlens.collectors.<name> on first use
        assert callable(factory)
    assert {"nvml", "kernel", "nccl", "steps", "stacks"} <= set(registered())


def test_an_unknown_source_fails_at_start_naming_it(tmp_path: Path) -> None:
    cfg = Config(agent=AgentConfig(spool_dir=str(tmp_path / "spool")))
    agent = Agent(cfg, node="n1", sources=("no_such_source",))
    with pytest.raises(ConfigError, match="no_such_source"):
        agent._start_sources()
    with pytest.raises(TypeError, match="unexpected keyword"):
        Agent(cfg, node="n1", kernel_path="/x")  # a typo is not silently ignored


@pytest.mark.broker
def test_a_registered_source_runs_in_the_agent_and_ships(bus: BusConfig, tmp_path: Path) -> None:
    ensure_topics(bus)
    cfg = Config(bus=bus, agent=AgentConfig(spool_dir=str(tmp_path / "spool"), health_interval_s=1.0,
                                            ship_ordinary_lines=True))
    agent = Agent(cfg, bootstrap=bus.bootstrap_servers, node="n7", sources=("test_heartbeat",),
                  options={"test_heartbeat": {"beats": 3}}, tick_s=0.05)
    assert isinstance(source_factory("test_heartbeat")(agent, {"beats": 0}), Source)
    stop = threading.Event()
    t = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    t.start()
    got: list[Any] = []
    try:
        with Consumer(bus, ["kernel"], group_id=None) as c:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and len(got) < 3:
                got += [schema.decode("kernel", m.value) for m in c.poll(timeout_ms=200)]
    finally:
        stop.set()
        t.join(timeout=15)
    assert [g.message for g in got] == [f"heartbeat {i} from n7" for i in (1, 2, 3)]
    health = agent.health_report()
    assert health["sources"]["test_heartbeat"]["state"] == "ok" and health["sources"]["test_heartbeat"]["records"] == 3
