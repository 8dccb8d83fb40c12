"""A real Slurm cluster on this one host: munged, slurmctld and one slurmd per virtual node.

The runner's Slurm adapter is tested, and the real training job benchmarked, against
Debian's own daemons (slurmctld, slurmd, munge; 22.05), not stand-ins. Everything
belongs to the cluster's directory: its own munge key and socket, ``slurm.conf``,
state, spools, logs, and free loopback ports, so it never touches /etc/slurm, a
system munged or another cluster on the same host. ``NodeName=node<i>
NodeHostname=localhost Port=<free>`` and ``slurmd -N node<i>`` give each virtual
node its own daemon. Timeouts are short (a requeued job runs again within
seconds) and nothing needs systemd or cgroups (``proctrack/linuxproc``,
``task/none``). Root is needed: slurmd starts jobs as their user.

    with LocalSlurm(nodes=4) as cluster:
        cluster.sbatch(["--requeue", "-N", "3", "--wrap", "while :; do sleep 1; done"])
        cluster.wait_job_state(job, "RUNNING")

Clients (sinfo, scontrol, sbatch) find this cluster through ``SLURM_CONF`` in
``cluster.env``; pass that environment to anything that should talk to it (the
runner: ``ActionRunner(config, env=cluster.env)``, or ``faultlens runner`` started
with it). A multi-node job runs as on a real cluster: inside ``sbatch -N 3``,
``srun --ntasks-per-node=1`` starts one task per virtual node with
``SLURMD_NODENAME`` (node2), ``SLURM_NODEID`` and ``SLURM_JOB_NODELIST`` set, so a
per-node ``torchrun --node_rank=$SLURM_NODEID`` and an agent named ``$SLURMD_NODENAME``
fit; every node is this host, so rendezvous on 127.0.0.1 and a shared checkpoint
directory just work. Two clusters can run side by side (their own ports and
directories). A requeued job may start again after 5 s (``cred_expire``; Slurm's
default is 120 s).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sinfo", "scontrol", "sbatch", "squeue", "scancel")
INSTALL_HINT = "apt-get install slurmctld slurmd slurm-client munge"
START_TIMEOUT_S = 60.0


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here (not installed, not root): the message says what to do."""


def missing_programs() -> list[str]:
    """The daemons and clients this module needs that are not on PATH (or in /usr/sbin)."""
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return [p for p in DAEMONS + CLIENTS if shutil.which(p, path=search) is None]


def unavailable_reason() -> str | None:
    """Why a local cluster cannot start here, or None when it can."""
    missing = missing_programs()
    if missing:
        return f"Slurm is not installed (missing {', '.join(missing)}): run '{INSTALL_HINT}' as root"
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root (slurmd starts jobs as their user)"
    return None


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on the loopback (bound together, then released)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _become_subreaper() -> None:
    """Orphans of this process's descendants come back to it, not to PID 1: slurmd's detached
    slurmstepd processes, once ended, are reaped by ``stop`` instead of staying zombies where PID 1
    reaps nothing (a container)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):  # not Linux: zombies, if any, are the init's to reap
        pass


def _reap_orphans(ours: set[int]) -> None:
    """Reap ended children that were orphans of the cluster's daemons: slurmstepd, and ``ours`` (the
    cluster's processes ``stop`` ended). One pid at a time, never ``waitpid(-1)``: a
    ``subprocess.Popen`` of someone else in this process keeps its own exit status."""
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if rest[0] == "Z" and int(rest[1]) == me and (comm == "slurmstepd" or int(entry.name) in ours):
            try:
                os.waitpid(int(entry.name), os.WNOHANG)
            except ChildProcessError:
                pass


def _program(name: str) -> str:
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    path = shutil.which(name, path=search)
    if path is None:
        raise SlurmUnavailable(f"{name} not found: run '{INSTALL_HINT}' as root")
    return path


class LocalSlurm:
    """A Slurm cluster of ``nodes`` virtual nodes (node1..nodeN) on localhost; see the module docstring."""

    def __init__(self, nodes: int = 4, *, directory: str | Path | None = None, cpus_per_node: int = 2,
                 partition: str = "debug", min_job_age_s: int = 30):
        reason = unavailable_reason()
        if reason:
            raise SlurmUnavailable(reason)
        self.node_names = [f"node{i}" for i in range(1, nodes + 1)]
        self.cpus_per_node = cpus_per_node
        self.partition = partition
        self.min_job_age_s = min_job_age_s  # how long Slurm remembers an ended job (a person may requeue it)
        self._own_dir = directory is None
        # Short: the munge socket path must fit a sockaddr_un (108 bytes).
        self.dir = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="fl-slurm-"))
        self.conf = self.dir / "slurm.conf"
        self.munge_socket = self.dir / "munge" / "munge.sock"
        self.ctld_port, *self.node_ports = free_ports(1 + nodes)
        self.env: dict[str, str] = dict(os.environ, SLURM_CONF=str(self.conf))
        for var in [k for k in self.env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SQUEUE_"))]:
            if var != "SLURM_CONF":  # a caller inside a Slurm job must not steer this cluster's clients
                del self.env[var]
        self._munged: subprocess.Popen[bytes] | None = None
        self._ctld: subprocess.Popen[bytes] | None = None
        self._slurmd: dict[str, subprocess.Popen[bytes]] = {}
        self.startup_s = 0.0

    # ---------------------------------------------------------------- files

    def _write_files(self) -> None:
        for sub in ("munge", "state", "spool", "log", "run", "jobs"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o755)  # munged refuses group/world-writable parents of its socket and key
        os.chmod(self.dir / "munge", 0o700)
        key = self.dir / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        host = socket.gethostname().split(".")[0]
        nodes = "\n".join(
            f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs={self.cpus_per_node} "
            f"RealMemory=1000 State=UNKNOWN"
            for n, p in zip(self.node_names, self.node_ports, strict=True))
        d = self.dir
        self.conf.write_text(f"""# faultlens LocalSlurm: a throwaway cluster on one host (datasets/slurm_local.py)
