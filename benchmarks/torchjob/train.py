"""A small real training job: a transformer LM on synthetic token batches of varying length, DDP over gloo.

Launched by torchrun (one per virtual node, benchmarks/torchjob/cluster.py); instrumented with
faultlens.torch (step records, stall watchdog, Flight Recorder dumps on request) and torch's
``@record`` (the error file the agent's ``elastic`` source reads). Rank 0 checkpoints every
``--ckpt-every`` steps; a start resumes from the last checkpoint.

Faults that need the job's own code paths are asked for through files in ``--ctl`` (read once a
step: a stat), so what happens is what a real job does:
``raise-<rank>`` the rank raises; ``lr-<x>`` the learning rate becomes x (x=1e6: NaN on every rank);
``fifo-<rank>`` the rank's dataset reads its shard from a FIFO nobody writes (blocked storage read);
``slowdata-<rank>`` its dataset sleeps 0.3 s an item (slow input pipeline).
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

from faultlens.torch import TrainingMonitor

VOCAB, DIM, LAYERS, HEADS = 256, 64, 2, 4


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        layer = nn.TransformerEncoderLayer(DIM, HEADS, 4 * DIM, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(x), src_key_padding_mask=pad))


class SyntheticTokens(Dataset):
    """Token sequences of 16-96 tokens; each item reads a small shard file first (the storage read)."""

    def __init__(self, shard: Path, ctl: Path, rank: int, size: int = 1 << 20):
        self.shard, self.ctl, self.rank, self.size = shard, ctl, rank, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> torch.Tensor:
        if (self.ctl / f"fifo-{self.rank}").exists():
            path = self.shard.with_suffix(".fifo")
            if not path.exists():
                os.mkfifo(path)
            with open(path, "rb") as f:  # blocks: a storage read that never returns
                f.read(16)
        else:
            with open(self.shard, "rb") as f:
                f.read(16)
        if (self.ctl / f"slowdata-{self.rank}").exists():
            time.sleep(0.3)
        rng = random.Random(i * 7919 + self.rank)
        n = rng.randint(16, 96)
        return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(i))


def collate(items: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    lengths = torch.tensor([len(t) for t in items])
    x = torch.zeros(len(items), int(lengths.max()), dtype=torch.long)
    for j, t in enumerate(items):
        x[j, : len(t)] = t
    pad = torch.arange(x.shape[1])[None, :] >= lengths[:, None]
    return {"x": x, "pad": pad, "lengths": lengths}


@record
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=0, help="stop after this step (0: run until stopped)")
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--ckpt-every", type=int, default=20)
    ap.add_argument("--ctl", required=True, help="fault control files (see the module doc)")
    ap.add_argument("--data", required=True, help="this node's data directory (shards)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--stall-s", type=float, default=15.0)
    ap.add_argument("--timeout-s", type=float, default=600.0, help="collective timeout")
    args = ap.parse_args()
    torch.set_num_threads(1)
    mon = TrainingMonitor(stall_s=args.stall_s)  # before init_process_group: it turns the Flight Recorder on
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(TinyLM())
    mon.watch_ddp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = Path(args.ckpt_dir) / "ckpt.pt"
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"]) + 1
    ctl = Path(args.ctl)
    data = Path(args.data)
    data.mkdir(parents=True, exist_ok=True)
    shard = data / f"shard-{rank}.bin"
    shard.write_bytes(os.urandom(64))
    ds = SyntheticTokens(shard, ctl, rank)
    loader = DataLoader(ds, batch_size=args.batch, collate_fn=collate, num_workers=args.workers,
                        sampler=range(start * args.batch, len(ds)), persistent_workers=args.workers > 0)
    loss_fn = nn.CrossEntropyLoss()
    print(f"rank {rank}/{world} on {os.environ.get('FAULTLENS_NODE')} starts at step {start}", flush=True)
    it = iter(loader)
    step = start
    while not args.steps or step <= args.steps:
        with mon.step(step) as s:
            batch = next(it)
            s.mark("data")  # the input pipeline's wait (data_s: in the file, not in the steps schema)
            s.update(**_workload(batch["lengths"]))
            if (ctl / f"raise-{rank}").exists():
                raise RuntimeError(f"injected failure on rank {rank} at step {step}: shape mismatch in the loss")
            for f in ctl.glob("lr-*"):
                for g in opt.param_groups:
                    g["lr"] = float(f.name[3:])
            x, pad = batch["x"], batch["pad"]
            logits = model(x[:, :-1], pad[:, :-1])
            loss = loss_fn(logits.reshape(-1, VOCAB)[~pad[:, 1:].reshape(-1)], x[:, 1:][~pad[:, 1:]])
            s.mark("fwd")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            s.mark("bwd")
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            opt.step()
            s.update(loss=loss.detach(), grad_norm=gn)
        if rank == 0 and step % args.ckpt_every == 0 and step > start:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, ckpt)
        step += 1
    mon.close()
    dist.destroy_process_group()


def _workload(lengths: torch.Tensor) -> dict[str, int]:
    from faultlens.torch import workload

    return workload(lengths)


if __name__ == "__main__":
    main()
