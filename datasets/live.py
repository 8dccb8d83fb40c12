"""Live mode: play scenarios in accelerated time through the real agent code.

A ``LiveCluster`` appends each scenario's raw files as simulated time passes
(``LiveWriter``) and runs one real ``faultlens.collectors.agent.Agent`` per
virtual node, following that node's kernel and NCCL logs and its StepReporter
file, asking NVML questions of ``SimulatedNvml`` and answering ``dump_stacks``
commands with the scenario's py-spy dumps. Everything therefore reaches Kafka
through the same parsers, spool and producer as on a real GPU node.

A demo is a small fleet: one scenario per fault, each its own job on its own
disjoint block of machines (named rack-style, ``n101``-``n103`` for the first job's
rack, ``n201``... for the next), with a machine or more left spare. Jobs overlap in
time (see ``demo_segments``); a job's fault comes one segment after the previous
job's, and a job ends within a segment of its fault (the runner has stopped it by
then), so each incident names a machine of its own job and a node never runs two.
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
from faultlens.datasets.scenario import FaultSpec, Scenario, ScenarioSpec
from faultlens.datasets.scenario_files import LiveWriter
from faultlens.errors import UsageError
from faultlens.schema import JobTopology, StackDump
from faultlens.stream.bus import Producer

log = logging.getLogger(__name__)

# The faults `faultlens demo` injects, in order: (fault kind, node index, gpu).
DEMO_FAULTS: tuple[tuple[str, int, int | None], ...] = (
    ("gpu_lost", 3, 2),
    ("thermal_throttle", 7, 5),
    ("hang_stuck_rank", 11, 3),
    ("user_exception", 0, None),
    ("ib_flap_transient", 5, None),
)


def demo_fleet(nodes: int, jobs: int) -> tuple[int, int]:
    """(machines per job, spare machines) for a fleet of ``nodes`` running ``jobs`` jobs.

    One machine stays spare when the fleet allows (a real fleet keeps some for
    replacements); every job gets the same share, at least one machine.
    """
    jobs = max(1, jobs)
    if nodes < jobs:
        raise UsageError(f"--nodes {nodes}: the fleet runs {jobs} jobs, one fault each, on machines of their own; "
                         f"give at least --nodes {jobs}")
    per_job = max(1, (nodes - 1) // jobs)
    return per_job, nodes - per_job * jobs


def demo_segments(nodes: int = 16, *, segment_s: float = 300.0, onset_s: float = 90.0, seed: int = 7,
                  start_ts: float | None = None, faults: Iterable[tuple[str, int, int | None]] = DEMO_FAULTS,
                  job_prefix: str = "llm-pretrain") -> list[Scenario]:
    """One job per fault on disjoint machines, overlapping in time.

    Job ``i`` (from 0) gets its fault at ``i * segment_s + onset_s`` after ``start_ts`` and
    ends at ``(i + 1) * segment_s``; it starts one segment before the previous job's end
    (``(i - 1) * segment_s``, the first two at once), so two or three jobs run at any time
    and none runs long healthy stretches for nothing. The fault's node index is taken
    within the job's own machines.
    """
    start = time.time() if start_ts is None else start_ts
    faults = tuple(faults)
    per_job, _ = demo_fleet(nodes, len(faults))
    out = []
    for i, (kind, node_idx, gpu) in enumerate(faults):
        # Rack-style names keep each job's machines apart: job 1 on n101.., job 2 on n201..
        cluster = ClusterSpec.for_nodes(per_job, 8, job=f"{job_prefix}-{i + 1}", node_fmt=f"n{i + 1}{{:02d}}")
        node = cluster.node_names[node_idx % per_job]
        begin = max(0, i - 1) * segment_s
        spec = ScenarioSpec(
            name=f"demo-{i + 1}-{kind}", seed=seed + i, cluster=cluster, duration_s=(i + 1) * segment_s - begin,
            start_ts=start + begin, kernel_format="iso", startup_s=10.0,
            faults=(FaultSpec(kind=kind, id=f"f{i + 1}", onset_s=i * segment_s + onset_s - begin, node=node,
                              gpu=gpu),),
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
            # The send limiter holds periodic telemetry this long in real time; scaled like NVML's
            # interval so that one job's steps do not lag another job's log lines by minutes of
            # simulated time (a false "no step progress" on a busy machine).
            min_send_interval_s=self.config.agent.min_send_interval_s / self.speed,
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
            if job != scenario.cluster.job:
                return []  # no process of that job runs here (the agent says so, as on a real node)
            _, dumps = scenario.stacks()
            ranks = [r for r in scenario.topology.ranks_on(node)]
            now = clock()
            if not dumps:
                return [StackDump(now, job, node, r, None, "", request_id, "no training process found") for r in ranks]
            return [StackDump(now, job, node, r, None, dumps[r], request_id) for r in ranks if r in dumps]

        return provide

    def run(self, scenarios: Iterable[Scenario], stop: threading.Event) -> None:
        """Play the jobs side by side (each on its own machines), each from its own start time.

        All jobs share one simulated time line: a job that starts later in simulated time
        starts that much later in real time (divided by ``speed``).
        """
        scenarios = list(scenarios)
        t0 = min((sc.start_ts for sc in scenarios), default=0.0)

        def play_later(sc: Scenario) -> None:
            if not stop.wait((sc.start_ts - t0) / self.speed):
                self.play(sc, stop)

        threads = [threading.Thread(target=play_later, args=(sc,), name=f"job-{sc.cluster.job}", daemon=True)
                   for sc in scenarios]
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive() and not stop.is_set():
                t.join(timeout=0.5)
            t.join(timeout=15)
