"""Stack dumps: find a job's training processes and ``py-spy dump`` each of them.

Training processes are the children of a launcher (torchrun / torch.distributed.run,
deepspeed, accelerate, mpirun/srun) found by walking /proc. Each dump runs with a
timeout; a timeout, missing ptrace permission or a missing py-spy is reported in
``StackDump.error``, never hidden. A stopped process (py-spy 0.4: "Failed to suspend
process ... unexpected waitpid result", exit 1 in milliseconds; state T in /proc) is
reported as stopped: diagnosis reads that as the rank being stuck, not as a gap.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from faultlens import schema
from faultlens.collectors import flight_recorder
from faultlens.collectors.sources import register_source
from faultlens.errors import BusError, SchemaError
from faultlens.schema import StackDump
from faultlens.stream import topics
from faultlens.stream.bus import Consumer
from faultlens.stream.signing import Keyring, Unverified, verifier_warning

log = logging.getLogger(__name__)

PYSPY_THREAD_RE = re.compile(r"^Thread (?:0x[0-9A-Fa-f]+|\d+) \((?:active|idle|gil)[^)]*\)", re.M)
PYSPY_PROCESS_RE = re.compile(r"^Process \d+: ", re.M)
PYSPY_FRAME_RE = re.compile(r"^\s+\S.* \([^()]+:\d+\)$", re.M)
LAUNCHERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch", "deepspeed", "accelerate", "mpirun", "srun", "launch.py")


def looks_like_pyspy(text: str) -> bool:
    """True when the text is (part of) ``py-spy dump`` output."""
    if PYSPY_THREAD_RE.search(text) or PYSPY_PROCESS_RE.search(text):
        return True
    frames = PYSPY_FRAME_RE.findall(text)
    return len(frames) >= 3


@dataclass(frozen=True, slots=True)
class Proc:
    pid: int
    ppid: int
    cmdline: str
    rank: int | None
    job: str | None


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def process_table(proc: str = "/proc") -> dict[int, Proc]:
    """pid -> Proc for every process readable in /proc (rank/job from its environment when readable)."""
    out = {}
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        stat = _read(f"{proc}/{name}/stat")
        if not stat:
            continue
        try:
            ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        except (ValueError, IndexError):
            continue
        cmd = (_read(f"{proc}/{name}/cmdline") or b"").replace(b"\0", b" ").decode("utf-8", "replace").strip()
        env_raw = _read(f"{proc}/{name}/environ") or b""
        env = dict(kv.split(b"=", 1) for kv in env_raw.split(b"\0") if b"=" in kv)
        rank = env.get(b"RANK")
        job = env.get(b"FAULTLENS_JOB") or env.get(b"SLURM_JOB_ID") or env.get(b"TORCHELASTIC_RUN_ID")
        out[int(name)] = Proc(int(name), ppid, cmd, int(rank) if rank and rank.isdigit() else None,
                              job.decode() if job else None)
    return out


def training_processes(job: str | None = None, table: dict[int, Proc] | None = None) -> list[Proc]:
    """Python children of launcher processes (optionally only those of ``job``)."""
    table = process_table() if table is None else table
    launchers = {p.pid for p in table.values() if any(tok in p.cmdline for tok in LAUNCHERS)}
    procs = [p for p in table.values() if p.ppid in launchers and "python" in p.cmdline.split(" ")[0]]
    if job:
        procs = [p for p in procs if p.job in (None, job)]
    return sorted(procs, key=lambda p: (p.rank if p.rank is not None else 1 << 30, p.pid))


def process_state(pid: int, proc: str = "/proc") -> str | None:
    """The one-letter state of a process from /proc/<pid>/stat (R, S, D, T stopped, t traced, Z), or None."""
    stat = _read(f"{proc}/{pid}/stat")
    if not stat:
        return None
    try:
        return stat[stat.rindex(b")") + 2:].split()[0].decode()
    except (ValueError, IndexError):
        return None


def _first_cause(err: str) -> str:
    """py-spy's error and its causes on one line, without its Rust backtrace."""
    head = err.split("Stack backtrace:", 1)[0]
    return " / ".join(ln.strip() for ln in head.splitlines() if ln.strip())


