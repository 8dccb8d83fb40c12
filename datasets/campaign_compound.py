"""Failures of several machines at once, rendered on the slice and decided by the engine.

A campaign's clean renders (campaign_render.py) carry one fault each. Two things
in a long job do not: a *correlated* event (a rack's power shelf or a leaf switch
taking several machines at the same moment) and an *overlap* (a second machine
fails while the first is still being handled). Both are rendered here from the
simulator's own fault modules, several ``FaultSpec`` in one scenario, and decided
by ``diagnose_records`` like any render; a decision is right only when every
culprit machine is named by an eviction (or adaptation) and it is classified,
cached and drawn like the clean ones (campaign_outcomes.py).

    rack_power   gpu_lost on ``machines`` consecutive nodes (one rack), same onset
    leaf_switch  ib_link_persistent on ``machines`` nodes cabled to one leaf, same onset
    overlap      one machine fault, then another kind on another node 30-300 s later

The module is outside the engine's code digest (its name starts with ``campaign``),
so its cache files carry a digest of this file beside it (``compound_digest``).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from faultlens.config import Config
from faultlens.datasets.campaign_render import (
    PRIORITY,
    Decision,
    Noise,
    SliceLayout,
    diagnose_rendered,
    score,
    slice_spec,
)
from faultlens.datasets.scenario import FaultSpec, Scenario
from faultlens.vocabulary import ActionType, FaultKind

A = ActionType
# compound render -> the simulator fault each of its machines gets (overlap draws a pair from OVERLAP_KINDS)
F = FaultKind
COMPOUND: dict[str, str] = {"rack_power": F.GPU_LOST, "leaf_switch": F.IB_LINK_PERSISTENT, "overlap": ""}
OVERLAP_KINDS: tuple[str, ...] = (F.GPU_LOST, F.ECC_UNCORRECTABLE, F.NVLINK_ERROR, F.IB_LINK_PERSISTENT,
                                  F.ROW_REMAP_FAILURE)
RENDERED_MACHINES = 4  # machines a correlated render takes (a rack of 4 HGX nodes; 4 of a leaf's nodes in the slice)


def compound_digest() -> str:
    """A digest of this file: a cache file of compound decisions is keyed by it beside the engine's."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:8]


def compound_faults(kind: str, nodes: list[str], rng: np.random.Generator, onset_s: float) -> list[FaultSpec]:
    """The faults of one compound render (seeded by ``rng``)."""
    if kind == "overlap":
        first, second = rng.choice(len(OVERLAP_KINDS), 2, replace=False)
        a, b = rng.choice(len(nodes), 2, replace=False)
        gap = float(rng.uniform(30.0, 300.0))
        return [FaultSpec(kind=OVERLAP_KINDS[int(first)], id="f1", onset_s=onset_s, node=nodes[int(a)]),
                FaultSpec(kind=OVERLAP_KINDS[int(second)], id="f2", onset_s=onset_s + gap, node=nodes[int(b)])]
    if kind not in COMPOUND:
        raise ValueError(f"no compound render {kind!r} (have {', '.join(COMPOUND)})")
    n = min(RENDERED_MACHINES, len(nodes))
    if kind == "rack_power":  # consecutive nodes: one rack
        start = int(rng.integers(0, len(nodes) - n + 1))
        picked = nodes[start:start + n]
    else:  # a leaf switch's ports: any of the slice's nodes (rail-optimised cabling spreads a job over leaves)
        picked = [nodes[int(i)] for i in sorted(rng.choice(len(nodes), n, replace=False))]
    return [FaultSpec(kind=COMPOUND[kind], id=f"f{i + 1}", onset_s=onset_s, node=node)
            for i, node in enumerate(picked)]


def decide_compound(kind: str, layout: SliceLayout, seed: int, bucket: int, *, nccl_timeout_s: float,
                    noise: Noise | None = None, config: Config | None = None) -> Decision:
    """Render one compound failure on the slice, diagnose it in batch, and score it against every culprit."""
    config = config or Config()
    noise = noise or Noise()
    rng = np.random.default_rng([seed, 36])
    base = slice_spec(COMPOUND[kind] or OVERLAP_KINDS[0], layout, seed, "fail_stop", nccl_timeout_s, noise)
    nodes = list(base.cluster.node_names)
    faults = compound_faults(kind, nodes, rng, noise.onset_s)
    noise_faults = tuple(f for f in base.faults if f.id.startswith("noise"))
    spec = replace(base, name=f"campaign-{kind}-s{seed}", faults=tuple(faults) + noise_faults,
                   duration_s=base.duration_s + (300.0 if kind == "overlap" else 0.0))
    t0 = time.perf_counter()
    sc = Scenario(spec)
    _, records, truth, incidents, actions, t1, t2 = diagnose_rendered(sc, config)
    s = score_all(actions, incidents, truth)
    return Decision(kind=kind, bucket=bucket, seed=seed, slow_speed=1.0, records=len(records), render_s=t1 - t0,
                    diagnose_s=t2 - t1, **s)


def score_all(actions: Any, incidents: Any, truth: dict[str, Any]) -> dict[str, Any]:
    """``score`` with every fault's machines as the culprits: right when evictions name them all.

    Evictions may come as one action or several (an overlap's second fault is its own incident), so the
    machines named are the union over every evict/adapt action; the delays are the first fault's."""
    faults = [f for f in truth["faults"] if not str(f.get("id", "")).startswith("noise")]
    culprits = {n for f in faults for n in f["nodes"]}
    merged = {**truth, "faults": [{**faults[0], "nodes": sorted(culprits)}]}
    s = score(actions, incidents, merged)
    named = {n for a in actions if a.type in (A.EVICT_NODES, A.ADAPT_PARALLELISM) for n in a.nodes}
    if named:
        s["action"] = next(t for t in PRIORITY if t in {a.type for a in actions})
        s["named"] = len(named)
        s["culprit_named"] = culprits <= named
        s["extra_machines"] = len(named - culprits)
        s["right"] = culprits <= named
    return s
