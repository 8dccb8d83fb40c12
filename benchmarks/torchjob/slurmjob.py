"""The real training job under a real Slurm cluster, watched by faultlens, with nobody involved.

A 4-node LocalSlurm cluster on this host (datasets/slurm_local.py: munged, slurmctld, one slurmd per
node); the services as ``faultlens demo`` starts them (embedded broker, stream processor, online
diagnosis out of dry-run) and the runner with ``--adapter slurm --execute`` (dry-run off only here)
talking to that cluster; one real ``faultlens agent`` per Slurm node, named as Slurm names it
(node1..node4), following that node's kernel log and the files its ranks write. The job is
``sbatch --requeue -N 3``: ``srun --ntasks-per-node=1`` runs benchmarks/torchjob/slurm_task.py on
each node, which becomes the node's torchrun (train.py, DDP over gloo, checkpoints every N steps,
each attempt resuming from the last one). The agents are node daemons started beside slurmd, not
by the job, as on a real cluster (there: systemd); no PID namespaces (realjob.py's cluster.py has
them for py-spy; a lost machine needs none).

A lost machine (``lose_machine``): an Xid 79 line appended to that node's kernel log (standing for
the hardware a real kernel reports), the node marked broken (its next tasks fail at start, see
slurm_task.py) and one of its ranks SIGKILLed. What faultlens then does is Slurm's to see:
``sinfo -R`` shows the node drained with the incident id, the job is requeued and trains again on
the three healthy nodes.

Other policies, for benchmarks/realjob.py --slurm: ``restart-only`` requeues a failed job on the
same nodes (the bad one kept), ``none`` leaves it failed; in both a person comes after
``human_delay_s``, drains the broken node and requeues the job (``Person``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.torchjob.cluster import newest_step

REPO = Path(__file__).resolve().parents[2]
TASK = Path(__file__).resolve().parent / "slurm_task.py"
POLICIES = ("faultlens", "restart-only", "none")
ENDED = ("FAILED", "NODE_FAIL", "COMPLETED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL")


@dataclass
class SlurmJobCluster:
    """LocalSlurm + faultlens services + agents + the job; ``start()``, ``submit()``, ``stop()``."""

    workdir: Path
    policy: str = "faultlens"
    nodes: int = 4
    job_nodes: int = 3
    ranks_per_node: int = 1
    ckpt_every: int = 10
    train_args: tuple[str, ...] = ()
    # Online diagnosis' detectors from models/ ("none": rules only). Off by default here: the "machines" are one
    # shared host's CPUs, so a rank its neighbours starve is not a slow machine (realjob.py's cpu-contention is).
    detectors: str = "none"
    slurm: Any = None
    broker: Any = None
    sup: Any = None
    bootstrap: str = ""
    job: str = ""
    log: list[str] = field(default_factory=list)

    # ------------------------------------------------------------------ start / stop
    def start(self) -> SlurmJobCluster:
        from faultlens.datasets.slurm_local import LocalSlurm

        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r}: one of {', '.join(POLICIES)}")
        if self.workdir.exists():
            shutil.rmtree(self.workdir)
        for sub in ("ckpt", "ctl"):
            (self.workdir / sub).mkdir(parents=True)
        # An ended job stays known for an hour: a person requeues it after the on-call delay.
        self.slurm = LocalSlurm(nodes=self.nodes, cpus_per_node=max(2, 2 * self.ranks_per_node), min_job_age_s=3600)
        try:
            self.slurm.start()
            self._start_services()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_services(self) -> None:
        from faultlens.commands.demo import demo_key, service_env
        from faultlens.config import load_config
        from faultlens.stream.bus import ensure_topics
        from faultlens.stream.bus.embedded_broker import EmbeddedBroker
        from faultlens.supervise import Supervisor

        self.broker = EmbeddedBroker().start()
        self.bootstrap = self.broker.bootstrap
        ensure_topics(load_config(None).bus, self.bootstrap)
        env = service_env(self.workdir, self.bootstrap)
        env.pop("FAULTLENS_DIAGNOSIS_IDLE_CLOCK_AFTER_S")  # a real job runs on the wall clock: the default idle clock
        env.update({
            "SLURM_CONF": str(self.slurm.conf),  # the runner's scontrol/sbatch talk to this cluster
            "FAULTLENS_LAKE_FLUSH_INTERVAL_S": "5",
            "FAULTLENS_GUARD_DRY_RUN": "false" if self.policy == "faultlens" else "true",
            "FAULTLENS_RUNNER_COMMAND_TIMEOUT_S": "20",
            # A 3-node job may lose a node per fault within minutes here (an hour's faults, compressed): the
            # guard's per-job cap (min(4, max(1, 25% of 3 nodes)) = 1 an hour) would refuse the second.
            "FAULTLENS_GUARD_MAX_EVICTED_FRACTION": "1.0",
            # The node check a run_diagnostics job runs: the stand-in for `dcgmi diag -r 1` on a GPU that
            # fell off the bus is the node's broken mark (slurm_task.py); it fails while the mark is there.
            "FAULTLENS_RUNNER_DIAGNOSTICS_COMMAND": f"test ! -e {self.workdir}/nodes/{{node}}/broken",
            "FAULTLENS_RUNNER_DIAGNOSTICS_TIMEOUT_S": "60",
            "FAULTLENS_RUNNER_NODE_HEALTH_PATH": str(self.workdir / "node-health.duckdb"),
            "PYTHONPATH": str(REPO),
        })
        self.sup = Supervisor(self.workdir, env)
        self.sup.start("stream", "stream")
        self.sup.start("diagnose", "diagnose", "--detectors", self.detectors, "--set",
                       f"keys.files={demo_key(self.workdir)}")
        if self.policy == "faultlens":
            self.sup.start("runner", "runner", "--adapter", "slurm", "--execute")
        for node in self.slurm.node_names:
            d = self.node_dir(node)
            for sub in ("fr", "steps", "tr", "spool", "data"):
                (d / sub).mkdir(parents=True, exist_ok=True)
            (d / "kernel.log").touch()
            self.sup.start(
                f"agent-{node}", "agent", "--node", node, "--no-nvml", "--kernel-log", str(d / "kernel.log"),
                "--steps-glob", str(d / "steps" / "*.jsonl"),
                "--nccl-glob", str(d / "tr" / "*" / "attempt_*" / "*" / "stderr.log"),
                "--error-files-glob", str(d / "tr" / "*" / "attempt_*" / "*" / "error.json"),
                "--flight-recorder-glob", str(d / "fr" / "rank_") + "*", "--job-file", str(self.workdir / "job.json"),
                "--spool-dir", str(d / "spool"))

    def stop(self) -> None:
        try:
            if self.slurm is not None:
                self.slurm.stop()  # cancels the job and ends every process started under it
        finally:
            if self.sup is not None:
                self.sup.stop()
            if self.broker is not None:
                self.broker.stop()

    def node_dir(self, node: str) -> Path:
        return self.workdir / "nodes" / node

    # ------------------------------------------------------------------ the job
    def submit(self) -> str:
        """sbatch the training job over ``job_nodes`` nodes (requeue allowed); its Slurm job id."""
        script = self.workdir / "train.sbatch"
        args = " ".join(["--stall-s", "5", "--ckpt-every", str(self.ckpt_every), *self.train_args])
        script.write_text(f"""#!/bin/bash
