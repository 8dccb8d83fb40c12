"""Live mode: play scenarios in accelerated time through the real agent code.

A ``LiveCluster`` appends each scenario's raw files as simulated time passes
(``LiveWriter``) and runs one real ``faultlens.collectors.agent.Agent`` per
virtual node, following that node's kernel and NCCL logs and its StepReporter
file, asking NVML questions of ``SimulatedNvml`` and answering ``dump_stacks``
commands with the scenario's py-spy dumps. Everything therefore reaches Kafka
through the same parsers, spool and producer as on a real GPU node.

A demo is a sequence of *segments*: one scenario each (one job attempt), played
back to back so that a fault that stops the job does not hide the next one.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from faultlens.collectors.agent import Agent
from faultlens.config import Config
from faultlens.datasets.cluster import ClusterSpec
from faultlens.datasets.nvml_sim import SimClock, SimulatedNvml
from faultlens.datasets.scenario import FaultSpec, LiveWriter, Scenario, ScenarioSpec
from faultlens.stream.bus import Producer
from faultlens.stream.schema import JobTopology, StackDump

log = logging.getLogger(__name__)

# The faults `faultlens demo` injects, in order: (fault kind, node index, gpu).
DEMO_FAULTS: tuple[tuple[str, int, int | None], ...] = (
    ("gpu_lost", 3, 2),
    ("thermal_throttle", 7, 5),
    ("hang_stuck_rank", 11, 3),
    ("user_exception", 0, None),
    ("ib_flap_transient", 5, None),
)


def demo_segments(nodes: int = 16, *, segment_s: float = 300.0, onset_s: float = 90.0, seed: int = 7,
                  start_ts: float | None = None, faults: Iterable[tuple[str, int, int | None]] = DEMO_FAULTS,
                  job_prefix: str = "llm-pretrain") -> list[Scenario]:
    """One scenario per fault, back to back in simulated time, each its own job attempt."""
    start = time.time() if start_ts is None else start_ts
    out = []
    for i, (kind, node_idx, gpu) in enumerate(faults):
        cluster = ClusterSpec.for_nodes(nodes, 8, job=f"{job_prefix}-a{i + 1}")
        node = cluster.node_names[node_idx % nodes]
        spec = ScenarioSpec(
            name=f"demo-{i + 1}-{kind}", seed=seed + i, cluster=cluster, duration_s=segment_s,
            start_ts=start + i * segment_s, kernel_format="iso", startup_s=10.0,
            faults=(FaultSpec(kind=kind, id=f"f{i + 1}", onset_s=onset_s, node=node, gpu=gpu),),
        )
        out.append(Scenario(spec))
    return out


class LiveCluster:
    """Runs virtual nodes' agents against a scenario played at ``speed`` x real time."""

    def __init__(self, config: Config, *, bootstrap: str | None, workdir: str | Path, speed: float = 20.0,
                 on_segment: Callable[[Scenario], None] | None = None):
        self.config = config
        self.bootstrap = bootstrap
        self.workdir = Path(workdir)
        self.speed = speed
        self.on_segment = on_segment

    def _agent_config(self, node: str, job: str) -> Config:
        agent = dataclasses.replace(
            self.config.agent, node=node, job=job, spool_dir=str(self.workdir / "spool" / node),
            nvml_interval_s=max(0.05, self.config.agent.nvml_interval_s / self.speed),
            health_interval_s=3600.0,
        )
        return dataclasses.replace(self.config, agent=agent)

    def play(self, scenario: Scenario, stop: threading.Event) -> bool:
        """Play one scenario to its end (or until ``stop``); True when it ran to the end."""
        seg_dir = self.workdir / scenario.spec.name
        clock = SimClock(scenario.start_ts, self.speed)
        writer = LiveWriter(scenario, seg_dir)
        job = scenario.cluster.job
        with Producer(self.config.bus, self.bootstrap) as producer:
            jd = scenario.job_dict()
            producer.send(JobTopology(ts=scenario.start_ts, job=job, tp=jd["tp"], pp=jd["pp"], dp=jd["dp"],
                                      cp=jd.get("cp", 1), order=jd.get("order", "tp-cp-dp-pp"), ranks=jd["ranks"],
                                      num_layers=jd.get("num_layers"), micro_batches=jd.get("micro_batches")))
            producer.flush(10)
        if self.on_segment:
            self.on_segment(scenario)
        seg_stop = threading.Event()
        agents, threads = [], []
        for node in scenario.cluster.node_names:
            agent = Agent(
                self._agent_config(node, job), bootstrap=self.bootstrap, node=node,
                nvml_backend=SimulatedNvml(scenario, node, clock),
                kernel_source=str(seg_dir / "nodes" / node / "kernel.log"),
                nccl_glob=str(seg_dir / "nodes" / node / "nccl" / "*.log"),
                steps_glob=str(seg_dir / "steps" / f"{node}.jsonl"),
                stacks_provider=self._stacks_provider(scenario, clock),
                sources=("nvml", "kernel", "nccl", "steps", "stacks"),
                from_end=False, clock=clock,
            )
            agents.append(agent)
            t = threading.Thread(target=agent.run, args=(seg_stop,), name=f"agent-{node}", daemon=True)
            t.start()
            threads.append(t)
        try:
            while not stop.is_set() and not writer.finished:
                writer.advance(clock())
                stop.wait(0.1)
            if not stop.is_set():
                stop.wait(2.0)  # let the agents ship the tail
        finally:
            seg_stop.set()
            for t in threads:
                t.join(timeout=10)
        return not stop.is_set()

    @staticmethod
    def _stacks_provider(scenario: Scenario, clock: Callable[[], float]):  # noqa: ANN205
        """Answer dump_stacks with the scenario's py-spy dumps of the node's ranks."""

        def provide(job: str, node: str, request_id: str) -> list[StackDump]:
            _, dumps = scenario.stacks()
            ranks = [r for r in scenario.topology.ranks_on(node)]
            now = clock()
            if not dumps:
                return [StackDump(now, job, node, r, None, "", request_id, "no training process found") for r in ranks]
            return [StackDump(now, job, node, r, None, dumps[r], request_id) for r in ranks if r in dumps]

        return provide

    def run(self, scenarios: Iterable[Scenario], stop: threading.Event) -> None:
        for scenario in scenarios:
            if not self.play(scenario, stop):
                return
