"""Stack dumps: find a job's training processes and ``py-spy dump`` each of them.

Training processes are the children of a launcher (torchrun / torch.distributed.run,
deepspeed, accelerate, mpirun/srun) found by walking /proc. Each dump runs with a
timeout; a timeout, missing ptrace permission or a missing py-spy is reported in
``StackDump.error``, never hidden.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from faultlens.stream.schema import StackDump

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


def dump_stack(pid: int, *, job: str, node: str, rank: int | None, timeout_s: float = 20.0,
               request_id: str | None = None, pyspy: str | None = None) -> StackDump:
    """``py-spy dump --pid`` of one process; failures become ``StackDump.error``."""
    exe = pyspy or shutil.which("py-spy") or str(Path(os.sys.executable).parent / "py-spy")
    ts = time.time()
    try:
        res = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return StackDump(ts, job, node, rank, pid, "", request_id, f"timeout: py-spy did not finish in {timeout_s:g} s")
    except FileNotFoundError:
        return StackDump(ts, job, node, rank, pid, "", request_id, "py-spy not installed (pip install faultlens[stacks])")
    except OSError as exc:
        return StackDump(ts, job, node, rank, pid, "", request_id, f"cannot run py-spy: {exc}")
    if res.returncode != 0:
        err = (res.stderr or res.stdout).strip()
        low = err.lower()
        if "permission" in low or "ptrace" in low or "operation not permitted" in low:
            reason = f"permission denied (needs CAP_SYS_PTRACE or root): {err[:300]}"
        elif "no such process" in low or "failed to find" in low:
            reason = f"process gone: {err[:300]}"
        else:
            reason = f"py-spy exited {res.returncode}: {err[:300]}"
        return StackDump(ts, job, node, rank, pid, res.stdout, request_id, reason)
    return StackDump(ts, job, node, rank, pid, res.stdout, request_id, None)


def dump_job(job: str, node: str, *, timeout_s: float = 20.0, request_id: str | None = None) -> list[StackDump]:
    """Stack dumps of every training process of ``job`` on this node."""
    return [dump_stack(p.pid, job=job, node=node, rank=p.rank, timeout_s=timeout_s, request_id=request_id)
            for p in training_processes(job)]
