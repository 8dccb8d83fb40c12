"""Record real outputs of the real job as test fixtures (tests/fixtures/real_torch/), verbatim.

One torchrun, 2 ranks, DDP over gloo (benchmarks/torchjob/train.py), four times:

* ``blocked``: rank 1 stopped (SIGSTOP); then py-spy of rank 0 (blocked in the gradient
  allreduce), py-spy of rank 1 (stopped: py-spy cannot suspend it), and rank 0's Flight
  Recorder dump, asked for as the agent asks (``.request``) plus the one its stall watchdog wrote;
* ``worker_hung``: rank 0's DataLoader worker stopped; py-spy --subprocesses of rank 0;
* ``storage_blocked``: rank 0's Dataset reads a FIFO nobody writes; py-spy --subprocesses of rank 0;
* ``exception``: rank 1 raises; torchrun's error file of rank 1 and its ChildFailedError summary.

    python benchmarks/torchjob/capture_fixtures.py --out tests/fixtures/real_torch
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def pyspy(pid: int, subprocesses: bool = False) -> dict:
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    argv = [exe, "dump", "--pid", str(pid)] + (["--subprocesses"] if subprocesses else [])
    t0 = time.monotonic()
    res = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    return {"argv": " ".join(argv[1:]), "rc": res.returncode, "seconds": round(time.monotonic() - t0, 3),
            "stdout": res.stdout, "stderr": res.stderr}


def children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def launch(work: Path, port: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ, FAULTLENS_NODE="vn0", FAULTLENS_JOB="fixture", FAULTLENS_ATTEMPT=f"capture-{port}", FAULTLENS_STEPS_DIR=str(work),
               TORCH_NCCL_DEBUG_INFO_TEMP_FILE=str(work / "fr_rank_"), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "0", "--log-dir",
            str(work / "tr"), str(HERE / "train.py"), "--ckpt-dir", str(work), "--ctl", str(work / "ctl"),
            "--data", str(work / "data"), "--stall-s", "5"]
    (work / "ctl").mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(argv, stdout=open(work / "torchrun.log", "wb"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def ranks(launcher: subprocess.Popen[bytes]) -> list[int]:
    """The rank processes (torchrun's children), waited for until both trained a few steps."""
    for _ in range(240):
        kids = [k for c in children(launcher.pid) for k in [c] + children(c)]
        mains = sorted(k for k in kids if b"train.py" in Path(f"/proc/{k}/cmdline").read_bytes()
                       and any(b"torch.distributed.run" in Path(f"/proc/{p}/cmdline").read_bytes()
                               for p in [int(Path(f"/proc/{k}/stat").read_text().rsplit(")", 1)[1].split()[1])]))
        if len(mains) == 2:
            return mains
        time.sleep(0.25)
    raise RuntimeError("the ranks did not start")


def wait_steps(work: Path, n: int) -> None:
    for _ in range(240):
        f = work / "steps-fixture-1.jsonl"
        if f.exists() and len(f.read_bytes().splitlines()) >= n:
            return
        time.sleep(0.25)
    raise RuntimeError("no steps")


def stop(launcher: subprocess.Popen[bytes], port: int) -> None:
    """The launcher and every rank and worker (torchrun starts each rank in a session of its own)."""
    sys.path.insert(0, str(REPO))
    from benchmarks.torchjob.cluster import job_pids

    try:
        os.killpg(launcher.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    launcher.wait()
    for pid in job_pids(f"capture-{port}"):
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "tests" / "fixtures" / "real_torch"))
    ap.add_argument("--work", default="/tmp/faultlens-capture")
    args = ap.parse_args()
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work_root = Path(args.work)
    shutil.rmtree(work_root, ignore_errors=True)
    meta = {"torch": torch.__version__, "backend": "gloo", "python": sys.version.split()[0],
            "captured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    # blocked + stopped
    work = work_root / "blocked"
    port = 29801
    lr = launch(work, port)
    try:
        r0, r1 = ranks(lr)
        wait_steps(work, 5)
        os.kill(r1, signal.SIGSTOP)
        time.sleep(8)  # rank 0 blocks in the allreduce; its stall watchdog (5 s) dumps
        shutil.copy(work / "fr_rank_0", out / "fr_gloo_rank0_stall.pkl")
        (work / "fr_rank_0.request").write_text(f"{time.time()}\n")
        time.sleep(1.5)
        shutil.copy(work / "fr_rank_0", out / "fr_gloo_rank0_requested.pkl")
        (out / "pyspy_blocked_allreduce.json").write_text(json.dumps(pyspy(r0), indent=1))
        (out / "pyspy_stopped.json").write_text(json.dumps(pyspy(r1), indent=1))
        os.kill(r1, signal.SIGCONT)
    finally:
        stop(lr, port)

    # a hung DataLoader worker, and a storage read that never returns
    for name, make in (("worker_hung", "stop-worker"), ("storage_blocked", "fifo")):
        work = work_root / name
        port = 29802 if make == "stop-worker" else 29803
        lr = launch(work, port)
        try:
            r0, _ = ranks(lr)
            wait_steps(work, 5)
            if make == "stop-worker":
                os.kill(children(r0)[0], signal.SIGSTOP)
            else:
                (work / "ctl" / "fifo-0").touch()
            time.sleep(6)
            (out / f"pyspy_{name}.json").write_text(json.dumps(pyspy(r0, subprocesses=True), indent=1))
        finally:
            stop(lr, port)

    # an exception on rank 1: the error file and torchrun's summary
    work = work_root / "exception"
    port = 29804
    lr = launch(work, port)
    try:
        ranks(lr)
        wait_steps(work, 3)
        (work / "ctl" / "raise-1").touch()
        lr.wait(timeout=120)
    finally:
        stop(lr, port)
    err = next(work.glob("tr/*/attempt_0/1/error.json"))
    shutil.copy(err, out / "torchelastic_error_rank1.json")
    shutil.copy(work / "torchrun.log", out / "torchrun_childfailed.log")
    (out / "captured.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(json.dumps({"bench": "capture_fixtures", **meta, "files": sorted(p.name for p in out.iterdir())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
