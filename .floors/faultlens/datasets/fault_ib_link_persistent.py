"""A NIC / IB link that keeps going down: repeated mlx5 Link DOWN, NCCL IB completion errors, a crash.

Footprint: kernel (``mlx5_core ... mlx5_N: Port: 1 Link DOWN`` at least twice
within five minutes on the culprit node, each followed by ``Link ACTIVE``),
nccl (``NET/IB : Got completion from peer ... status=12 ... vendor err 129``
on the culprit rank and on its peer on another node, then
DistBackendError/ncclRemoteError; other ranks' watchdogs), steps (stop).
"""

from __future__ import annotations

from typing import Any

from faultlens.datasets import signal_kernel as k
from faultlens.datasets import signal_nccl as nc
from faultlens.datasets.effects import FaultContext
from faultlens.datasets.fault_base import Fault


class IbLinkPersistent(Fault):
    KIND = "ib_link_persistent"
    EXPECTED_ACTION = "evict_nodes"
    FOOTPRINT = "kernel mlx5 Link DOWN repeated (>=2 in 5 min); nccl NET/IB completion errors + ncclRemoteError; watchdog elsewhere"

    def inject(self, ctx: FaultContext) -> dict[str, Any]:
        node, gpu, rank = ctx.pick_gpu(self.node, self.gpu)
        t = ctx.onset(self.onset_s, 0.15, 0.3)
        c = ctx.cluster
        nic_pci, nic = c.nic_pci(gpu), c.nic_name(gpu)
        flaps = int(self.params.get("flaps", 3))
        gap = float(self.params.get("gap_s", ctx.rng.uniform(40, 110)))
        ts = t
        for _ in range(flaps):
            ctx.kernel(node, ts, [k.ib_link(nic_pci, nic, "DOWN")])
            up = ts + float(ctx.rng.uniform(4, 12))
            ctx.kernel(node, up, [k.ib_link(nic_pci, nic, "INIT")])
            ctx.kernel(node, up + 0.6, [k.ib_link(nic_pci, nic, "ACTIVE")])
            ts = up + gap
        ctx.stop_training(t)
        # the peer: the same local GPU on another node (rail-optimised fabric)
        nodes = [n for n in c.node_names if n != node]
        peer_rank = None
        if nodes:
            peer_node = nodes[int(ctx.rng.integers(0, len(nodes)))]
            peer_rank = ctx.topology.ranks_on(peer_node)[gpu]
        p = ctx.procs[rank]
        first = t + 1.2 + float(ctx.rng.uniform(0, 1.0))
        peer_ip = ctx.procs[peer_rank].ip if peer_rank is not None else "10.20.0.1"
        port = int(ctx.rng.integers(32768, 60999))
        for ts_, line in nc.ib_completion_error(p, first, peer_ip, port, 12, 129, "Send"):
            ctx.nccl(rank, ts_, line)
        last = f"NET/IB : Got completion from peer {peer_ip}<{port}> with status=12 opcode=0 len=0 vendor err 129 (Send) localGid ::ffff:{p.ip} remoteGids::ffff:{peer_ip}"
        ctx.nccl_lines(rank, first + 0.2, nc.dist_backend_error(p, last))
        ctx.kill_node_ranks_after(node, first + 0.3, rank, 1)
        dead = set(ctx.topology.ranks_on(node))
        if peer_rank is not None:
            q = ctx.procs[peer_rank]
            pfirst = first + float(ctx.rng.uniform(0.01, 0.3))
            for ts_, line in nc.ib_completion_error(q, pfirst, p.ip, port + 1, 12, 129, "Recv"):
                ctx.nccl(peer_rank, ts_, line)
            plast = f"NET/IB : Got completion from peer {p.ip}<{port + 1}> with status=12 opcode=129 len=0 vendor err 129 (Recv) localGid ::ffff:{q.ip} remoteGids::ffff:{p.ip}"
            ctx.nccl_lines(peer_rank, pfirst + 0.2, nc.dist_backend_error(q, plast))
            ctx.kill_node_ranks_after(q.node, pfirst + 0.3, peer_rank, 1)
            dead |= set(ctx.topology.ranks_on(q.node))
        others = [r for r in range(ctx.topology.world_size) if r not in dead]
        ctx.watchdog(others, first + ctx.timeout_s + float(ctx.rng.uniform(0.05, 0.5)))
        return self.truth(ctx, onset_ts=t, end_ts=None, nodes=[node], ranks=[rank])
