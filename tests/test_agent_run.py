"""The agent end to end on the real embedded broker: kernel Xid lines, dump_stacks, NVML (none here; simulated)."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from faultlens import schema
from faultlens.collectors.agent import Agent
from faultlens.collectors.nvml import PynvmlBackend
from faultlens.collectors.nvml_backend import NvmlBackend
from faultlens.config import AgentConfig, BusConfig, Config
from faultlens.errors import NoData
from faultlens.schema import Command, StackDump
from faultlens.stream.bus import Consumer, Producer, ensure_topics
from tests.runner_standins import keys_config, signing_keyring


def _config(bus: BusConfig, tmp_path: Path, **agent: Any) -> Config:
    return Config(bus=bus, agent=AgentConfig(spool_dir=str(tmp_path / "spool"), health_interval_s=1.0, **agent),
                  keys=keys_config(tmp_path))  # commands are carried out only when signed


def _collect(bus: BusConfig, kind: str, done: Callable[[list[Any]], bool], timeout_s: float = 30) -> list[Any]:
    out: list[Any] = []
    with Consumer(bus, [kind], group_id=None) as c:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not done(out):
            out += [schema.decode(kind, m.value) for m in c.poll(timeout_ms=200)]
    return out


def _wait(cond: Callable[[], bool], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _real_xid_lines(real_logs: Path) -> list[str]:
    lines = []
    for raw in (real_logs / "kernel.jsonl").read_text().splitlines():
        for ln in json.loads(raw)["text"].split("\n"):
            if "NVRM: Xid (PCI:" in ln and ln[:1] != " ":
                lines.append(ln)
    return lines


def test_agent_without_gpu_ships_kernel_xids_and_answers_dump_stacks(
        bus: BusConfig, tmp_path: Path, real_logs: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="faultlens")
    ensure_topics(bus)
    backend = PynvmlBackend()
    assert isinstance(backend, NvmlBackend)
    kern = tmp_path / "kern.log"
    kern.write_text("[   10.000000] an old line that the agent must not replay\n")
    calls: list[tuple[str, str, str]] = []

    def stacks(job: str, node: str, request_id: str) -> list[StackDump]:
        calls.append((job, node, request_id))
        return [StackDump(time.time(), job, node, r, 1000 + r, f"Thread 0x1 (active): \"MainThread\"\n    step (train.py:{r})\n",
                          request_id) for r in range(2)]

    agent = Agent(_config(bus, tmp_path), bootstrap=bus.bootstrap_servers, node="gpu-n1", nvml_backend=backend,
                  kernel_source=str(kern), sources=("nvml", "kernel", "stacks"), stacks_provider=stacks, tick_s=0.1)
    stop = threading.Event()
    th = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    th.start()
    try:
        _wait(lambda: agent.health["kernel"].state == "ok" and agent.health["stacks"].state == "ok")
        xids = _real_xid_lines(real_logs)
        assert len(xids) >= 5
        with open(kern, "a") as f:
            f.write("\n".join(xids) + "\n")
            f.write("\x00\xff not a kernel line at all\n")
        with Producer(bus) as forger:  # anyone with write access to the topic, without the key
            forger.send(Command("c0-forged", time.time(), "dump_stacks", "job-7", ["gpu-n1"]))
        with Producer(bus, keyring=signing_keyring()) as p:
            p.send(Command("c1", time.time(), "dump_stacks", "job-7", ["gpu-n1"]))
            p.send(Command("c2", time.time(), "dump_stacks", "job-7", ["another-node"]))
        events = _collect(bus, "kernel", lambda got: any("not a kernel line" in e.raw for e in got))
        dumps = _collect(bus, "stacks", lambda got: len(got) >= 2)
        _wait(lambda: agent.health["kernel"].lines >= len(xids) + 1)
        assert not agent.healthy  # nvml was asked for and is blind here
    finally:
        stop.set()
        th.join(timeout=30)
    with_xid = [e for e in events if e.xid is not None]
    assert [e.raw for e in with_xid] == xids  # every real Xid line, in order, parsed
    assert all(e.kind == "xid" and e.node == "gpu-n1" and e.pci_bus for e in with_xid)
    assert not any("old line" in e.raw for e in events)
    assert any("not a kernel line" in e.raw and e.kind == "other" for e in events)  # kept, not dropped
    assert calls == [("job-7", "gpu-n1", "c1")]  # the unsigned c0-forged was refused
    assert sorted(d.rank for d in dumps) == [0, 1] and all(d.request_id == "c1" and d.job == "job-7" for d in dumps)
    assert agent.health["nvml"].state == "no_data"
    with pytest.raises(NoData):
        PynvmlBackend().open()
    said = [r for r in caplog.records if "nvml: no data" in r.getMessage()]
    assert len(said) == 1, "no GPU is said once"
    assert any("NOT healthy" in r.getMessage() for r in caplog.records)
    assert not any("holds a signing key" in r.getMessage() for r in caplog.records)  # given the .pub only


class EightGpus:
    """A small fake NVML backend (the simulator's backend is used in the next test)."""

    def __init__(self) -> None:
        self.reads = 0

    def open(self) -> None:
        pass

    def device_count(self) -> int:
        return 8

    def read(self) -> list[schema.GpuState]:
        self.reads += 1
        return [schema.GpuState(index=i, pci_bus=f"0000:{0x19 + i:02x}:00.0", util=90.0, temp_c=60.0 + i) for i in range(8)]

    def wait_events(self, timeout_s: float) -> list[Any]:
        time.sleep(min(timeout_s, 0.2))
        return []

    def close(self) -> None:
        pass


def test_agent_samples_simulated_nvml_with_gpu_lost(bus: BusConfig, tmp_path: Path) -> None:
    sim = pytest.importorskip("faultlens.datasets.nvml_sim")
    from faultlens.datasets.cluster import ClusterSpec
    from faultlens.datasets.scenario import FaultSpec, Scenario, ScenarioSpec

    spec = ScenarioSpec(name="gpu_lost", seed=3, cluster=ClusterSpec(nodes=2, tp=4, pp=2, dp=2, microbatches=4, job="jt"),
                        duration_s=300, faults=(FaultSpec(kind="gpu_lost", id="f1", node="n002", gpu=3, onset_s=100),))
    sc = Scenario(spec)
    now = [sc.start_ts + 99.5]
    backend = sim.SimulatedNvml(sc, "n002", clock=lambda: now[0])
    assert isinstance(backend, NvmlBackend) and isinstance(EightGpus(), NvmlBackend)
    ensure_topics(bus)
    cfg = _config(bus, tmp_path, nvml_interval_s=0.2, job="jt")
    agent = Agent(cfg, bootstrap=bus.bootstrap_servers, node="n002", nvml_backend=backend, sources=("nvml",), tick_s=0.05)
    stop = threading.Event()
    th = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    th.start()
    try:
        _wait(lambda: agent.health["nvml"].records >= 2)
        now[0] = sc.start_ts + 130  # the GPU falls off the bus
        samples = _collect(bus, "gpu", lambda got: any(g.lost for s in got for g in s.gpus))
        kernel = _collect(bus, "kernel", lambda got: any(e.xid == 79 for e in got))
        assert agent.healthy
    finally:
        stop.set()
        th.join(timeout=30)
    assert all(len(s.gpus) == 8 and s.node == "n002" and s.job == "jt" for s in samples)
    lost = [g for s in samples for g in s.gpus if g.lost]
    assert lost and {g.index for g in lost} == {3}
    x79 = next(e for e in kernel if e.xid == 79)
    assert x79.fields["via"] == "nvml_event" and x79.gpu == 3