# The real training job: one torchrun per node (benchmarks/torchjob/slurm_task.py), DDP over gloo.
echo "job $SLURM_JOB_ID attempt ${{SLURM_RESTART_COUNT:-0}} on $SLURM_JOB_NODELIST"
exec srun --ntasks-per-node=1 --kill-on-bad-exit=1 {sys.executable} {TASK} {self.workdir} {args}
""")
        from faultlens.datasets.slurm_local import free_ports

        env = dict(self.slurm.env, PYTHONPATH=str(REPO), FAULTLENS_RANKS_PER_NODE=str(self.ranks_per_node),
                   FAULTLENS_MASTER_PORT=str(free_ports(1)[0]))
        out = self.slurm.run(["sbatch", "--parsable", "--requeue", "-N", str(self.job_nodes), "--ntasks-per-node=1",
                              f"--cpus-per-task={self.ranks_per_node}", "--job-name=train",
                              f"--output={self.workdir / 'slurm-%j.out'}", "--open-mode=append", str(script)],
                             env=env).stdout
        self.job = out.strip().split(";")[0]
        return self.job

    def job_fields(self) -> dict[str, str]:
        return self.slurm.job(self.job) if self.job else {}

    def running_nodes(self) -> list[str]:
        from faultlens.diagnosis.runner.adapter_slurm import expand_nodes

        f = self.job_fields()
        return expand_nodes(f.get("NodeList", "")) if f.get("JobState") == "RUNNING" else []

    def last_step(self, since: float = 0.0) -> tuple[int, float] | None:
        """The highest step any rank of the job recorded after ``since`` (unix s) and when."""
        return newest_step((self.node_dir(n) / "steps" for n in self.slurm.node_names), self.job, since)

    def step_records(self) -> list[dict[str, Any]]:
        """Every step record of rank 0 (all attempts), in file order."""
        out = []
        for node in self.slurm.node_names:
            for f in (self.node_dir(node) / "steps").glob(f"steps-{self.job}-0.jsonl"):
                for line in f.read_bytes().splitlines():
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        continue
        return sorted(out, key=lambda r: r.get("ts", 0))

    def wait_training(self, *, since: float, min_step: int = 0, timeout_s: float = 120.0) -> tuple[int, float] | None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            got = self.last_step(since=since)
            if got and got[0] >= min_step:
                return got
            time.sleep(0.5)
        return None

    # ------------------------------------------------------------------ the fault
    def rank_pids(self, node: str) -> list[int]:
        """Host pids of the training ranks (torchrun's workers) running on ``node``."""
        out = []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            raw = _read(f"/proc/{name}/environ")
            # This cluster's ranks only: another cluster on the host has its own node1..node4 (its steps dir differs).
            if f"FAULTLENS_STEPS_DIR={self.node_dir(node) / 'steps'}\0".encode() not in raw or b"\0RANK=" not in raw:
                continue
            parent = _ppid(int(name))
            if parent is not None and b"torch.distributed.run" in _read(f"/proc/{parent}/cmdline"):
                out.append(int(name))
        return out

    def lose_machine(self, node: str) -> str:
        """Xid 79 in the node's kernel log, the node marked broken, a rank there SIGKILLed."""
        pids = self.rank_pids(node)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f",{int(time.time() % 1 * 1e6):06d}+00:00"
        pid = pids[0] if pids else 0
        with open(self.node_dir(node) / "kernel.log", "a") as f:  # the hardware's word
            f.write(f"{stamp} {node} kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid={pid}, "
                    "GPU has fallen off the bus.\n")
        (self.node_dir(node) / "broken").write_text(f"{time.time():.3f} Xid 79\n")
        if pid:
            os.kill(pid, signal.SIGKILL)
        return f"Xid 79 in {node}'s kernel log + SIGKILL rank pid {pid or '(none running)'}"

    def repair(self, node: str, by: str = "a person") -> None:
        """The machine is fixed: its broken mark goes, and it takes work again."""
        (self.node_dir(node) / "broken").unlink(missing_ok=True)
        self.slurm.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], check=False)
        self.log.append(f"{time.time():.1f} {by} repaired {node}")

    def drained(self) -> dict[str, str]:
        """{node: reason} of the drained nodes, as ``scontrol show node`` says; RuntimeError when Slurm does not
        answer (on a loaded host a client may time out: never read as "nothing drained")."""
        from faultlens.diagnosis.runner.adapter_slurm import is_drained, parse_show, reason_text

        out = self.slurm.run(["scontrol", "show", "node", "-o"]).stdout
        return {f["NodeName"]: reason_text(f) for f in parse_show(out) if "NodeName" in f and is_drained(f)}

    def broken(self) -> list[str]:
        return [n for n in self.slurm.node_names if (self.node_dir(n) / "broken").exists()]


