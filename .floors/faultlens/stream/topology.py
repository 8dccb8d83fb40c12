"""Rank <-> parallel coordinates for hybrid-parallel jobs.

The order string names the dimensions fastest-varying first, as Megatron-LM's
``RankGenerator`` does: with the default ``tp-cp-dp-pp``,
``rank = tp + TP * (cp + CP * (dp + DP * pp))``, so the ranks of one tensor-parallel
group are consecutive (and, with TP=8, on one 8-GPU machine).

This lives in stream/ because the simulator (datasets/) and diagnosis both need
the same arithmetic and neither may import the other; diagnosis/topology.py
builds group demarcation on top of it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

DIMS = ("tp", "cp", "dp", "pp")


@dataclass(frozen=True)
class Topology:
    """A job's parallel layout and its rank -> (node, gpu) placement."""

    tp: int
    pp: int
    dp: int
    cp: int = 1
    order: str = "tp-cp-dp-pp"
    placement: dict[int, tuple[str, int]] = field(default_factory=dict)  # rank -> (node, gpu)
    job: str = ""

    def __post_init__(self) -> None:
        dims = self.order.split("-")
        if sorted(dims) != sorted(DIMS):
            raise ValueError(f"order {self.order!r} must name each of {', '.join(DIMS)} once")
        for d in DIMS:
            if getattr(self, d) < 1:
                raise ValueError(f"{d} size must be >= 1")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @cached_property
    def _dims(self) -> list[str]:
        return self.order.split("-")

    def coords(self, rank: int) -> dict[str, int]:
        """``{"tp": .., "cp": .., "dp": .., "pp": ..}`` of a rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        out = {}
        for d in self._dims:
            size = getattr(self, d)
            out[d] = rank % size
            rank //= size
        return out

    def rank_of(self, **coords: int) -> int:
        rank, stride = 0, 1
        for d in self._dims:
            rank += coords.get(d, 0) * stride
            stride *= getattr(self, d)
        return rank

    def group(self, rank: int, dim: str) -> tuple[int, ...]:
        """The ranks of ``rank``'s ``dim``-parallel group (those differing only in ``dim``)."""
        c = self.coords(rank)
        return tuple(self.rank_of(**{**c, dim: i}) for i in range(getattr(self, dim)))

    def groups(self, dim: str) -> list[tuple[int, ...]]:
        """Every ``dim``-parallel group of the job, each once."""
        seen: set[tuple[int, ...]] = set()
        out = []
        for r in range(self.world_size):
            g = self.group(r, dim)
            if g not in seen:
                seen.add(g)
                out.append(g)
        return out

    def node_of(self, rank: int) -> str:
        return self.placement[rank][0]

    def gpu_of(self, rank: int) -> int:
        return self.placement[rank][1]

    def nodes_of(self, ranks: Iterable[int]) -> list[str]:
        return sorted({self.placement[r][0] for r in ranks})

    def ranks_on(self, node: str) -> list[int]:
        return sorted(r for r, (n, _) in self.placement.items() if n == node)

    @property
    def nodes(self) -> list[str]:
        return sorted({n for n, _ in self.placement.values()})

    @classmethod
    def packed(cls, tp: int, pp: int, dp: int, cp: int = 1, *, gpus_per_node: int = 8,
               order: str = "tp-cp-dp-pp", job: str = "", node_fmt: str = "n{:03d}") -> Topology:
        """Ranks placed in order, ``gpus_per_node`` to a node (how launchers place them)."""
        world = tp * pp * dp * cp
        placement = {r: (node_fmt.format(r // gpus_per_node + 1), r % gpus_per_node) for r in range(world)}
        return cls(tp=tp, pp=pp, dp=dp, cp=cp, order=order, placement=placement, job=job)

    @classmethod
    def from_job(cls, job: Any) -> Topology:
        """From a ``JobTopology`` record or a job.json dict."""
        get = (lambda k, d=None: job.get(k, d)) if isinstance(job, dict) else (lambda k, d=None: getattr(job, k, d))
        ranks = get("ranks") or {}
        placement = {int(r): (str(v["node"]), int(v.get("gpu", 0))) for r, v in ranks.items()}
        return cls(tp=int(get("tp", 1)), pp=int(get("pp", 1)), dp=int(get("dp", 1)), cp=int(get("cp", 1) or 1),
                   order=get("order") or "tp-cp-dp-pp", placement=placement, job=str(get("job", "")))

    def to_job_dict(self) -> dict[str, Any]:
        """The job.json form of the batch directory."""
        return {
            "job": self.job, "tp": self.tp, "pp": self.pp, "dp": self.dp, "cp": self.cp, "order": self.order,
            "ranks": {str(r): {"node": n, "gpu": g} for r, (n, g) in sorted(self.placement.items())},
        }
