"""Adapt around a slow GPU or evict it: the glue between a fail-slow finding and an Action.

Public API (the remediation policy, diagnosis/policy.py, calls this)::

    choose_remediation(
        finding: Finding,                 # kind "fail_slow": node, rank/gpu, figures["slowdown"], figures["ranks"]
        topology: Topology,               # the job's layout (stream.topology)
        *,
        config: Config | AdaptationConfig | None = None,   # restart costs, horizon, spares, what may change
        shape: JobShape | None = None,    # layers, micro-batches, step time; None: from figures + config
        speeds: Mapping[int, float] | None = None,  # rank -> relative speed; None: from the finding
        spares: int | None = None,        # warm standby machines now (None: config.adaptation.spare_nodes)
        horizon_s: float | None = None,   # expected remaining fault time (None: config)
        incident_id: str = "",
        dry_run: bool | None = None,      # None: config.guard.dry_run (True without a Config)
        now: float | None = None,         # action timestamp (None: the finding's ts)
    ) -> Action

It returns ``adapt_parallelism`` when a new layout wins by predicted goodput over
the horizon, ``evict_nodes`` when restarting on replacement machines does, and
``notify`` when no change pays off (a slight slowdown with no spare: a person may
still want to know). Every one carries ``Action.plan`` (docs/actions.md): the
chosen layout, the predicted throughput and goodput of every option, and why.

Speed from a finding: ``figures["slowdown"]`` is the fail-slow detector's
``observed / predicted - 1`` (0.25: steps take 1.25x), so speed is
``1 / (1 + slowdown)``; ``figures["speeds"]`` (rank -> speed) wins when given.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from faultlens.config import AdaptationConfig, Config
from faultlens.models.costmodel import JobShape
from faultlens.models.planner import AdaptationPlanner, Plan
from faultlens.schema import Action, Finding
from faultlens.stream.topology import Topology

NOMINAL_TOKENS_PER_MICROBATCH = 8192  # used only when the finding carries no token count


def speeds_from_finding(finding: Finding, topology: Topology) -> dict[int, float]:
    """Rank -> relative speed implied by a fail-slow finding (1.0 for ranks not named)."""
    figures = finding.figures or {}
    given = figures.get("speeds")
    if isinstance(given, Mapping) and given:
        return {int(r): float(v) for r, v in given.items()}
    slowdown = figures.get("slowdown")
    if slowdown is None:
        raise ValueError(f"finding {finding.rule!r} carries neither figures['speeds'] nor figures['slowdown']")
    speed = 1.0 / (1.0 + max(0.0, float(slowdown)))
    ranks = [int(r) for r in figures.get("ranks") or []]
    if not ranks and finding.rank is not None:
        ranks = [finding.rank]
    if not ranks and finding.node is not None and topology.placement:
        on_node = topology.ranks_on(finding.node)
        ranks = [r for r in on_node if finding.gpu is None or topology.gpu_of(r) == finding.gpu]
    if not ranks:
        raise ValueError("finding names no rank, GPU or node to slow down")
    return {r: speed for r in ranks}


def shape_from_finding(finding: Finding, topology: Topology, cfg: AdaptationConfig) -> JobShape:
    """The job's shape from configuration and whatever step figures the finding carries.

    Without a measured step time the shape is nominal (1 s per micro-batch per
    stage): options are compared on the same scale, but pauses (restart,
    reconfigure) then weigh against a made-up step time, so pass ``shape`` when
    the step time is known.
    """
    figures = finding.figures or {}
    layers = cfg.num_layers or 4 * topology.pp
    mbs = cfg.microbatches_per_replica or 4 * topology.pp
    step_s = figures.get("healthy_step_s") or figures.get("step_s")
    tokens = figures.get("tokens_per_step")
    if step_s:
        tokens_total = int(tokens) if tokens else NOMINAL_TOKENS_PER_MICROBATCH * mbs * topology.dp
        return JobShape.from_iteration(topology, float(step_s), tokens_total, num_layers=layers, microbatches=mbs)
    tokens_mb = max(1, round(int(tokens) / (mbs * topology.dp))) if tokens else NOMINAL_TOKENS_PER_MICROBATCH
    return JobShape(num_layers=layers, microbatches=mbs, microbatch_s=float(topology.pp),
                    tokens_per_microbatch=tokens_mb)


def plan_for_finding(finding: Finding, topology: Topology, *, config: Config | AdaptationConfig | None = None,
                     shape: JobShape | None = None, speeds: Mapping[int, float] | None = None,
                     spares: int | None = None, horizon_s: float | None = None) -> Plan:
    """The planner's answer for one fail-slow finding (what choose_remediation wraps)."""
    cfg = _adaptation_config(config)
    speeds = dict(speeds) if speeds is not None else speeds_from_finding(finding, topology)
    shape = shape or shape_from_finding(finding, topology, cfg)
    return AdaptationPlanner(cfg).plan(topology, shape, speeds, spares=spares, horizon_s=horizon_s)


