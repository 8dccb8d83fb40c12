"""One Slurm task per node of the training job: ``srun --ntasks-per-node=1`` runs this on each node.

It becomes that node's ``torchrun`` (``--nnodes $SLURM_NNODES --node-rank $SLURM_NODEID``, static
rendezvous on 127.0.0.1, a port of this job and attempt) running benchmarks/torchjob/train.py,
with the node named as Slurm names it (``$SLURMD_NODENAME``): its steps, torchrun logs and error
files land in ``WORKDIR/nodes/<node>/``, where that node's agent follows them. Node 0 also writes
the job's topology (``WORKDIR/job.json``, the agents publish it). Every attempt resumes from the
last checkpoint in ``WORKDIR/ckpt`` (the job id is Slurm's, kept across requeues).

A node whose GPU is lost stays lost: ``WORKDIR/nodes/<node>/broken`` (written by the harness with
the node's Xid 79) makes every task there fail at start, as a CUDA job does on a GPU that fell off
the bus, until a person repairs the machine (removes the file).

    srun --ntasks-per-node=1 python benchmarks/torchjob/slurm_task.py WORKDIR [train.py arguments]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAIN = Path(__file__).resolve().parent / "train.py"


def master_port(base: int, restarts: int) -> int:
    """The rendezvous port of this attempt (every node computes the same one): the free port the harness
    found at submission (``FAULTLENS_MASTER_PORT``), one up per requeue. Two clusters on one host both
    have a job 1: a port from the job id alone collided (EADDRINUSE)."""
    return 1024 + (base - 1024 + restarts) % (65536 - 1024)


def write_topology(work: Path, job: str, nodes: list[str], ranks_per_node: int) -> None:
    ranks = {str(i * ranks_per_node + k): {"node": n, "gpu": k} for i, n in enumerate(nodes)
             for k in range(ranks_per_node)}
    tmp = work / "job.json.tmp"
    tmp.write_text(json.dumps({"job": job, "tp": 1, "pp": 1, "dp": len(ranks), "cp": 1, "order": "tp-cp-dp-pp",
                               "ranks": ranks}))
    os.replace(tmp, work / "job.json")


def main(argv: list[str]) -> int:
    work, train_args = Path(argv[0]), argv[1:]
    node = os.environ["SLURMD_NODENAME"]
    job = os.environ["SLURM_JOB_ID"]
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    node_rank = int(os.environ["SLURM_NODEID"])
    ranks_per_node = int(os.environ.get("FAULTLENS_RANKS_PER_NODE", "1"))
    ndir = work / "nodes" / node
    if (ndir / "broken").exists():
        print(f"{node}: RuntimeError: CUDA error: no CUDA-capable device is detected "
              f"(this machine's GPU fell off the bus: {ndir / 'broken'})", file=sys.stderr, flush=True)
        return 1
    if node_rank == 0:
        from faultlens.diagnosis.runner.adapter_slurm import expand_nodes

        write_topology(work, job, expand_nodes(os.environ["SLURM_JOB_NODELIST"]), ranks_per_node)
    (ndir / "steps").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, FAULTLENS_NODE=node, FAULTLENS_JOB=job, FAULTLENS_ATTEMPT=f"{job}-{restarts}",
               FAULTLENS_STEPS_DIR=str(ndir / "steps"), TORCH_NCCL_DEBUG_INFO_TEMP_FILE=str(ndir / "fr" / "rank_"),
               TORCH_FR_BUFFER_SIZE="2000", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1",
               LOGLEVEL="WARNING")
    print(f"{node}: node rank {node_rank} of job {job}, attempt {restarts}", flush=True)
    args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", os.environ["SLURM_NNODES"],
            "--node-rank", str(node_rank), "--nproc-per-node", str(ranks_per_node), "--master-addr", "127.0.0.1",
            "--master-port", str(master_port(int(os.environ["FAULTLENS_MASTER_PORT"]), restarts)), "--max-restarts", "0", "--log-dir", str(ndir / "tr"),
            "--redirects", "3", "--tee", "3", str(TRAIN), "--ckpt-dir", str(work / "ckpt"), "--ctl",
            str(work / "ctl"), "--data", str(ndir / "data"), *train_args]
    os.execve(sys.executable, args, env)
    return 1  # not reached


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
