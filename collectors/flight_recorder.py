"""The Flight Recorder dumps a job's ranks left on this node, answered with its stack dumps.

With ``TORCH_NCCL_TRACE_BUFFER_SIZE`` > 0 and ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``, PyTorch's
NCCL watchdog writes each rank's recent collectives to ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``
followed by the rank (default ``/tmp/nccl_trace_rank_<rank>``) when a collective times out.
On a ``dump_stacks`` command the agent reads the files of the job's training processes
(the prefix from each process's environment), keeps those written recently, and sends each
as a summary (faultlens.flightrec) on the ``stacks`` topic beside the py-spy dumps.

Ranks that run ``faultlens.torch``'s monitor (gloo has no dump-on-timeout of its own) leave
``<prefix><rank>.monitor`` with their pid: those are asked first for a fresh dump
(``<prefix><rank>.request`` touched; their monitor thread writes it within half a second)
and waited for up to ``REQUEST_WAIT_S``. A rank that does not answer (stopped, dead, or its
interpreter wedged) is a record with that ``error``: evidence, not missing data. The
pickle is read with an unpickler that refuses every class; a file that is not a dump is
reported in the record's ``error`` (its text the bare marker), never loaded.
"""

from __future__ import annotations

import glob
import json
import re
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from faultlens import flightrec
from faultlens.collectors.sources import AgentServices, SourceBase, register_source
from faultlens.schema import StackDump

DEFAULT_PREFIX = "/tmp/nccl_trace_rank_"
REQUEST_WAIT_S = 2.0  # how long the agent waits for monitored ranks to write a requested dump
NOT_ANSWERED = "did not answer the Flight Recorder dump request"
PREFIX_ENV = b"TORCH_NCCL_DEBUG_INFO_TEMP_FILE"


def dump_prefix(pid: int, proc: str = "/proc") -> str:
    """The dump file prefix a training process writes to (its environment, else PyTorch's default)."""
    try:
        with open(f"{proc}/{pid}/environ", "rb") as f:
            for kv in f.read().split(b"\0"):
                if kv.startswith(PREFIX_ENV + b"="):
                    return kv.split(b"=", 1)[1].decode("utf-8", "replace") or DEFAULT_PREFIX
    except OSError:
        pass
    return DEFAULT_PREFIX


def collect(job: str, node: str, ranks: Iterable[tuple[int, str]], *, request_id: str | None = None,
            max_age_s: float = 3600.0, now: float | None = None) -> list[StackDump]:
    """One record per (rank, prefix) whose dump file exists and is younger than ``max_age_s``."""
    now = time.time() if now is None else now
    out = []
    for rank, prefix in ranks:
        path = Path(f"{prefix}{rank}")
        try:
            st = path.stat()
        except OSError:
            continue
        if now - st.st_mtime > max_age_s:
            continue  # an old run's dump: not this hang
        try:
            summary = flightrec.summarise(flightrec.loads(path.read_bytes()), rank)
        except (OSError, flightrec.FlightRecorderError) as exc:
            out.append(StackDump(st.st_mtime, job, node, rank, None, flightrec.MARKER, request_id,
                                 f"Flight Recorder dump {path} not usable: {exc}"))
            continue
        out.append(StackDump(st.st_mtime, job, node, rank, None, flightrec.summary_text(summary), request_id, None))
    return out


def monitor_info(prefix: str, rank: int) -> dict[str, Any]:
    """What faultlens.torch's monitor of that rank wrote about itself ({pid, job, rank, node}), or {}."""
    try:
        info = json.loads(Path(f"{prefix}{rank}.monitor").read_bytes())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def monitored(prefix: str, rank: int, pid: int) -> bool:
    """True when ``pid`` is the rank's process that runs faultlens.torch's monitor (it answers requests)."""
    return monitor_info(prefix, rank).get("pid") == pid


def request_dumps(ranks: list[tuple[int, str]], *, wait_s: float = REQUEST_WAIT_S) -> list[int]:
    """Ask monitored ranks for a fresh dump and wait for them; the ranks that did not answer."""
    asked = time.time()
    for rank, prefix in ranks:
        try:
            Path(f"{prefix}{rank}.request").write_text(f"{asked:.3f}\n")
        except OSError:
            continue
    pending = dict(ranks)
    deadline = time.monotonic() + wait_s
    while pending and time.monotonic() < deadline:
        for rank, prefix in list(pending.items()):
            try:
                if Path(f"{prefix}{rank}").stat().st_mtime >= asked - 0.05:
                    del pending[rank]
            except OSError:
                pass
        if pending:
            time.sleep(0.1)
    return sorted(pending)


