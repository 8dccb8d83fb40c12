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

import contextlib
import json
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from faultlens.config import Config
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
from faultlens.datasets.campaign_outcomes import (
    Outcomes,
    code_digest,
    default_cache_dir,
    measure,
    sample_noise,
)
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
    online_extra_s: dict[str, float] = field(default_factory=dict)  # per kind, from the bus check
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
        return PolicyContext(self.spec, self.costs, self.outcomes.by_kind, error_rate, self.online_extra_s)

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
    # the online path first: what it adds per kind is charged on every faultlens decision of the kind.
    # bus_samples < 0: every single-fault kind; 0: only what the bus cache already holds (nothing rendered)
    bus = bus_check(spec, mix, bus_samples, progress=progress, cached_only=bus_samples == 0,
                    cache_dir=measure_kw.get("cache_dir"), use_cache=measure_kw.get("use_cache", True),
                    digest=outcomes.digest)
    extra = online_extra(bus, dwell_kinds=[k.rendered for k in mix.values() if k.fault_class == "hang"],
                         dwell_s=Config().diagnosis.hang_dwell_s)
    ctx = PolicyContext(spec, costs, outcomes.by_kind, online_extra_s=extra)
    results = {p: [simulate_policy(spec, fs, mix, p, ctx, seed=s) for s, fs in zip(seeds, draws, strict=True)]
               for p in POLICIES}
    u0 = spec.get("restart_s") + spec.get("reschedule_s")
    write = float(costs["job"]["checkpoint_write_s"].value)
    analytic = {"rsc_ettr": rsc_analytic_ettr(spec, mix, restart_overhead_s=u0, checkpoint_write_s=write),
                "restart_overhead_s": u0}
    run = CampaignRun(spec, list(seeds), results, outcomes, draws, mix, costs, analytic, bus, extra)
    hard_kinds = [k for k in outcomes.by_kind if k in HARD] if outcomes.hard else []
    if hard_kinds:
        n = min(len(outcomes.by_kind[k]) for k in hard_kinds)
        keep = {k: measure_kw[k] for k in ("workers", "use_cache", "cache_dir") if k in measure_kw}
        run.clean = measure_for(spec, mix, costs, only=hard_kinds, n_min=n, n_max=n, overlap=False,
                                progress=progress, **keep)
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
            ctx = PolicyContext(spec, costs, run.outcomes.by_kind, online_extra_s=run.online_extra_s)
            row[end] = {p: round(float(np.mean([simulate_policy(spec, fs, mix, p, ctx, seed=s).ettr
                                               for s, fs in zip(run.seeds, draws, strict=True)])), 5)
                        for p in policies}
        out.append(row)
        if progress:
            progress(f"{key}: {row['low']} / {row['high']}")
    return out


BUS_SPEED = 20.0  # the bus check replays a render at this many times real time
BUS_FIRST = tuple(k.value for k in (FaultKind.GPU_LOST, FaultKind.HANG_STUCK_RANK, FaultKind.THERMAL_THROTTLE,
                                    FaultKind.USER_EXCEPTION, FaultKind.IB_LINK_PERSISTENT, FaultKind.NAN_LOSS))


def online_extra(pairs: Sequence[tuple[Decision, Decision]], *, dwell_kinds: Iterable[str] = (),
                 dwell_s: float = 0.0) -> dict[str, float]:
    """Per kind: how much later the online path decided than the batch engine on the same render (event
    time, from the onset; negative where the online path is quicker, as a hang whose ranks answer the stack
    request is). Only where both took the same action: a different action is reported, not charged.
    ``dwell_kinds``: kinds decided through a hang, which the live service calls only after ``dwell_s`` of
    wall time; the paced replay waited that divided by its speed (decide_online), so the rest is added."""
    out: dict[str, float] = {}
    dwell = set(dwell_kinds)
    for b, on in pairs:
        if b.action == on.action and b.detect_s is not None and on.detect_s is not None:
            extra = (on.detect_s + on.decide_s) - (b.detect_s + b.decide_s)
            out[b.kind] = round(extra + (dwell_s * (1.0 - 1.0 / BUS_SPEED) if b.kind in dwell else 0.0), 3)
    return out


def _bus_file(cache_dir: Path, digest: str, layout_key: str, nccl_timeout_s: float, kind: str) -> Path:
    return cache_dir / f"{digest}-{layout_key}-t{nccl_timeout_s:g}-bus-{kind}.json"


def bus_check(spec: CampaignSpec, mix: Mapping[str, FailureKind], n: int,
              progress: Callable[[str], None] | None = None, *, cached_only: bool = False, use_cache: bool = True,
              cache_dir: Path | None = None, digest: str = "") -> list[tuple[Decision, Decision]]:
    """Render the first sample of ``n`` kinds (n < 0: every single-fault kind) again and send it through the
    embedded broker to the online DiagnosisService; returns (batch decision, bus decision) pairs. Each pair is
    kept on disk beside the measured renders (keyed by the same code digest); ``cached_only``: only those."""
    classes = {k.rendered: k.fault_class for k in mix.values() if k.rendered not in COMPOUND}  # one fault each
    order = [k for k in BUS_FIRST if k in classes] + sorted(set(classes) - set(BUS_FIRST))
    if n >= 0 and not cached_only:
        order = order[:n]
    layout = spec.slice_layout()
    timeout = spec.get("nccl_timeout_s")
    cache_dir = cache_dir or default_cache_dir()
    digest = digest or code_digest()
    pairs: list[tuple[Decision, Decision]] = []
    broker: EmbeddedBroker | None = None
    with contextlib.ExitStack() as started:  # a broker only when something is rendered
        for kind in order:
            path = _bus_file(cache_dir, digest, layout.key, timeout, kind)
            if use_cache and path.exists():
                try:
                    b, on = (Decision(**d) for d in json.loads(path.read_text()))
                    pairs.append((b, on))
                    continue
                except (ValueError, TypeError):
                    pass  # a torn file from an interrupted run: measured again
            if cached_only:
                continue
            if broker is None:
                broker = started.enter_context(EmbeddedBroker())
            seed, noise = sample_noise(kind, 0)
            r = decide(kind, layout, seed, 0, fault_class=classes[kind], nccl_timeout_s=timeout,
                       job_dp=spec.gpus // (layout.tp * layout.pp), noise=noise)
            online = decide_online(r, bootstrap=broker.bootstrap, speed=BUS_SPEED)
            pairs.append((r.decision, online))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps([r.decision.as_dict(), online.as_dict()]))
            if progress:
                progress(f"bus {kind}: batch {r.decision.action} / bus {online.action}")
    return pairs
