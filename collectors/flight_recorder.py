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

import time
from collections.abc import Iterable
from pathlib import Path

from faultlens import flightrec
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


def monitored(prefix: str, rank: int, pid: int) -> bool:
    """True when ``pid`` is the rank's process that runs faultlens.torch's monitor (it answers requests)."""
    try:
        return Path(f"{prefix}{rank}.monitor").read_text().strip() == str(pid)
    except OSError:
        return False


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


__all__ = ["DEFAULT_PREFIX", "collect", "dump_prefix", "for_processes", "monitored", "request_dumps"]