def dump_stack(pid: int, *, job: str, node: str, rank: int | None, timeout_s: float = 20.0,
               request_id: str | None = None, pyspy: str | None = None, subprocesses: bool = True) -> StackDump:
    """``py-spy dump --pid`` of one process; failures become ``StackDump.error``.

    With ``subprocesses`` (``--subprocesses``) its children follow it in the text, each under its own
    ``Process PID: CMD`` line: a dataloader worker stuck in a read or a checkpoint writer stuck in
    fsync is where a hang's rank really waits (diagnosis.hangroot reads them).
    """
    exe = pyspy or shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    ts = time.time()
    argv = [exe, "dump", "--pid", str(pid)] + (["--subprocesses"] if subprocesses else [])
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return StackDump(ts, job, node, rank, pid, "", request_id, f"timeout: py-spy did not finish in {timeout_s:g} s")
    except FileNotFoundError:
        return StackDump(ts, job, node, rank, pid, "", request_id, "py-spy not installed (pip install faultlens[stacks])")
    except OSError as exc:
        return StackDump(ts, job, node, rank, pid, "", request_id, f"cannot run py-spy: {exc}")
    if res.returncode != 0:
        err = (res.stderr or res.stdout).strip()
        low = err.lower()
        state = process_state(pid)
        if state in ("T", "t") or "failed to suspend process" in low:
            # py-spy exits 1 within milliseconds on a stopped process: that is the hang's evidence, not a gap
            where = f"process stopped (state {state} in /proc/{pid}/stat: SIGSTOP, a debugger or a hung machine)" \
                if state in ("T", "t") else "process could not be suspended (stopped or traced)"
            return StackDump(ts, job, node, rank, pid, res.stdout, request_id, f"{where}: {_first_cause(err)[:300]}")
        if "permission" in low or "ptrace" in low or "operation not permitted" in low:
            reason = f"permission denied (needs CAP_SYS_PTRACE or root): {err[:300]}"
        elif "no such process" in low or "failed to find" in low:
            reason = f"process gone: {err[:300]}"
        else:
            reason = f"py-spy exited {res.returncode}: {err[:300]}"
        return StackDump(ts, job, node, rank, pid, res.stdout, request_id, reason)
    return StackDump(ts, job, node, rank, pid, res.stdout, request_id, None)


def dump_job(job: str, node: str, *, timeout_s: float = 20.0, request_id: str | None = None) -> list[StackDump]:
    """Stack dumps of every training process of ``job`` on this node, and the Flight Recorder dumps
    their NCCL watchdogs left (collectors.flight_recorder)."""
    procs = training_processes(job)
    dumps = [dump_stack(p.pid, job=job, node=node, rank=p.rank, timeout_s=timeout_s, request_id=request_id)
             for p in procs]
    return dumps + flight_recorder.for_processes(job, node, [(p.pid, p.rank) for p in procs], request_id=request_id)


def command_refusal(keyring: Keyring, value: bytes) -> Unverified | None:
    """Why a commands-topic message must not be carried out (unsigned, forged, expired, future), or None."""
    try:
        keyring.verify(orjson.loads(value))
    except orjson.JSONDecodeError as exc:
        return Unverified("malformed_json", str(exc))
    except Unverified as exc:
        return exc
    return None


