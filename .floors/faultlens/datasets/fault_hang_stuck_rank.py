"""A hang with one stuck rank: its stack differs, everyone else waits in a collective.

Footprint: stacks (the stuck rank in a DataLoader wait or a CUDA synchronise;
its TP peers in ``broadcast``, its pipeline peers in p2p recv, everyone else
in the gradient all-reduce), nccl (the waiting ranks' watchdogs one timeout
later; the stuck rank's does not fire), gpu (a DataLoader-stuck rank's GPU
idles, the waiters spin at 100%), steps (stop). No kernel line.
"""

from __future__ import annotations

from typing import Any

from faultlens.datasets.effects import FaultContext
from faultlens.datasets.fault_base import Fault


def hang_around(ctx: FaultContext, stuck: int, t: float, state: str) -> None:
    """Training stops at ``t`` because ``stuck`` never arrives; dump stacks, then watchdogs fire."""
    topo = ctx.topology
    ctx.stop_training(t)
    tp_peers = set(topo.group(stuck, "tp")) - {stuck}
    pp_peers = set(topo.group(stuck, "pp")) - {stuck}
    states = {stuck: state}
    ctx.fx.hung_states[stuck] = state
    for r in tp_peers:
        states[r] = "broadcast" if state in ("stuck_dataloader", "stuck_io") else "allreduce"
    for r in pp_peers:
        states[r] = "p2p_recv"
    dump = t + min(120.0, 0.4 * ctx.timeout_s)
    ctx.dump_stacks(dump, states, "allreduce")
    fire = t + ctx.timeout_s + float(ctx.rng.uniform(0.05, 0.6))
    waiting = [r for r in range(topo.world_size) if r != stuck]
    ctx.watchdog([r for r in waiting if states.get(r) == "broadcast"], fire, "BROADCAST")
    ctx.watchdog([r for r in waiting if states.get(r) == "p2p_recv"], fire + 0.01, "RECV")
    ctx.watchdog([r for r in waiting if r not in states], fire + 0.02, "ALLREDUCE")
    # the stuck rank is taken down when its node's other workers abort
    ctx.exit_ranks([stuck], fire + 1.0, -15)


class HangStuckRank(Fault):
    KIND = "hang_stuck_rank"
    EXPECTED_ACTION = "evict_nodes"
    FOOTPRINT = "stacks: one rank stuck (DataLoader / CUDA sync), others in collectives; watchdog on the waiters only"

    def inject(self, ctx: FaultContext) -> dict[str, Any]:
        state = str(self.params.get("state", "stuck_dataloader" if ctx.rng.random() < 0.6 else "stuck_cuda_sync"))
        if self.node is None and self.gpu is None and state == "stuck_dataloader":
            # only TP rank 0 reads data in Megatron: the DataLoader hang is on one of those
            heads = [r for r in range(ctx.topology.world_size) if ctx.topology.coords(r)["tp"] == 0]
            r0 = heads[int(ctx.rng.integers(0, len(heads)))]
            node, gpu, rank = ctx.topology.node_of(r0), ctx.topology.gpu_of(r0), r0
        else:
            node, gpu, rank = ctx.pick_gpu(self.node, self.gpu)
        t = ctx.onset(self.onset_s, 0.1, 0.25)
        hang_around(ctx, rank, t, state)
        gpus = [(node, gpu)] if state == "stuck_cuda_sync" else []
        return self.truth(ctx, onset_ts=t, end_ts=None, gpus=gpus, nodes=[node], ranks=[rank])