@dataclass
class Person:
    """What happens without faultlens, and the repairs that follow a drain under every policy.

    ``restart-only``: a job that ended failed is requeued on the same nodes at once (the bad one
    kept). ``none``: it stays failed. A person comes ``human_delay_s`` after a machine broke: drains
    it (if nobody did), requeues a job that is not running, and repairs the machine ``repair_s``
    later (the broken mark goes, the node resumes).
    """

    cluster: SlurmJobCluster
    human_delay_s: float
    repair_s: float
    broke_at: dict[str, float] = field(default_factory=dict)
    handled: set[str] = field(default_factory=set)
    restarts: int = 0

    def broke(self, node: str) -> None:
        self.broke_at[node] = time.time()
        self.handled.discard(node)

    def tick(self) -> None:
        try:
            self._tick()
        except (RuntimeError, subprocess.TimeoutExpired) as exc:  # Slurm did not answer: next tick
            self.cluster.log.append(f"{time.time():.1f} person: {exc}"[:200])

    def _tick(self) -> None:
        c, now = self.cluster, time.time()
        f = c.job_fields()
        state = f.get("JobState", "")
        if c.policy == "restart-only" and state in ENDED and state != "COMPLETED":
            from faultlens.diagnosis.runner.adapter_slurm import expand_nodes

            drained = c.drained()  # pinned to its nodes, but never to one a person has taken out
            kept = [n for n in expand_nodes(f.get("NodeList", "")) if n not in drained]
            nodes = ",".join(kept) if len(kept) == c.job_nodes else ""
            for argv in (["scontrol", "requeuehold", c.job], ["scontrol", "update", f"JobId={c.job}",
                                                              f"ReqNodeList={nodes}"], ["scontrol", "release", c.job]):
                c.slurm.run(argv, check=False)
            self.restarts += 1
            c.log.append(f"{now:.1f} restart-only: requeued {c.job} on {nodes} ({state})")
        for node, at in list(self.broke_at.items()):
            if node not in self.handled and now >= at + self.human_delay_s:
                self.handled.add(node)
                drained_by = c.drained().get(node)
                if drained_by is None:
                    c.slurm.run(["scontrol", "update", f"NodeName={node}", "State=DRAIN",
                                 "Reason=on-call: GPU fell off the bus"], check=False)
                f = c.job_fields()
                if f.get("JobState") != "RUNNING":  # the job goes again without the machine
                    for argv in (["scontrol", "requeuehold", c.job], ["scontrol", "update", f"JobId={c.job}",
                                                                     "ReqNodeList="], ["scontrol", "release", c.job]):
                        c.slurm.run(argv, check=False)
                c.log.append(f"{now:.1f} a person came for {node} ("
                             + (f"drained already: {drained_by}" if drained_by is not None else "drained it")
                             + (f"; requeued {c.job}, was {f.get('JobState')})" if f.get("JobState") != "RUNNING"
                                else f"; job {c.job} running)"))
            if node in self.handled and now >= at + self.human_delay_s + self.repair_s:
                c.repair(node)
                del self.broke_at[node]


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _ppid(pid: int) -> int | None:
    stat = _read(f"/proc/{pid}/stat")
    try:
        return int(stat[stat.rindex(b")") + 2:].split()[1])
    except (ValueError, IndexError):
        return None