class StacksSource:
    """The agent's ``stacks`` source: answers ``dump_stacks`` commands for this node.

    A thread consumes the ``commands`` topic (its own consumer group per node) and
    dumps the job's training processes with py-spy. Options: ``provider``, a
    ``(job, node, request_id) -> list[StackDump]`` (default ``dump_job``).
    """

    name = "stacks"

    def __init__(self, agent: Any, options: dict[str, Any]):
        self.agent = agent
        self.provider = options.get("provider") or _dump_job_provider
        self._seen: set[str] = set()
        self.keyring = Keyring.from_config(agent.config.keys)  # commands run only when they verify
        warning = verifier_warning(self.keyring, "agent")  # it verifies; a key that signs does not belong here
        if warning:
            log.warning("%s", warning)
        self._thread: threading.Thread | None = None

    def start(self, positions: dict[str, Any]) -> None:
        self._thread = threading.Thread(target=self._loop, name="faultlens-stacks", daemon=True)
        self._thread.start()

    def poll(self, now: float) -> None:
        pass

    def _loop(self) -> None:

        agent = self.agent
        stop = agent.stop_event
        consumer = None
        backoff = 1.0
        while not stop.is_set():
            if consumer is None:
                try:
                    consumer = Consumer(agent.config.bus, ["commands"], group_id=f"faultlens-agent-{agent.node}",
                                        bootstrap=agent.bootstrap, from_beginning=False)
                    backoff = 1.0
                except (BusError, OSError) as exc:
                    agent.set_state("stacks", "error", f"commands consumer: {exc}")
                    stop.wait(backoff)
                    backoff = min(30.0, backoff * 2)
                    continue
            try:
                msgs = consumer.poll(timeout_ms=500)
            except BusError as exc:
                agent.set_state("stacks", "error", str(exc))
                consumer.close()
                consumer = None
                continue
            if consumer.raw.assignment():
                if agent.health["stacks"].state != "ok":
                    agent.set_state("stacks", "ok", "listening on commands")
                agent.health["stacks"].last_success_ts = time.time()
            for m in msgs:
                self.on_command(m.value)
            if msgs:
                try:
                    consumer.commit()
                except BusError:
                    pass
        if consumer is not None:
            consumer.close()

    def on_command(self, value: bytes) -> None:
        """Answer one ``commands`` message if it asks this node for stacks (once per command id)."""

        agent = self.agent
        refused = command_refusal(self.keyring, value)
        if refused is not None:
            self._dead_letter(value, refused)
            return
        try:
            cmd = schema.decode("commands", value)
        except SchemaError as exc:
            agent.parse_failure("stacks")
            log.warning("a command that does not decode: %s", exc)
            return
        if cmd.kind != "dump_stacks" or (cmd.nodes and agent.node not in cmd.nodes) or cmd.id in self._seen:
            return
        self._seen.add(cmd.id)
        t0 = time.monotonic()
        try:
            dumps = self.provider(cmd.job, agent.node, cmd.id)
        except Exception as exc:  # noqa: BLE001 - report it, as a dump with an error
            dumps = [StackDump(agent.clock(), cmd.job, agent.node, None, None, "", cmd.id, f"stack collection failed: {exc}")]
        if not dumps:
            dumps = [StackDump(agent.clock(), cmd.job, agent.node, None, None, "", cmd.id,
                               f"no training process of job {cmd.job} found on {agent.node}")]
        agent.emit_many(dumps)
        failed = sum(1 for d in dumps if d.error)
        agent.success("stacks", records=len(dumps))
        log.info("dump_stacks %s for job %s: %d dumps (%d failed) in %.1f s", cmd.id, cmd.job, len(dumps), failed,
                 time.monotonic() - t0)

    def _dead_letter(self, value: bytes, refused: Unverified) -> None:
        """A command that does not verify: not carried out, kept on the deadletter topic, counted."""

        agent = self.agent
        topic = topics.topic("commands", agent.config.bus.topic_prefix)
        agent.say_once(f"command-refused-{refused.reason}", logging.WARNING,
                       "commands refused (%s): %s", refused.reason, refused.detail)
        if agent.metrics is not None:
            agent.metrics.dead_letters.labels(topic=topic, reason=refused.reason).inc()
        agent.emit(schema.DeadLetter(ts=time.time(), topic=topic, partition=-1, offset=-1, reason=refused.reason,
                                     detail=refused.detail[:2000], payload=value[:schema.MAX_MESSAGE_BYTES].decode(
                                         "utf-8", "backslashreplace"), size=len(value)))

    def holding(self) -> bool:
        return False

    def positions(self) -> dict[str, Any] | None:
        return None

    def drain(self) -> None:
        if self._thread is not None:  # the agent has set stop: the thread ends within a second
            self._thread.join(timeout=5)

    def close(self) -> None:
        pass


def _dump_job_provider(job: str, node: str, request_id: str) -> list[StackDump]:
    return dump_job(job, node, request_id=request_id)


register_source("stacks", StacksSource)
