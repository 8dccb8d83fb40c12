"""Whole campaign runs: measure faultlens's outcomes, run every policy on the same draws, sweep, sensitivity.

``run_campaign`` measures (or reads back) faultlens's decisions per rendered kind
(campaign_outcomes.measure), draws the failures of each seed and runs the five
policies on them. ``error_sweep`` re-runs faultlens with a share of its charged
decisions made wrong (on top of its own measured mistakes) and ``crossover``
finds where it meets each baseline; ``sensitivity`` moves every figure marked
assumed in the two TOML files over its range; ``bus_check`` sends a few renders
through the embedded broker to the online service.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from faultlens.datasets.campaign import (
    CAUSES,
    POLICIES,
    STOPPED,
    CampaignSpec,
    Cost,
    Failure,
    FailureKind,
    PolicyContext,
    PolicyResult,
    assumed_figures,
    draw_failures,
    load_costs,
    load_mix,
)
from faultlens.datasets.campaign_compound import COMPOUND
from faultlens.datasets.campaign_hard import HARD
from faultlens.datasets.campaign_outcomes import Outcomes, measure, sample_noise
from faultlens.datasets.campaign_policies import simulate_policy
from faultlens.datasets.campaign_render import Decision, decide, decide_online
from faultlens.stream.bus.embedded_broker import EmbeddedBroker
from faultlens.vocabulary import FaultKind

SWEEP_RATES: tuple[float, ...] = (0.0, 0.05, 0.10, 0.15, 0.20, 0.25, 0.30)


def rsc_analytic_ettr(spec: CampaignSpec, mix: Mapping[str, FailureKind], *, restart_overhead_s: float,
                      checkpoint_write_s: float = 0.0) -> float:
    """Meta RSC's first-order ETTR estimate for the same job (papers.md 3.8).

    ETTR ~= 1 - (u0 + Delta/2) / MTTF - w_cp / Delta, with MTTF = 1 / (job-stopping failure rate),
    u0 the restart overhead, Delta the checkpoint interval and w_cp the checkpoint write time.
    Fail-slow and flaps are outside this model, as in RSC's.
    """
    stop_rate = sum(k.rate_per_mgpuh for k in mix.values() if k.fault_class in STOPPED)
    per_s = stop_rate * 1e-6 * spec.gpus / 3600.0  # job-stopping failures per second of wall-clock
    delta = spec.get("checkpoint_interval_s")
    return max(0.0, 1.0 - per_s * (restart_overhead_s + delta / 2.0) - checkpoint_write_s / delta)


@dataclass
class CampaignRun:
    spec: CampaignSpec
    seeds: list[int]
    results: dict[str, list[PolicyResult]]
    outcomes: Outcomes
    draws: list[list[Failure]]
    mix: dict[str, FailureKind]
    costs: Mapping[str, Mapping[str, Cost]]
    analytic: dict[str, float]
    bus: list[tuple[Decision, Decision]] = field(default_factory=list)
    clean: Outcomes | None = None  # hard runs: the clean decisions of the same renders of the hard kinds

    @property
    def failures_per_seed(self) -> list[int]:
        return [len(d) for d in self.draws]

    def ettr(self, policy: str) -> tuple[float, float, float, float]:
        """(mean, std, min, max) over seeds."""
        v = np.array([r.ettr for r in self.results[policy]])
        return float(v.mean()), float(v.std()), float(v.min()), float(v.max())

    def lost_mean(self, policy: str) -> dict[str, float]:
        rs = self.results[policy]
        return {c: float(np.mean([r.lost_by_cause[c] for r in rs])) for c in CAUSES}

    def context(self, error_rate: float = 0.0) -> PolicyContext:
        return PolicyContext(self.spec, self.costs, self.outcomes.by_kind, error_rate)

    def policy_mean(self, policy: str, ctx: PolicyContext) -> float:
        return float(np.mean([simulate_policy(self.spec, fs, self.mix, policy, ctx, seed=s).ettr
                              for s, fs in zip(self.seeds, self.draws, strict=True)]))


def measure_for(spec: CampaignSpec, mix: Mapping[str, FailureKind], costs: Mapping[str, Mapping[str, Cost]], *,
                half_width: float = 0.05, n_min: int = 40, n_max: int = 200, workers: int = 1,
                use_cache: bool = True, cached_only: bool = False, overlap: bool = True, hard: bool = False,
                only: Collection[str] | None = None, cache_dir: Path | None = None,
                progress: Callable[[str], None] | None = None) -> Outcomes:
    """faultlens's measured decisions for every rendered kind of the mix (or ``only`` these), on the job's slice;
    ``hard``: the hard kinds from their hard renders (campaign_hard)."""
    layout = spec.slice_layout()
    kinds = {k.rendered: k.fault_class for k in mix.values()}
    if overlap and any(k.machine_fault and k.fault_class in STOPPED for k in mix.values()):
        kinds["overlap"] = "fail_stop"  # a second machine fault while the first is handled (campaign_compound)
    if only is not None:
        kinds = {k: c for k, c in kinds.items() if k in only}
    late = float(costs["job"]["late_after_s"].value)
    return measure(kinds, layout, nccl_timeout_s=spec.get("nccl_timeout_s"),
                   job_dp=spec.gpus // (layout.tp * layout.pp), late_after_s=late, half_width=half_width,
                   n_min=n_min, n_max=n_max, workers=workers, use_cache=use_cache, cached_only=cached_only,
                   hard=hard, cache_dir=cache_dir, progress=progress)


def run_campaign(spec: CampaignSpec, *, seeds: Sequence[int] = (0, 1, 2),
                 mix: Mapping[str, FailureKind] | None = None, costs: Mapping[str, Mapping[str, Cost]] | None = None,
                 outcomes: Outcomes | None = None, bus_samples: int = 0,
                 progress: Callable[[str], None] | None = None, **measure_kw: Any) -> CampaignRun:
    """Measure faultlens's outcomes (unless given), draw failures per seed, run every policy.

    ``hard=True`` (in ``measure_kw``): faultlens is charged from the hard renders of the hard kinds, and the
    clean decisions of the same renders (same kind, same i) are measured beside them for the comparison."""
    costs = costs or load_costs()
    mix = dict(mix or load_mix())
    spec = spec.resolved(costs)
    if outcomes is None:
        outcomes = measure_for(spec, mix, costs, progress=progress, **measure_kw)
    draws = [draw_failures(spec, mix, s) for s in seeds]
    ctx = PolicyContext(spec, costs, outcomes.by_kind)
    results = {p: [simulate_policy(spec, fs, mix, p, ctx, seed=s) for s, fs in zip(seeds, draws, strict=True)]
               for p in POLICIES}
    u0 = spec.get("restart_s") + spec.get("reschedule_s")
    write = float(costs["job"]["checkpoint_write_s"].value)
    analytic = {"rsc_ettr": rsc_analytic_ettr(spec, mix, restart_overhead_s=u0, checkpoint_write_s=write),
                "restart_overhead_s": u0}
    run = CampaignRun(spec, list(seeds), results, outcomes, draws, mix, costs, analytic)
    hard_kinds = [k for k in outcomes.by_kind if k in HARD] if outcomes.hard else []
    if hard_kinds:
        n = min(len(outcomes.by_kind[k]) for k in hard_kinds)
        keep = {k: measure_kw[k] for k in ("workers", "use_cache", "cache_dir") if k in measure_kw}
        run.clean = measure_for(spec, mix, costs, only=hard_kinds, n_min=n, n_max=n, overlap=False,
                                progress=progress, **keep)
    if bus_samples:
        run.bus = bus_check(spec, mix, bus_samples, progress=progress)
    return run


def error_sweep(run: CampaignRun, rates: Sequence[float] = SWEEP_RATES) -> list[tuple[float, float]]:
    """(rate, faultlens ETTR mean) with ``rate`` of its charged decisions made wrong on top of its own
    measured mistakes (the same failures are made wrong at every rate: a failure wrong at 10% is
    wrong at 20%)."""
    return [(r, run.policy_mean("faultlens", run.context(r))) for r in rates]


def crossover(sweep: Sequence[tuple[float, float]], baseline: float) -> float | None:
    """The error rate at which faultlens's ETTR meets ``baseline`` (linear between sweep points);
    None when it stays above it over the whole sweep, 0.0 when it starts below."""
    if sweep[0][1] <= baseline:
        return 0.0
    for (r0, e0), (r1, e1) in zip(sweep, sweep[1:], strict=False):
        if e1 <= baseline:
            return r0 + (r1 - r0) * (e0 - baseline) / (e0 - e1) if e0 != e1 else r1
    return None


def sensitivity(run: CampaignRun, policies: Sequence[str] = ("faultlens", "group_evict", "none", "restart"),
                progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Every assumed figure at the two ends of its range: each policy's ETTR there (same draws'
    seeds and faultlens's same measured outcomes; the mix figures redraw the failures)."""
    out = []
    for key, value, (lo, hi), source in assumed_figures():
        row: dict[str, Any] = {"figure": key, "value": value, "range": [lo, hi], "source": source}
        for end, v in (("low", lo), ("high", hi)):
            costs = load_costs(overrides={key: v}) if not key.startswith(("kind.", "category.")) else run.costs
            mix = load_mix(overrides={key: v}, kinds=list(run.mix)) if key.startswith(("kind.", "category.")) \
                else run.mix
            name = key.rsplit(".", 1)[1]
            fields: dict[str, Any] = {name: int(v) if name == "warm_standbys" else v}
            spec = replace(run.spec, **fields) if key.startswith("job.") and hasattr(run.spec, name) else run.spec
            draws = [draw_failures(spec, mix, s) for s in run.seeds] if mix is not run.mix else run.draws
            ctx = PolicyContext(spec, costs, run.outcomes.by_kind)
            row[end] = {p: round(float(np.mean([simulate_policy(spec, fs, mix, p, ctx, seed=s).ettr
                                               for s, fs in zip(run.seeds, draws, strict=True)])), 5)
                        for p in policies}
        out.append(row)
        if progress:
            progress(f"{key}: {row['low']} / {row['high']}")
    return out