def for_processes(job: str, node: str, procs: Iterable[tuple[int, int | None]], *, request_id: str | None = None,
                  proc: str = "/proc") -> list[StackDump]:
    """The dumps of ``(pid, rank)`` training processes (ranks unknown are skipped); monitored ranks are
    asked for a fresh one first, and one that does not answer is said."""
    known = [(pid, rank, dump_prefix(pid, proc)) for pid, rank in procs if rank is not None]
    asked = [(rank, prefix) for pid, rank, prefix in known if monitored(prefix, rank, pid)]
    silent = request_dumps(asked) if asked else []
    out = collect(job, node, [(rank, prefix) for _pid, rank, prefix in known], request_id=request_id)
    pids = {rank: pid for pid, rank, _p in known}
    for rank in silent:
        out.append(StackDump(time.time(), job, node, rank, pids.get(rank), flightrec.MARKER, request_id,
                             f"rank {rank} {NOT_ANSWERED} within {REQUEST_WAIT_S:g} s (stopped, dead or wedged)"))
    return out


DUMP_NAME_RE = re.compile(r"(\d+)$")  # <prefix><rank>; .request, .monitor and .tmp files are not dumps
SCAN_S = 1.0
STALL_STACK_S = 20.0  # a rank's stall dump also gets it a py-spy stack, at most this often per rank


class FlightRecorderSource(SourceBase):
    """The agent's ``flight_recorder`` source: dumps the ranks wrote on their own (a stall watchdog,
    NCCL's dump on timeout), shipped once each as they appear or change (``agent.flight_recorder_glob``,
    e.g. ``/tmp/nccl_trace_rank_*``). A stalled rank's dump is its word that it is alive and where it
    waits, before anyone asks; files there when the agent starts are an earlier run's. A rank whose
    monitor file names its pid (faultlens.torch) also gets a py-spy stack taken (at most every
    ``STALL_STACK_S``): its Python stack at the stall, and on a host without GPU samples the evidence
    diagnosis needs that the job's processes are alive while its steps stopped."""

    name = "flight_recorder"

    def __init__(self, agent: AgentServices, options: dict[str, Any]):
        super().__init__(agent, options)
        self.pattern = str(options.get("glob") or agent.config.agent.flight_recorder_glob)
        self._seen: dict[str, float] = {}
        self._stack_taken: dict[int, float] = {}
        self._next = 0.0

    def start(self, positions: dict[str, Any]) -> None:
        if not self.pattern:
            self.agent.set_state(self.name, "off", "no flight_recorder_glob configured")
            return
        for path in self._dumps():
            self._seen[path] = self._mtime(path)
        self.agent.set_state(self.name, "ok", f"watching {self.pattern}")

    def _dumps(self) -> list[str]:
        return [p for p in glob.glob(self.pattern) if DUMP_NAME_RE.search(p)]

    @staticmethod
    def _mtime(path: str) -> float:
        try:
            return Path(path).stat().st_mtime
        except OSError:
            return 0.0

    def poll(self, now: float) -> None:
        if not self.pattern or now < self._next:
            return
        self._next = now + SCAN_S
        out: list[StackDump] = []
        for path in self._dumps():
            mtime = self._mtime(path)
            if not mtime or self._seen.get(path) == mtime:
                continue
            self._seen[path] = mtime
            m = DUMP_NAME_RE.search(path)
            assert m is not None
            rank = int(m.group(1))
            prefix = path[: m.start()]
            info = monitor_info(prefix, rank)
            job = str(info.get("job") or self.agent.job or "")
            out += collect(job, self.agent.node, [(rank, prefix)])
            pid = info.get("pid")
            if isinstance(pid, int) and now - self._stack_taken.get(rank, -1e9) >= STALL_STACK_S \
                    and dump_prefix(pid) == prefix:  # the pid is that rank's process as this agent sees it
                self._stack_taken[rank] = now
                threading.Thread(target=self._take_stack, args=(pid, job, rank), daemon=True,
                                 name=f"faultlens-stall-stack-{rank}").start()
        if out:
            self.agent.emit_many(out)
            self.agent.success(self.name, records=len(out), now=now)

    def _take_stack(self, pid: int, job: str, rank: int) -> None:
        """py-spy of a rank that said it stalled (its own thread: py-spy takes a fraction of a second)."""
        from faultlens.collectors.stacks import dump_stack

        self.agent.emit_many([dump_stack(pid, job=job, node=self.agent.node, rank=rank, timeout_s=10.0)])


register_source("flight_recorder", FlightRecorderSource)

__all__ = ["FlightRecorderSource", "monitor_info", "DEFAULT_PREFIX", "collect", "dump_prefix", "for_processes", "monitored", "request_dumps"]
