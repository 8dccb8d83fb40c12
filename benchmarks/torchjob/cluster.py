"""A real job on virtual nodes, watched by the real faultlens services.

Each virtual node is a PID namespace (``unshare --pid --mount-proc``) whose first process is the
real ``faultlens agent`` (its node name, its kernel-log file, its spool, its steps / error-file /
Flight Recorder globs): like a machine, the agent there sees only its node's processes when it
answers ``dump_stacks`` with py-spy. One ``torchrun`` per virtual node (``--nnodes``/``--node-rank``,
static rendezvous on localhost) is started inside that namespace (``nsenter``) and runs
benchmarks/torchjob/train.py (DDP over gloo). The embedded broker, the stream processor, online
diagnosis (guard out of dry-run) and the runner (command adapter, ``--execute``) are started as
``faultlens demo`` starts them (faultlens/commands/demo.py's ``service_env`` and ``demo_key``,
faultlens/supervise.py). The runner's hook (hook.py) writes each action it is given to
``WORKDIR/hook-actions.jsonl``; ``Cluster.apply_hook_actions`` restarts the job from its last
checkpoint without the evicted nodes (restart, rollback, stop-time diagnostics: on the same nodes).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TRAIN = Path(__file__).resolve().parent / "train.py"
HOOK = Path(__file__).resolve().parent / "hook.py"


@dataclass
class VirtualNode:
    name: str
    dir: Path
    agent_pid: int | None = None  # the agent's host pid (first process of the node's namespace)
    launcher: subprocess.Popen[bytes] | None = None

    @property
    def kernel_log(self) -> Path:
        return self.dir / "kernel.log"

    @property
    def fr_prefix(self) -> str:
        return str(self.dir / "fr" / "rank_")


@dataclass
class Cluster:
    """Services + virtual nodes + the job; ``start()``, ``start_job(nodes)``, ``stop()``."""

    workdir: Path
    nodes: int = 4
    ranks_per_node: int = 2
    hang_s: float = 20.0  # diagnosis.hang_no_progress_s: a silence this long is a hang (capped by it)
    # The ranks' stall watchdog writes its Flight Recorder dump after this, and again every stall_s: with
    # no GPU samples (CPU nodes) those dumps are the only records that move a hung job's event time on.
    stall_s: float = 5.0
    ckpt_every: int = 10
    vnodes: list[VirtualNode] = field(default_factory=list)
    job: str = ""
    attempt: int = 0
    master_port: int = 29700
    broker: Any = None
    sup: Any = None
    bootstrap: str = ""
    hook_offset: int = 0
    job_nodes: list[str] = field(default_factory=list)
    job_extra: list[str] = field(default_factory=list)

    # ------------------------------------------------------------------ services
    def start(self) -> None:
        from faultlens.commands.demo import demo_key, service_env
        from faultlens.config import load_config
        from faultlens.stream.bus import ensure_topics
        from faultlens.stream.bus.embedded_broker import EmbeddedBroker
        from faultlens.supervise import Supervisor

        if self.workdir.exists():
            shutil.rmtree(self.workdir)
        self.workdir.mkdir(parents=True)
        self.broker = EmbeddedBroker().start()
        self.bootstrap = self.broker.bootstrap
        ensure_topics(load_config(None).bus, self.bootstrap)
        env = service_env(self.workdir, self.bootstrap)
        env.pop("FAULTLENS_DIAGNOSIS_IDLE_CLOCK_AFTER_S")  # a real job runs on the wall clock: the default idle clock
        env.update({
            "FAULTLENS_LAKE_FLUSH_INTERVAL_S": "5",
            "FAULTLENS_GUARD_DRY_RUN": "false",  # the runner executes what diagnosis decides
            "FAULTLENS_DIAGNOSIS_HANG_NO_PROGRESS_S": str(self.hang_s),
            "FAULTLENS_DIAGNOSIS_HANG_DWELL_S": "3",
            "FAULTLENS_RUNNER_HOOK_COMMAND": f"{sys.executable} {HOOK} {self.workdir / 'hook-actions.jsonl'}",
            "FAULTLENS_RUNNER_COMMAND_TIMEOUT_S": "10",
            "PYTHONPATH": str(REPO),
        })
        self.sup = Supervisor(self.workdir, env)
        self.sup.start("stream", "stream")
        self.sup.start("diagnose", "diagnose", "--set", f"keys.files={demo_key(self.workdir)}")
        self.sup.start("runner", "runner", "--adapter", "command", "--execute")
        for i in range(self.nodes):
            self._start_node(f"vn{i}")

    def _start_node(self, name: str) -> None:
        d = self.workdir / "nodes" / name
        for sub in ("fr", "steps", "tr", "spool", "data"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        node = VirtualNode(name, d)
        node.kernel_log.touch()
        child = self.sup.start(
            f"agent-{name}", "agent", "--node", name, "--no-nvml", "--kernel-log", str(node.kernel_log),
            "--steps-glob", str(d / "steps" / "*.jsonl"),
            "--nccl-glob", str(d / "tr" / "*" / "attempt_*" / "*" / "stderr.log"),
            "--error-files-glob", str(d / "tr" / "*" / "attempt_*" / "*" / "error.json"),
            "--flight-recorder-glob", node.fr_prefix + "*", "--job-file", str(self.workdir / "job.json"),
            "--spool-dir", str(d / "spool"),
            wrap=("unshare", "--pid", "--fork", "--mount-proc", "--kill-child"))
        deadline = time.monotonic() + 10
        while node.agent_pid is None and time.monotonic() < deadline:
            try:
                kids = Path(f"/proc/{child.proc.pid}/task/{child.proc.pid}/children").read_text().split()
                node.agent_pid = int(kids[0]) if kids else None
            except OSError:
                pass
            time.sleep(0.05)
        if node.agent_pid is None:
            raise RuntimeError(f"virtual node {name}: the agent did not start in its namespace")
        self.vnodes.append(node)

    def node(self, name: str) -> VirtualNode:
        return next(n for n in self.vnodes if n.name == name)

    # ------------------------------------------------------------------ the job
    def start_job(self, job: str, nodes: list[str], *, extra: list[str] | None = None, fresh: bool = True) -> None:
        """torchrun on each of ``nodes`` (node rank in list order); ``fresh``: a new checkpoint directory."""
        self.job, self.job_nodes, self.job_extra = job, list(nodes), list(extra or [])
        self.attempt += 1
        self.master_port += 1
        ckpt = self.workdir / "ckpt" / job
        if fresh and ckpt.exists():
            shutil.rmtree(ckpt)
        ckpt.mkdir(parents=True, exist_ok=True)
        ctl = self.ctl_dir
        ctl.mkdir(parents=True, exist_ok=True)
        r = self.ranks_per_node
        ranks = {str(i * r + k): {"node": n, "gpu": k} for i, n in enumerate(nodes) for k in range(r)}
        tmp = self.workdir / "job.json.tmp"
        tmp.write_text(json.dumps({"job": job, "tp": 1, "pp": 1, "dp": len(ranks), "cp": 1,
                                   "order": "tp-cp-dp-pp", "ranks": ranks}))
        os.replace(tmp, self.workdir / "job.json")
        for i, name in enumerate(nodes):
            node = self.node(name)
            env = dict(os.environ, FAULTLENS_NODE=name, FAULTLENS_JOB=job, FAULTLENS_ATTEMPT=f"{job}-{self.attempt}",
                       FAULTLENS_STEPS_DIR=str(node.dir / "steps"), TORCH_NCCL_DEBUG_INFO_TEMP_FILE=node.fr_prefix,
                       TORCH_FR_BUFFER_SIZE="2000", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
                       PYTHONUNBUFFERED="1", LOGLEVEL="WARNING")
            argv = ["nsenter", "-t", str(node.agent_pid), "-p", "-m", "--",
                    sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(nodes)), "--node-rank", str(i),
                    "--nproc-per-node", str(r), "--master-addr", "127.0.0.1", "--master-port", str(self.master_port),
                    "--max-restarts", "0", "--log-dir", str(node.dir / "tr"), "--redirects", "3", "--tee", "3",
                    str(TRAIN), "--ckpt-dir", str(ckpt), "--ckpt-every", str(self.ckpt_every), "--ctl", str(ctl),
                    "--data", str(node.dir / "data"), "--stall-s", str(self.stall_s), *self.job_extra]
            out = open(node.dir / f"launcher-{self.attempt}.log", "ab")  # noqa: SIM115 - the child keeps it
            node.launcher = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                             start_new_session=True, cwd=str(REPO))
            out.close()

    @property
    def ctl_dir(self) -> Path:
        return self.workdir / "ctl" / self.job

    def stop_job(self, grace_s: float = 5.0) -> None:
        """SIGTERM every launcher, then SIGKILL what is left of this attempt (stopped ranks included)."""
        for n in self.vnodes:
            if n.launcher is not None and n.launcher.poll() is None:
                try:
                    os.killpg(n.launcher.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for n in self.vnodes:
            if n.launcher is not None:
                try:
                    n.launcher.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for pid in job_pids(f"{self.job}-{self.attempt}"):
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for n in self.vnodes:
            if n.launcher is not None:
                try:
                    os.killpg(n.launcher.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                n.launcher.wait(timeout=5)
                n.launcher = None

    def rank_pid(self, rank: int) -> int | None:
        """The host pid of the rank's main process in the current attempt."""
        for pid, env in _procs_env(f"{self.job}-{self.attempt}"):
            if env.get(b"RANK") == str(rank).encode() and b"faultlens-worker" not in env:
                parent = _ppid(pid)
                if parent is not None and b"torch.distributed.run" in _cmdline(parent):
                    return pid
        return None

    def worker_pids(self, rank: int) -> list[int]:
        """The DataLoader worker processes of the rank (children of its main process)."""
        main = self.rank_pid(rank)
        return [] if main is None else [p for p, _ in _procs_env(f"{self.job}-{self.attempt}") if _ppid(p) == main
                                        and b"python" in _cmdline(p)]

    def node_of_rank(self, rank: int) -> str:
        return self.job_nodes[rank // self.ranks_per_node]

    # ------------------------------------------------------------------ the runner's hook
    def hook_actions(self) -> list[dict[str, Any]]:
        """Actions the runner handed its command hook since the last call."""
        path = self.workdir / "hook-actions.jsonl"
        try:
            with open(path, "rb") as f:
                f.seek(self.hook_offset)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self.hook_offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                env = json.loads(line)
            except ValueError:
                continue
            out.append(env.get("data", env))
        return out

    def apply(self, action: dict[str, Any]) -> str | None:
        """Restart the job from its last checkpoint for an action that asks it; what was done, or None."""
        kind = action.get("type")
        # run_diagnostics: restart after stop-time checks, which a CPU virtual node has nothing to run
        if action.get("job") != self.job or kind not in ("evict_nodes", "restart_job", "rollback_code", "run_diagnostics"):
            return None
        evicted = [n for n in action.get("nodes") or [] if n in self.job_nodes] if kind == "evict_nodes" else []
        keep = [n for n in self.job_nodes if n not in evicted]
        self.stop_job()
        if kind == "rollback_code":  # the code or its settings were wrong: the faulty setting goes
            for f in self.ctl_dir.glob("*"):
                f.unlink()
        self.start_job(self.job, keep, extra=self.job_extra, fresh=False)
        return f"{kind}: restarted on {', '.join(keep)}" + (f" without {', '.join(evicted)}" if evicted else "")

    def last_step(self, since: float = 0.0) -> tuple[int, float] | None:
        """The highest step any rank of this job recorded after ``since`` (unix s) and when."""
        return newest_step((n.dir / "steps" for n in self.vnodes), self.job, since)

    def stop(self) -> None:
        try:
            self.stop_job()
        finally:
            if self.sup is not None:
                self.sup.stop()
            if self.broker is not None:
                self.broker.stop()


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _cmdline(pid: int) -> bytes:
    return _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ")


def _ppid(pid: int) -> int | None:
    stat = _read(f"/proc/{pid}/stat")
    try:
        return int(stat[stat.rindex(b")") + 2:].split()[1])
    except (ValueError, IndexError):
        return None


def _procs_env(attempt: str) -> list[tuple[int, dict[bytes, bytes]]]:
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        raw = _read(f"/proc/{name}/environ")
        if f"FAULTLENS_ATTEMPT={attempt}".encode() not in raw:
            continue
        out.append((int(name), dict(kv.split(b"=", 1) for kv in raw.split(b"\0") if b"=" in kv)))
    return out


def job_pids(attempt: str) -> list[int]:
    """Every process of one attempt (launchers, ranks, DataLoader workers)."""
    return [pid for pid, _ in _procs_env(attempt)]


def newest_step(step_dirs: Iterable[Path], job: str, since: float = 0.0) -> tuple[int, float] | None:
    """The highest step any rank of ``job`` recorded in these StepReporter folders after ``since``
    (unix s), and when: the last lines of each rank's file are enough."""
    best = None
    for d in step_dirs:
        for f in d.glob(f"steps-{job}-*.jsonl"):
            try:
                lines = f.read_bytes().splitlines()[-3:]
            except OSError:
                continue
            for line in lines:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("ts", 0) > since and (best is None or rec["step"] > best[0]):
                    best = (rec["step"], rec["ts"])
    return best