BUS_FIRST = tuple(k.value for k in (FaultKind.GPU_LOST, FaultKind.HANG_STUCK_RANK, FaultKind.THERMAL_THROTTLE,
                                    FaultKind.USER_EXCEPTION, FaultKind.IB_LINK_PERSISTENT, FaultKind.NAN_LOSS))


def bus_check(spec: CampaignSpec, mix: Mapping[str, FailureKind], n: int,
              progress: Callable[[str], None] | None = None) -> list[tuple[Decision, Decision]]:
    """Render the first sample of ``n`` kinds again and send it through the embedded broker to the
    online DiagnosisService; returns (batch decision, bus decision) pairs."""

    classes = {k.rendered: k.fault_class for k in mix.values() if k.rendered not in COMPOUND}  # one fault each
    order = [k for k in BUS_FIRST if k in classes] + sorted(set(classes) - set(BUS_FIRST))
    layout = spec.slice_layout()
    pairs: list[tuple[Decision, Decision]] = []
    with EmbeddedBroker() as broker:
        for kind in order[:n]:
            seed, noise = sample_noise(kind, 0)
            r = decide(kind, layout, seed, 0, fault_class=classes[kind], nccl_timeout_s=spec.get("nccl_timeout_s"),
                       job_dp=spec.gpus // (layout.tp * layout.pp), noise=noise)
            online = decide_online(r, bootstrap=broker.bootstrap)
            pairs.append((r.decision, online))
            if progress:
                progress(f"bus {kind}: batch {r.decision.action} / bus {online.action}")
    return pairs
