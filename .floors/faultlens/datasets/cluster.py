"""The simulated cluster: machines, their GPUs and NICs, and the job laid out on them.

Names and bus ids follow an HGX H100 node (8 GPUs, 8 ConnectX-7 NICs) so that
the lines the simulator prints carry the same kind of PCI addresses a real
node's dmesg does. The job's rank placement comes from the shared
``faultlens.stream.topology.Topology`` so the simulator and diagnosis agree on
the Megatron rank order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from faultlens.stream.topology import Topology

# PCI buses of the 8 GPUs of an HGX H100 board (as nvidia-smi lists them).
GPU_PCI_BUSES = ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")
# The NIC beside each GPU (one ConnectX-7 per GPU, rail-optimised).
NIC_PCI_BUSES = ("1a", "3c", "4d", "5e", "9c", "bc", "cc", "dc")
GPU_PCI_DEVICE_ID = "10de:2330"  # H100 SXM5 80GB
DRIVER_VERSION = "550.90.07"
NCCL_VERSION = "2.23.4"


@dataclass(frozen=True)
class ClusterSpec:
    """N machines x G GPUs running one hybrid-parallel job.

    ``tp * pp * dp * cp`` must equal ``nodes * gpus_per_node``. ``num_layers``
    and ``microbatches`` (per data-parallel replica and iteration) describe
    the model the step-time model runs.
    """

    nodes: int = 4
    gpus_per_node: int = 8
    tp: int = 8
    pp: int = 2
    dp: int = 2
    cp: int = 1
    order: str = "tp-cp-dp-pp"
    job: str = "j1"
    num_layers: int = 32
    microbatches: int = 8
    node_fmt: str = "n{:03d}"

    def __post_init__(self) -> None:
        world = self.tp * self.pp * self.dp * self.cp
        if world != self.nodes * self.gpus_per_node:
            raise ValueError(
                f"tp*pp*dp*cp = {world} but the cluster has {self.nodes} x {self.gpus_per_node} GPUs"
            )
        if self.gpus_per_node > len(GPU_PCI_BUSES):
            raise ValueError(f"at most {len(GPU_PCI_BUSES)} GPUs per node")
        if self.num_layers < self.pp:
            raise ValueError("num_layers must be >= pp")

    @classmethod
    def for_nodes(cls, nodes: int, gpus_per_node: int = 8, *, tp: int | None = None, pp: int | None = None,
                  cp: int = 1, **kwargs: object) -> ClusterSpec:
        """A usual layout for ``nodes`` machines: TP inside a machine, PP across a few, DP the rest."""
        world = nodes * gpus_per_node
        tp = tp or min(gpus_per_node, 8)
        blocks = world // (tp * cp)
        # a few pipeline stages, keeping at least two data-parallel replicas when there is room
        pp = pp or next(p for p in (4, 2, 1) if blocks % p == 0 and (blocks // p >= 2 or p == 1))
        if world % (tp * pp * cp):
            raise ValueError(f"{world} GPUs cannot be split into tp={tp} pp={pp} cp={cp}")
        dp = world // (tp * pp * cp)
        return cls(nodes=nodes, gpus_per_node=gpus_per_node, tp=tp, pp=pp, dp=dp, cp=cp, **kwargs)  # type: ignore[arg-type]

    @cached_property
    def topology(self) -> Topology:
        return Topology.packed(self.tp, self.pp, self.dp, self.cp, gpus_per_node=self.gpus_per_node,
                               order=self.order, job=self.job, node_fmt=self.node_fmt)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @cached_property
    def node_names(self) -> list[str]:
        return [self.node_fmt.format(i + 1) for i in range(self.nodes)]

    def node_index(self, node: str) -> int:
        return self.node_names.index(node)

    @staticmethod
    def gpu_pci(gpu: int) -> str:
        """NVRM's short form, as in ``Xid (PCI:0000:18:00)``."""
        return f"0000:{GPU_PCI_BUSES[gpu]}:00"

    @staticmethod
    def gpu_pci_full(gpu: int) -> str:
        """NVML's form, as in ``00000000:18:00.0``."""
        return f"00000000:{GPU_PCI_BUSES[gpu]}:00.0"

    @staticmethod
    def nic_pci(gpu: int) -> str:
        return f"0000:{NIC_PCI_BUSES[gpu]}:00.0"

    @staticmethod
    def nic_name(gpu: int) -> str:
        return f"mlx5_{gpu}"

    def gpu_uuid(self, node: str, gpu: int) -> str:
        """A stable, UUID-shaped id for one GPU of one node."""
        import hashlib

        h = hashlib.sha1(f"{self.job}/{node}/{gpu}".encode()).hexdigest()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"

    def node_ip(self, node: str) -> str:
        i = self.node_index(node)
        return f"10.{20 + i // 250}.{i % 250}.{10 + i % 7}"

    def rank_of(self, node: str, gpu: int) -> int:
        i = self.node_index(node)
        return i * self.gpus_per_node + gpu