ClusterName=faultlens
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={self.ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: how long a requeued job waits before it may start again (Slurm's default: 120 s)
AuthInfo=socket={self.munge_socket},cred_expire=5
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdTimeout=10
SlurmctldTimeout=10
MessageTimeout=5
TCPTimeout=2
InactiveLimit=0
KillWait=1
MinJobAge={self.min_job_age_s}
BatchStartTimeout=5
UnkillableStepTimeout=5
SchedulerType=sched/backfill
SchedulerParameters=sched_min_interval=100000,bf_interval=1
JobRequeue=0
{nodes}
PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
""")

    # ---------------------------------------------------------------- processes

    def _spawn(self, argv: Sequence[str], log_name: str) -> subprocess.Popen[bytes]:
        out = (self.dir / "log" / log_name).open("ab")
        try:
            # Its own session: the caller's terminal signals do not reach it, and stop() ends it by pid.
            return subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, env=self.env,  # noqa: S603
                                    start_new_session=True, cwd=self.dir)
        finally:
            out.close()

    def start(self) -> LocalSlurm:
        """Start munged, slurmctld and every slurmd; return when ``sinfo`` shows every node idle."""
        t0 = time.monotonic()
        _become_subreaper()
        self._write_files()
        try:
            self._munged = self._spawn(
                [_program("munged"), "-F", "--force", f"--socket={self.munge_socket}",
                 f"--key-file={self.dir / 'munge' / 'munge.key'}", f"--pid-file={self.dir / 'run' / 'munged.pid'}",
                 f"--log-file={self.dir / 'log' / 'munged.log'}", f"--seed-file={self.dir / 'munge' / 'seed'}"],
                "munged.out")
            self._wait(lambda: self.munge_socket.exists(), "munged's socket", self._munged)
            self.start_controller(clear_state=True)
            for node in self.node_names:
                self.start_node(node)
            self.wait_nodes_idle(self.node_names)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def start_controller(self, *, clear_state: bool = False) -> None:
        """(Re)start slurmctld; ``clear_state``: forget every job and node state (the first start)."""
        argv = [_program("slurmctld"), "-D", "-f", str(self.conf)] + (["-c"] if clear_state else ["-R"])
        self._ctld = self._spawn(argv, "slurmctld.out")
        self._wait(self.controller_answers, "slurmctld to answer", self._ctld)

    def stop_controller(self) -> None:
        """Stop slurmctld only (the daemons and jobs on the nodes go on), as a controller crash does."""
        self._end(self._ctld)
        self._ctld = None

    def start_node(self, node: str) -> None:
        self._slurmd[node] = self._spawn([_program("slurmd"), "-D", "-N", node, "-f", str(self.conf)],
                                         f"slurmd-{node}.out")

    def stop_node(self, node: str) -> None:
        """Stop one slurmd, as a machine that dies does: Slurm marks it DOWN after SlurmdTimeout (10 s)."""
        self._end(self._slurmd.pop(node, None))

    def controller_answers(self) -> bool:
        return self.run(["scontrol", "ping"], check=False).stdout.count("UP") > 0

    def _wait(self, ready: Callable[[], bool], what: str, proc: subprocess.Popen[bytes] | None,
              timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        delay = 0.02
        while True:
            if ready():
                return
            if proc is not None and proc.poll() is not None:
                program = os.path.basename(str(proc.args[0] if isinstance(proc.args, list) else proc.args))
                raise RuntimeError(f"waiting for {what}: {program} exited {proc.returncode}; "
                                   f"logs in {self.dir / 'log'}: {self._log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} after {timeout_s:g} s; logs in {self.dir / 'log'}: {self._log_tail()}")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def _log_tail(self) -> str:
        tails = []
        for f in sorted((self.dir / "log").glob("*")):
            lines = f.read_text(errors="replace").strip().splitlines()[-3:]
            if lines:
                tails.append(f"{f.name}: " + " | ".join(lines))
        return "; ".join(tails)[-3000:]

    @staticmethod
    def _end(proc: subprocess.Popen[bytes] | None, timeout_s: float = 10.0) -> None:
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)

    def job_pids(self) -> list[int]:
        """Processes of this cluster still alive: anything started with its ``SLURM_CONF`` (its daemons,
        their job steps and scripts, which inherit it), never this process or its ancestors."""
        mark = f"SLURM_CONF={self.conf}\0".encode()
        keep = {os.getpid()}
        pid = os.getppid()
        while pid > 1 and pid not in keep:
            keep.add(pid)
            try:
                pid = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                break
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in keep:
                continue
            try:
                if mark in (entry / "environ").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
        return pids

    def stop(self) -> None:
        """Cancel every job, stop every daemon, then end anything left of this cluster (by pid)."""
        if self._ctld is not None and self._ctld.poll() is None:
            self.run(["scancel", "--quiet", "-u", "root"], check=False, timeout_s=5)
        for proc in self._slurmd.values():
            self._end(proc)
        self._slurmd.clear()
        self._end(self._ctld)
        self._ctld = None
        self._end(self._munged)
        self._munged = None
        left = self.job_pids()
        for pid in left:  # job scripts a stopped slurmd left behind (linuxproc tracks, not owns)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05 if left else 0)
        _reap_orphans(set(left))
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalSlurm:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # ---------------------------------------------------------------- clients

    def run(self, argv: Sequence[str], *, check: bool = True, timeout_s: float = 20.0,
            env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client against this cluster (argv, no shell)."""
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s,  # noqa: S603
                              env=dict(env) if env is not None else self.env, check=False)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def sbatch(self, args: Sequence[str]) -> str:
        """Submit a batch job (``--parsable``); returns its job id. Output goes under the cluster's jobs/."""
        out = self.run(["sbatch", "--parsable", f"--output={self.dir / 'jobs' / 'slurm-%j.out'}", *args]).stdout
        return out.strip().split(";")[0]

    def node_states(self) -> dict[str, str]:
        """{node: state as sinfo prints it (idle, alloc, drain, drng, down*, ...)}."""
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout
        return dict(line.split(None, 1) for line in out.splitlines() if line.strip())

    def wait_nodes_idle(self, nodes: Sequence[str], timeout_s: float = START_TIMEOUT_S) -> None:
        self._wait(lambda: all(self.node_states().get(n) == "idle" for n in nodes), f"idle {', '.join(nodes)}",
                   self._ctld, timeout_s)

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o`` as {key: value} ({} when Slurm no longer knows it)."""
        proc = self.run(["scontrol", "show", "job", "-o", job_id], check=False)
        return parse_show(proc.stdout) if proc.returncode == 0 else {}

    def wait_job(self, job_id: str, ready: Callable[[dict[str, str]], bool], what: str,
                 timeout_s: float = 30.0) -> dict[str, str]:
        """Poll ``scontrol show job`` until ``ready(fields)``; returns the fields."""
        seen: dict[str, str] = {}

        def check() -> bool:
            nonlocal seen
            seen = self.job(job_id)
            return bool(ready(seen))
        try:
            self._wait(check, f"job {job_id} {what}", self._ctld, timeout_s)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; last seen: JobState={seen.get('JobState')} NodeList={seen.get('NodeList')} "
                               f"Reason={seen.get('Reason')}") from None
        return seen


_FIELD_RE = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9:/_]*)=")


def parse_show(text: str) -> dict[str, str]:
    """One record of ``scontrol show ... -o`` as {key: value}; a value may hold spaces (``Reason=a b c``)."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    marks = list(_FIELD_RE.finditer(line))
    fields = {}
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(line)
        fields[m.group(1)] = line[m.end():end].strip()
    return fields
