"""Parallel-group demarcation on top of ``faultlens.stream.topology.Topology``.

ByteRobust isolates an implicit fault by evicting the machines of the smallest
parallel group that holds every outlier rank ("over-eviction": quicker than
pinpointing, and the group is small). This module answers that question and
the simpler ones (every group of a rank, the groups of one dimension).

Candidate groups, smallest first: each single dimension (tp, cp, dp, pp), then
the composite groups Megatron also builds (ranks sharing all coordinates but
two dimensions, e.g. tp+pp = the model-parallel group), then the whole job.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import combinations

from faultlens.stream.topology import DIMS, Topology


@dataclass(frozen=True)
class Demarcation:
    """The smallest parallel group holding a set of ranks, and its machines."""

    dims: tuple[str, ...]  # ("pp",), ("tp", "pp"), or DIMS for the whole job
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]

    @property
    def label(self) -> str:
        return "+".join(self.dims) if self.dims != DIMS else "job"


def normalise_order(order: str) -> str:
    """Accept older Megatron orders without cp (``tp-dp-pp``): cp (size 1 there) goes right after tp."""
    dims = order.split("-")
    if "cp" not in dims and "tp" in dims:
        dims.insert(dims.index("tp") + 1, "cp")
    return "-".join(dims)


def make_topology(tp: int, pp: int, dp: int, cp: int = 1, *, order: str = "tp-cp-dp-pp", gpus_per_node: int = 8,
                  job: str = "") -> Topology:
    """A packed topology that also accepts Megatron's older three-dimension orders."""
    return Topology.packed(tp=tp, pp=pp, dp=dp, cp=cp, order=normalise_order(order), gpus_per_node=gpus_per_node, job=job)


def groups_of(topo: Topology, rank: int) -> dict[str, tuple[int, ...]]:
    """Every single-dimension parallel group of ``rank``: {"tp": (...), "cp": ..., "dp": ..., "pp": ...}."""
    return {d: topo.group(rank, d) for d in DIMS}


def groups(topo: Topology, dim: str) -> list[tuple[int, ...]]:
    """Every ``dim``-parallel group of the job (Megatron's listing for that dimension)."""
    return topo.groups(dim)


def composite_group(topo: Topology, rank: int, dims: Iterable[str]) -> tuple[int, ...]:
    """Ranks that share every coordinate of ``rank`` except those in ``dims``."""
    free = set(dims)
    c = topo.coords(rank)
    return tuple(
        r for r in range(topo.world_size)
        if all(topo.coords(r)[d] == c[d] for d in DIMS if d not in free)
    )


def smallest_group(topo: Topology, ranks: Iterable[int], *, prefer_fewest_nodes: bool = True) -> Demarcation:
    """The smallest parallel group containing all ``ranks`` (ties: fewest machines, then tp<cp<dp<pp).

    A single rank is contained in every group of it; the answer is then its
    smallest group (usually its tensor-parallel group, on one machine).
    """
    wanted = sorted(set(ranks))
    if not wanted:
        raise ValueError("no ranks to demarcate")
    anchor = wanted[0]
    candidates: list[tuple[int, int, int, tuple[str, ...], tuple[int, ...]]] = []
    order = {d: i for i, d in enumerate(DIMS)}
    real = tuple(d for d in DIMS if getattr(topo, d) > 1) or ("tp",)
    for k in (1, 2, 3):
        for dims in combinations(real, k):
            if k == 1:
                g = topo.group(anchor, dims[0])
            else:
                g = composite_group(topo, anchor, dims)
            if not set(wanted) <= set(g):
                continue
            nodes = _nodes(topo, g)
            size_key = len(nodes) if prefer_fewest_nodes else len(g)
            candidates.append((size_key, len(g), sum(order[d] for d in dims), dims, g))
        if candidates:
            break
    if not candidates:
        g = tuple(range(topo.world_size))
        return Demarcation(DIMS, g, tuple(_nodes(topo, g)))
    candidates.sort(key=lambda c: (c[0], c[1], len(c[3]), c[2]))
    _, _, _, dims, g = candidates[0]
    return Demarcation(dims, g, tuple(_nodes(topo, g)))


def _nodes(topo: Topology, ranks: Iterable[int]) -> list[str]:
    if not topo.placement:
        return []
    return sorted({topo.placement[r][0] for r in ranks if r in topo.placement})