def choose_remediation(finding: Finding, topology: Topology, *, config: Config | AdaptationConfig | None = None,
                       shape: JobShape | None = None, speeds: Mapping[int, float] | None = None,
                       spares: int | None = None, horizon_s: float | None = None, incident_id: str = "",
                       dry_run: bool | None = None, now: float | None = None) -> Action:
    """adapt_parallelism, evict_nodes or notify for a fail-slow finding, by predicted goodput."""
    plan = plan_for_finding(finding, topology, config=config, shape=shape, speeds=speeds, spares=spares,
                            horizon_s=horizon_s)
    if dry_run is None:
        dry_run = config.guard.dry_run if isinstance(config, Config) else True
    speeds_used = dict(speeds) if speeds is not None else speeds_from_finding(finding, topology)
    slow_ranks = sorted(r for r, v in speeds_used.items() if v < 1.0)
    nodes = topology.nodes_of(slow_ranks) if topology.placement and slow_ranks else (
        [finding.node] if finding.node else [])
    if plan.evicts:
        kind, action_nodes = "evict_nodes", list(plan.evict_nodes) or nodes
    elif plan.chosen == "no_action":
        kind, action_nodes = "notify", nodes
    else:
        kind, action_nodes = "adapt_parallelism", nodes
    job = finding.job or topology.job or "unknown"
    ts = float(now if now is not None else finding.ts)
    incident = incident_id or f"fail_slow:{job}:{finding.node or ','.join(nodes)}"
    gpus = [{"node": topology.node_of(r), "gpu": topology.gpu_of(r), "rank": r}
            for r in slow_ranks if r in topology.placement]
    plan_dict = plan.to_dict()
    plan_dict["slow_gpus"] = gpus
    action_id = "act-" + hashlib.sha1(f"{incident}|{kind}|{ts:.3f}|{','.join(action_nodes)}".encode()).hexdigest()[:16]
    suspect: dict[str, Any] = {"node": finding.node or (action_nodes[0] if action_nodes else "unknown"),
                               "gpu": finding.gpu, "ranks": slow_ranks, "score": float(finding.confidence),
                               "reason": finding.text}
    evidence = {"ts": float(finding.ts), "source": finding.source, "node": finding.node, "rank": finding.rank,
                "text": finding.text, "figures": dict(finding.figures or {})}
    return Action(id=action_id, incident_id=incident, job=job, ts=ts, type=kind, nodes=action_nodes,
                  suspects=[suspect], evidence=[evidence], confidence=float(finding.confidence),
                  dry_run=bool(dry_run), reason=plan.why, plan=plan_dict)


def _adaptation_config(config: Config | AdaptationConfig | None) -> AdaptationConfig:
    if isinstance(config, Config):
        return config.adaptation
    return config or AdaptationConfig()


__all__ = ["choose_remediation", "plan_for_finding", "shape_from_finding", "speeds_from_finding"]
