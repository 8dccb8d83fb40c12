"""A training campaign: one long job, failures from a published mix, five ways of handling them, ETTR.

The question it answers: how much training time does faultlens give back,
compared with what teams do today? One job (default 9,600 GPUs, 70B-dense
layout, 90 days) meets failures drawn from ``failure_mix.toml`` (Llama 3 and
ByteRobust rates, with sources). The same draw is handled by five policies
(``POLICIES``): nobody watching, blind automatic restart, ByteRobust-style group
over-eviction, faultlens, and an oracle. Every cost and its source is in
``campaign_costs.toml``; faultlens's own delays, actions and evicted machines
come from rendering each failure's signals on a slice of the job and diagnosing
them with the real engine (``campaign_render``), cached per (kind, slice, seed
bucket).

The timeline (``Timeline``) is a list of segments ``(start, end, rate, cause)``:
``rate`` is the productive fraction of wall-clock (1 healthy, 0 stopped, in
between when slow) and ``cause`` names where the rest went (``CAUSES``). Per
failure it charges, in order: detection, localisation (the decision or the
person), waiting for machines when the warm standbys are gone, restart (with
reschedule when machines change), recompute of the work since the last
checkpoint; a fault left unfixed recurs after ``recur_after_s`` of running and
everything it costs then is "recurrence"; a slow machine costs throughput
("degraded") until it is adapted around or evicted, or its episode ends.
Failures that arrive while the job is still recovering wait until it runs.

ETTR = productive time / wall-clock (BR 8.1.3, after Meta RSC). Meta RSC's
analytic estimate for the same parameters (``rsc_analytic_ettr``) sits beside it.
"""

from __future__ import annotations

import heapq
import math
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from faultlens.datasets.campaign_render import Decision, SliceLayout, decide, decide_online
from faultlens.datasets.faults import FAULTS
from faultlens.stream.bus.embedded_broker import EmbeddedBroker
from faultlens.vocabulary import ActionType, FaultKind, IncidentKind

A = ActionType
MIX_PATH = Path(__file__).with_name("failure_mix.toml")
COSTS_PATH = Path(__file__).with_name("campaign_costs.toml")
POLICIES: tuple[str, ...] = ("none", "restart", "group_evict", "faultlens", "oracle")
CAUSES: tuple[str, ...] = ("detection", "localisation", "standby_wait", "restart", "recompute", "recurrence",
                           "degraded")
# how a failure class costs time (failure_mix.toml "class"); hang and fail_slow are the incident kinds of that name
FAULT_CLASSES = ("fail_stop", IncidentKind.HANG.value, "nan", IncidentKind.FAIL_SLOW.value, "transient")
# (tp, pp, layers, micro-batches per replica): the layouts a campaign can name
LAYOUTS: dict[str, tuple[int, int, int, int]] = {
    "70b-dense": (8, 8, 80, 16),  # BR Table 5: 70B TP8 PP8 (DP = GPUs / 64)
    "405b-dense": (8, 16, 128, 16),  # Llama 3 405B: TP8 PP16
    "8b-dense": (8, 1, 32, 8),  # one node per replica
}


# --------------------------------------------------------------------------- tables


@dataclass(frozen=True)
class FailureKind:
    """One row of failure_mix.toml."""

    name: str
    rate_per_mgpuh: float
    fault_class: str
    recur_after_s: float
    machine_fault: bool
    source: str
    episode_mean_s: float = 0.0
    outage_s: float = 0.0
    restart_fixes: bool = False
    job_wide: bool = False


@dataclass(frozen=True)
class Cost:
    value: float | str
    source: str


def load_mix(path: str | Path | None = None, kinds: Iterable[str] | None = None) -> dict[str, FailureKind]:
    """failure_mix.toml -> kind -> FailureKind; ``kinds`` keeps only those (a ValueError names unknown ones)."""

    p = Path(path) if path else MIX_PATH
    raw = tomllib.loads(p.read_text())
    out: dict[str, FailureKind] = {}
    for name, row in raw.get("kind", {}).items():
        where = f"{p}: [kind.{name}]"
        if name not in FAULTS:
            raise ValueError(f"{where}: no simulator fault kind {name!r}")
        if row.get("class") not in FAULT_CLASSES:
            raise ValueError(f"{where}: class must be one of {FAULT_CLASSES}, got {row.get('class')!r}")
        try:
            out[name] = FailureKind(name=name, rate_per_mgpuh=float(row["rate_per_mgpuh"]), fault_class=row["class"],
                                    recur_after_s=float(row["recur_after_s"]), machine_fault=bool(row["machine_fault"]),
                                    source=str(row["source"]), episode_mean_s=float(row.get("episode_mean_s", 0.0)),
                                    outage_s=float(row.get("outage_s", 0.0)),
                                    restart_fixes=bool(row.get("restart_fixes", False)),
                                    job_wide=bool(row.get("job_wide", False)))
        except KeyError as exc:
            raise ValueError(f"{where}: missing {exc.args[0]!r}") from None
    if kinds is not None:
        wanted = list(kinds)
        unknown = [k for k in wanted if k not in out]
        if unknown:
            raise ValueError(f"{p}: no failure kind {', '.join(unknown)} (have {', '.join(sorted(out))})")
        out = {k: out[k] for k in wanted}
    return out


def load_costs(path: str | Path | None = None) -> dict[str, dict[str, Cost]]:
    """campaign_costs.toml -> section ("job", "policy.none", ...) -> name -> Cost."""
    p = Path(path) if path else COSTS_PATH
    raw = tomllib.loads(p.read_text())
    out: dict[str, dict[str, Cost]] = {"job": {}}
    for name, c in raw.get("job", {}).items():
        out["job"][name] = Cost(c["value"], c["source"])
    for pol, table in raw.get("policy", {}).items():
        if pol not in POLICIES:
            raise ValueError(f"{p}: [policy.{pol}] is not one of {POLICIES}")
        out[f"policy.{pol}"] = {k: Cost(v["value"], v["source"]) for k, v in table.items() if isinstance(v, dict)}
    return out


def cost_rows(costs: Mapping[str, Mapping[str, Cost]]) -> list[tuple[str, str, str, str]]:
    """(section, name, value, source) for printing the one table of costs."""
    return [(sec, name, str(c.value), c.source) for sec, table in costs.items() for name, c in table.items()]


def _num(costs: Mapping[str, Mapping[str, Cost]], section: str, name: str) -> float:
    c = costs[section][name].value
    if isinstance(c, str):
        raise ValueError(f"campaign costs [{section}] {name} is {c!r}, not a number")
    return float(c)


# --------------------------------------------------------------------------- the campaign


@dataclass(frozen=True)
class CampaignSpec:
    """One job and its platform. Costs left None come from campaign_costs.toml [job]."""

    gpus: int = 9600
    gpus_per_node: int = 8
    layout: str = "70b-dense"
    days: float = 90.0
    checkpoint_interval_s: float | None = None
    restart_s: float | None = None
    reschedule_s: float | None = None
    warm_standbys: int | None = None
    healthy_return_s: float | None = None
    repair_s: float | None = None
    nccl_timeout_s: float | None = None

    @property
    def duration_s(self) -> float:
        return self.days * 86400.0

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    @property
    def shape(self) -> tuple[int, int, int, int]:
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r} (have {', '.join(LAYOUTS)})")
        return LAYOUTS[self.layout]

    @property
    def nodes_per_replica(self) -> int:
        tp, pp, _, _ = self.shape
        return max(1, tp * pp // self.gpus_per_node)

    def slice_layout(self) -> SliceLayout:
        """The culprit's replica and enough peers (>= 2 replicas, >= 4 machines) for peer comparisons."""
        tp, pp, layers, mb = self.shape
        dp_job = self.gpus // (tp * pp)
        if dp_job < 1 or self.gpus % (tp * pp):
            raise ValueError(f"{self.gpus} GPUs do not divide into the {self.layout} layout (tp={tp} pp={pp})")
        dp = min(dp_job, max(2, math.ceil(4 / self.nodes_per_replica)))
        return SliceLayout(self.gpus_per_node, tp, pp, dp, layers, mb)

    def resolved(self, costs: Mapping[str, Mapping[str, Cost]]) -> CampaignSpec:
        """The spec with every None cost filled from the [job] table."""
        fill: dict[str, Any] = {}
        for name in ("checkpoint_interval_s", "restart_s", "reschedule_s", "healthy_return_s", "repair_s",
                     "nccl_timeout_s"):
            if getattr(self, name) is None:
                fill[name] = _num(costs, "job", name)
        if self.warm_standbys is None:
            fill["warm_standbys"] = int(_num(costs, "job", "warm_standbys"))
        return replace(self, **fill)

    def get(self, name: str) -> float:
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"campaign spec {name} is unresolved (call resolved(costs))")
        return float(value)


@dataclass(frozen=True)
class Failure:
    """One failure of the draw, shared by every policy."""

    t: float  # seconds into the campaign
    kind: str
    bucket: int  # which rendered sample of this kind decides it
    u_localise: float  # uniform(0, 1): where in the by-hand localisation range this one falls
    episode_s: float  # fail_slow: how long it lasts if nothing is done


def draw_failures(spec: CampaignSpec, mix: Mapping[str, FailureKind], seed: int, buckets: int) -> list[Failure]:
    """Poisson arrivals per kind over the campaign, time-ordered (seeded)."""
    rng = np.random.default_rng([seed, 25])
    gpu_hours = spec.gpus * spec.duration_s / 3600.0
    out: list[Failure] = []
    for name in sorted(mix):
        k = mix[name]
        n = int(rng.poisson(k.rate_per_mgpuh * 1e-6 * gpu_hours))
        times = rng.uniform(0.0, spec.duration_s, n)
        for t in times:
            episode = 0.0
            if k.fault_class == "fail_slow":
                sigma = 1.0  # log-normal with the table's mean: mu = ln(mean) - sigma^2 / 2
                episode = float(rng.lognormal(math.log(k.episode_mean_s) - sigma**2 / 2, sigma))
            out.append(Failure(t=float(t), kind=name, bucket=int(rng.integers(0, buckets)),
                               u_localise=float(rng.random()), episode_s=episode))
    out.sort(key=lambda f: (f.t, f.kind))
    return out


# --------------------------------------------------------------------------- what a policy does


@dataclass(frozen=True)
class Attempt:
    """One try at a failure: what it costs before the restart and what it does.

    ``action``: evict | restart | rollback | adapt | none | best (the oracle's cheaper of evicting
    and riding out a slow machine). ``detect_s`` None: never noticed.
    """

    detect_s: float | None
    localise_s: float
    action: str
    machines: int = 0  # machines taken out (they need standbys)
    faulty_out: bool = False  # the culprit is among them (it goes to repair, not back to the pool)
    fixed: bool = True
    adapt_ratio: float = 1.0
    adapt_pause_s: float = 0.0


Policy = Callable[[Failure, FailureKind], list[Attempt]]


@dataclass
class PolicyContext:
    """What the policies read: costs, the job's group size, faultlens's decisions."""

    spec: CampaignSpec
    costs: Mapping[str, Mapping[str, Cost]]
    decisions: Mapping[tuple[str, int], Decision]

    def c(self, policy: str, name: str) -> float:
        return _num(self.costs, f"policy.{policy}", name)

    def job(self, name: str) -> float:
        return _num(self.costs, "job", name)


def _fix(k: FailureKind) -> tuple[str, int]:
    """The right action once the culprit is known: (action, machines out)."""
    if k.machine_fault:
        return "evict", 1
    if k.name == "user_exception":
        return "rollback", 0
    return "restart", 0


def human(ctx: PolicyContext, f: Failure, k: FailureKind) -> list[Attempt]:
    """Policy (a): people watching the job."""
    lo, hi = ctx.c("none", "localise_min_s"), ctx.c("none", "localise_max_s")
    by_hand = lo + f.u_localise * (hi - lo)
    if k.fault_class in ("fail_slow", "transient"):
        return [Attempt(None, 0.0, "none", fixed=False)]
    action, machines = _fix(k)
    if k.fault_class == "nan":
        return [Attempt(ctx.c("none", "crash_detect_s"), ctx.job("nan_manual_s"), "restart")]
    detect = ctx.c("none", "hang_detect_s") if k.fault_class == "hang" else ctx.c("none", "crash_detect_s")
    return [Attempt(detect, by_hand, action, machines, faulty_out=machines > 0)]


def blind_restart(ctx: PolicyContext, f: Failure, k: FailureKind) -> list[Attempt]:
    """Policy (b): restart whatever stopped, no localisation; people take over if it comes back."""
    if k.fault_class in ("fail_slow", "transient"):
        return [Attempt(None, 0.0, "none", fixed=False)]
    detect = ctx.c("restart", "hang_detect_s") if k.fault_class == "hang" else ctx.c("restart", "crash_detect_s")
    tries = [Attempt(detect, 0.0, "restart", fixed=k.restart_fixes)]
    if k.restart_fixes:
        return tries
    for _ in range(int(ctx.c("restart", "blind_restarts")) - 1):
        tries.append(Attempt(detect, 0.0, "restart", fixed=False))
    return tries + human(ctx, f, k)


def group_evict(ctx: PolicyContext, f: Failure, k: FailureKind) -> list[Attempt]:
    """Policy (c): ByteRobust-style inspection; a machine for explicit faults, the PP group for implicit ones."""
    p = "group_evict"
    group = ctx.spec.nodes_per_replica
    if k.fault_class == "transient":
        return [Attempt(None, 0.0, "none", fixed=False)]  # one flap: tolerated (2 alerts in 5 min to evict)
    if k.fault_class == "nan":
        return [Attempt(ctx.c(p, "crash_detect_s"), ctx.job("nan_resolution_s"), "restart")]
    if k.fault_class == "fail_slow":
        if k.job_wide:  # every rank alike: aggregation finds no odd group
            return [Attempt(None, 0.0, "none", fixed=False)]
        return [Attempt(ctx.c(p, "failslow_detect_s"), ctx.c(p, "aggregation_s"), "evict", group, faulty_out=True)]
    if k.fault_class == "hang":
        return [Attempt(ctx.c(p, "hang_detect_s"), ctx.c(p, "aggregation_s"), "evict", group, faulty_out=True)]
    if k.name == "user_exception":
        return [Attempt(ctx.c(p, "crash_detect_s"), 0.0, "rollback")]
    if not k.machine_fault:
        return [Attempt(ctx.c(p, "kernel_detect_s"), 0.0, "restart", fixed=k.restart_fixes)] + (
            [] if k.restart_fixes else human(ctx, f, k))
    detect = ctx.c(p, "network_detect_s") if k.name.startswith("ib_") else ctx.c(p, "gpu_detect_s")
    return [Attempt(detect, ctx.c(p, "localise_s"), "evict", 1, faulty_out=True)]


def oracle(ctx: PolicyContext, f: Failure, k: FailureKind) -> list[Attempt]:
    """Policy (e): knows at once what broke and does the right thing."""
    if k.fault_class == "transient" or (k.fault_class == "fail_slow" and k.job_wide):
        return [Attempt(None, 0.0, "none", fixed=False)]
    if k.fault_class == "fail_slow":  # the cheapest of evicting, riding it out and faultlens's plan (if any)
        d = ctx.decisions.get((f.kind, f.bucket))
        ratio = d.adapt_ratio if d is not None and d.adapt_ratio is not None and d.culprit_named else 1.0
        return [Attempt(0.0, 0.0, "best", 1, faulty_out=True, adapt_ratio=ratio,
                        adapt_pause_s=d.adapt_pause_s if d is not None else 0.0)]
    action, machines = _fix(k)
    return [Attempt(0.0, 0.0, action, machines, faulty_out=machines > 0)]


def faultlens(ctx: PolicyContext, f: Failure, k: FailureKind) -> list[Attempt]:
    """Policy (d): what the engine decided on this failure's rendered signals.

    Right: the action is taken. Missing on a stopped job: the runner's default restart, then
    people. Wrong: the fault recurs once, then people take over.
    """
    d = ctx.decisions[(f.kind, f.bucket)]
    stopped = k.fault_class in ("fail_stop", "hang", "nan")
    act = d.action
    if act in ("none", A.NOTIFY) or d.detect_s is None:
        if stopped:
            return blind_restart(ctx, f, k)
        return [Attempt(None, 0.0, "none", fixed=False)]
    detect, decide = d.detect_s, d.decide_s
    out = {"faulty_out": d.culprit_named}
    if act == A.ADAPT_PARALLELISM and k.fault_class == "fail_slow":
        first = Attempt(detect, decide, "adapt", fixed=d.culprit_named, adapt_ratio=d.adapt_ratio or 1.0,
                        adapt_pause_s=d.adapt_pause_s)
    elif act in (A.EVICT_NODES, A.ADAPT_PARALLELISM):
        fixed = (d.culprit_named and k.machine_fault) or k.restart_fixes
        first = Attempt(detect, decide, "evict", d.named, fixed=fixed, **out)
    elif act == A.RUN_DIAGNOSTICS:
        check = ctx.job("nan_resolution_s") if k.fault_class == "nan" else ctx.job("stop_time_check_s")
        action, machines = _fix(k)  # stop-time checks find the culprit (BR 4.2)
        first = Attempt(detect, decide + check, action, machines, faulty_out=machines > 0)
    elif act == A.ROLLBACK_CODE:
        first = Attempt(detect, decide, "rollback", fixed=k.name == "user_exception" or k.restart_fixes)
    else:  # restart_job
        first = Attempt(detect, decide, "restart", fixed=k.restart_fixes or d.right)
    if first.fixed or not stopped:
        return [first]
    return [first] + human(ctx, f, k)


POLICY_FUNCS: dict[str, Callable[[PolicyContext, Failure, FailureKind], list[Attempt]]] = {
    "none": human, "restart": blind_restart, "group_evict": group_evict, "faultlens": faultlens, "oracle": oracle,
}


# --------------------------------------------------------------------------- the timeline


@dataclass
class Timeline:
    """Segments of the campaign and the state that prices the next failure."""

    spec: CampaignSpec
    segments: list[tuple[float, float, float, str]] = field(default_factory=list)
    now: float = 0.0
    anchor: float = 0.0  # when the job last resumed from a checkpoint (checkpoints every interval after)
    pool: int = 0
    returning: list[float] = field(default_factory=list)  # heap: when evicted machines rejoin the pool
    waits: int = 0
    machines_out: int = 0
    requeue_s: float = float("inf")  # cold machines from the cluster (None in the costs: wait for returns)

    def __post_init__(self) -> None:
        self.pool = int(self.spec.get("warm_standbys"))

    def seg(self, dur: float, rate: float, cause: str) -> None:
        if dur <= 0:
            return
        self.segments.append((self.now, self.now + dur, rate, cause))
        self.now += dur

    def run_until(self, t: float) -> None:
        if t > self.now:
            self.seg(t - self.now, 1.0, "productive")

    def lost_work(self) -> float:
        """Running time since the last checkpoint (checkpoints every interval after the last resume)."""
        return (self.now - self.anchor) % self.spec.get("checkpoint_interval_s")

    def take(self, machines: int, faulty: bool, cause: str) -> None:
        """Swap ``machines`` out for warm standbys. When the pool is short, wait for evicted machines to
        come back (healthy ones after their checks, the faulty one after repair) or for cold machines
        from the cluster (a requeue), whichever is sooner."""
        if machines <= 0:
            return
        self.machines_out += machines
        cap = int(self.spec.get("warm_standbys"))
        while self.returning and self.returning[0] <= self.now:
            heapq.heappop(self.returning)
            self.pool = min(cap, self.pool + 1)
        for _ in range(machines - (1 if faulty else 0)):
            heapq.heappush(self.returning, self.now + self.spec.get("healthy_return_s"))
        if faulty:
            heapq.heappush(self.returning, self.now + self.spec.get("repair_s"))
        short = machines - self.pool
        if short <= 0:
            self.pool -= machines
            return
        self.waits += 1
        self.pool = 0
        back = heapq.nsmallest(short, self.returning)[-1] - self.now
        if back <= self.requeue_s:
            for _ in range(short):
                heapq.heappop(self.returning)
        self.seg(min(back, self.requeue_s), 0.0, cause if cause == "recurrence" else "standby_wait")

    def restart(self, machines: int, cause: str) -> None:
        """Restart from the last checkpoint, then recompute what was lost."""
        lost = self.lost_work()
        self.seg(self.spec.get("restart_s") + (self.spec.get("reschedule_s") if machines else 0.0), 0.0,
                 cause if cause == "recurrence" else "restart")
        self.anchor = self.now
        self.seg(lost, 0.0, cause if cause == "recurrence" else "recompute")

    def stop(self, k: FailureKind, attempts: Sequence[Attempt]) -> None:
        """A stopped job (crash, hang, NaN): each attempt's costs; an unfixed one recurs."""
        for i, a in enumerate(attempts):
            rec = i > 0
            lost = self.lost_work()
            self.seg(a.detect_s or 0.0, 0.0, "recurrence" if rec else "detection")
            self.seg(a.localise_s, 0.0, "recurrence" if rec else "localisation")
            self.take(a.machines, a.faulty_out, "recurrence" if rec else "standby_wait")
            self.seg(self.spec.get("restart_s") + (self.spec.get("reschedule_s") if a.machines else 0.0), 0.0,
                     "recurrence" if rec else "restart")
            self.anchor = self.now
            self.seg(lost, 0.0, "recurrence" if rec else "recompute")
            if a.fixed or i == len(attempts) - 1:
                return
            # the fault is still there: the job runs recur_after_s, then it stops again
            self.seg(k.recur_after_s, 1.0, "productive")

    def slow(self, k: FailureKind, f: Failure, a: Attempt, speed: float) -> None:
        """A slow machine: degraded until detected and adapted around or evicted, or its episode ends."""
        episode = f.episode_s
        seen = None if a.detect_s is None else a.detect_s + a.localise_s
        if a.action == "best":  # the oracle: evict now, adapt now, or ride it out, whichever costs least
            options = {"evict": self.spec.get("restart_s") + self.spec.get("reschedule_s") + self.lost_work(),
                       "none": (1.0 - speed) * episode}
            if a.adapt_ratio < 1.0:
                options["adapt"] = a.adapt_pause_s + (1.0 - max(speed, a.adapt_ratio)) * episode
            best = min(options, key=lambda o: options[o])
            a = replace(a, action=best if best != "evict" else "best")
            seen = None if best == "none" else 0.0
        if seen is None or seen >= episode or a.action == "none":
            self.seg(episode, speed, "degraded")
            return
        self.seg(seen, speed, "degraded")
        left = episode - seen
        if a.action == "adapt" and a.fixed:
            ratio = max(speed, min(1.0, a.adapt_ratio))
            self.seg(min(a.adapt_pause_s, left), 0.0, "restart")
            self.seg(max(0.0, left - a.adapt_pause_s), ratio, "degraded")
        elif a.action in ("evict", "best"):
            t0 = self.now
            self.take(a.machines, a.faulty_out, "standby_wait")
            self.restart(a.machines, "restart")
            if not a.fixed:  # the wrong machines went: the slow one is still there
                self.seg(max(0.0, left - (self.now - t0)), speed, "degraded")
        else:
            self.seg(left, speed, "degraded")

    def transient(self, k: FailureKind, a: Attempt) -> None:
        """A flap that recovers: one stalled step; evicting for it is a restart for nothing."""
        self.seg(k.outage_s, 0.0, "degraded")
        if a.action == "evict" and a.detect_s is not None:
            self.seg(a.detect_s + a.localise_s, 0.0, "detection")
            self.take(a.machines, False, "standby_wait")
            self.restart(a.machines, "restart")


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    seed: int
    ettr: float
    lost_by_cause: dict[str, float]
    failures: int
    deferred: int  # failures that arrived while the job was still recovering
    dropped: int  # deferred past the end of the campaign
    wrong: int  # attempts that did not fix the fault (faultlens: wrong or missing decisions)
    machines_out: int
    standby_waits: int
    segments: list[tuple[float, float, float, str]]

    def sliding_ettr(self, window_s: float = 3600.0, step_s: float = 600.0) -> tuple[np.ndarray, np.ndarray]:
        """(window end times, ETTR over the window before each): BR's one-hour sliding ETTR."""
        return sliding_ettr(self.segments, window_s, step_s)


def sliding_ettr(segments: Sequence[tuple[float, float, float, str]], window_s: float = 3600.0,
                 step_s: float = 600.0) -> tuple[np.ndarray, np.ndarray]:
    if not segments:
        return np.zeros(0), np.zeros(0)
    t = np.array([segments[0][0]] + [s[1] for s in segments])
    cum = np.concatenate([[0.0], np.cumsum([(s[1] - s[0]) * s[2] for s in segments])])
    ends = np.arange(segments[0][0] + window_s, t[-1] + 1e-9, step_s)
    return ends, (np.interp(ends, t, cum) - np.interp(ends - window_s, t, cum)) / window_s


def simulate_policy(spec: CampaignSpec, failures: Sequence[Failure], mix: Mapping[str, FailureKind],
                    policy: str, ctx: PolicyContext, *, seed: int = 0) -> PolicyResult:
    """One policy over one failure draw: the timeline, ETTR and the unproductive time by cause."""
    handle = POLICY_FUNCS[policy]
    tl = Timeline(spec, requeue_s=ctx.job("requeue_s") if "requeue_s" in ctx.costs["job"] else float("inf"))
    end = spec.duration_s
    deferred = dropped = wrong = handled = 0
    for f in failures:
        if f.t >= end:
            continue
        if tl.now >= end:
            dropped += 1
            continue
        deferred += f.t < tl.now
        tl.run_until(f.t)
        k = mix[f.kind]
        attempts = handle(ctx, f, k)
        wrong += sum(not a.fixed for a in attempts if k.fault_class in ("fail_stop", "hang", "nan"))
        handled += 1
        if k.fault_class in ("fail_stop", "hang", "nan"):
            tl.stop(k, attempts)
        elif k.fault_class == "fail_slow":
            d = ctx.decisions.get((f.kind, f.bucket))
            tl.slow(k, f, attempts[0], d.slow_speed if d is not None else 1.0)
        else:
            tl.transient(k, attempts[0])
    tl.run_until(end)
    clipped = [(s, min(e, end), r, c) for s, e, r, c in tl.segments if s < end]
    lost = {c: 0.0 for c in CAUSES}
    productive = 0.0
    for s, e, r, c in clipped:
        productive += (e - s) * r
        if r < 1.0:
            lost[c] = lost.get(c, 0.0) + (e - s) * (1.0 - r)
    return PolicyResult(policy=policy, seed=seed, ettr=productive / end, lost_by_cause=lost, failures=handled,
                        deferred=deferred, dropped=dropped, wrong=wrong, machines_out=tl.machines_out,
                        standby_waits=tl.waits, segments=clipped)


def rsc_analytic_ettr(spec: CampaignSpec, mix: Mapping[str, FailureKind], *, restart_overhead_s: float,
                      checkpoint_write_s: float = 0.0) -> float:
    """Meta RSC's first-order ETTR estimate for the same job (papers.md 3.8).

    ETTR ~= 1 - (u0 + Delta/2) / MTTF - w_cp / Delta, with MTTF = 1 / (job-stopping failure rate),
    u0 the restart overhead, Delta the checkpoint interval and w_cp the checkpoint write time
    (the simulation charges no write time: pass 0 to compare like with like). Fail-slow and flaps
    are outside this model, as in RSC's.
    """
    stop_rate = sum(k.rate_per_mgpuh for k in mix.values() if k.fault_class in ("fail_stop", "hang", "nan"))
    per_s = stop_rate * 1e-6 * spec.gpus / 3600.0  # job-stopping failures per second of wall-clock
    delta = spec.get("checkpoint_interval_s")
    return max(0.0, 1.0 - per_s * (restart_overhead_s + delta / 2.0) - checkpoint_write_s / delta)


# --------------------------------------------------------------------------- whole runs


def needed_keys(draws: Iterable[Sequence[Failure]]) -> list[tuple[str, int]]:
    return sorted({(f.kind, f.bucket) for fs in draws for f in fs})


def decide_all(spec: CampaignSpec, mix: Mapping[str, FailureKind], keys: Sequence[tuple[str, int]], *,
               seed: int = 0, progress: Callable[[str], None] | None = None,
               keep: dict[tuple[str, int], Any] | None = None) -> dict[tuple[str, int], Decision]:
    """Render and diagnose one sample per (kind, bucket) on the job's slice (the cache).

    ``keep``: when given, the rendered records of each key are kept there (for the bus check).
    """

    layout = spec.slice_layout()
    out: dict[tuple[str, int], Decision] = {}
    for kind, bucket in keys:
        render_seed = seed * 1000 + bucket * 37 + sorted(mix).index(kind)
        r = decide(kind, layout, render_seed, bucket, fault_class=mix[kind].fault_class,
                   nccl_timeout_s=spec.get("nccl_timeout_s"), job_dp=spec.gpus // (layout.tp * layout.pp))
        out[(kind, bucket)] = r.decision
        if keep is not None:
            keep[(kind, bucket)] = r
        if progress:
            progress(f"{kind}#{bucket}: {r.decision.action} ({'right' if r.decision.right else 'wrong'}) "
                     f"in {r.decision.render_s + r.decision.diagnose_s:.1f}s")
    return out


@dataclass
class CampaignRun:
    spec: CampaignSpec
    seeds: list[int]
    results: dict[str, list[PolicyResult]]
    decisions: dict[tuple[str, int], Decision]
    failures_per_seed: list[int]
    analytic: dict[str, float]
    bus: list[tuple[Decision, Decision]] = field(default_factory=list)

    def ettr(self, policy: str) -> tuple[float, float, float, float]:
        """(mean, std, min, max) over seeds."""
        v = np.array([r.ettr for r in self.results[policy]])
        return float(v.mean()), float(v.std()), float(v.min()), float(v.max())

    def lost_mean(self, policy: str) -> dict[str, float]:
        rs = self.results[policy]
        return {c: float(np.mean([r.lost_by_cause[c] for r in rs])) for c in CAUSES}


def run_campaign(spec: CampaignSpec, *, seeds: Sequence[int] = (0, 1, 2), buckets: int = 2,
                 mix: Mapping[str, FailureKind] | None = None, costs: Mapping[str, Mapping[str, Cost]] | None = None,
                 decisions: Mapping[tuple[str, int], Decision] | None = None,
                 bus_samples: int = 0, progress: Callable[[str], None] | None = None) -> CampaignRun:
    """Draw failures per seed, decide each (kind, bucket) once with the engine, run every policy."""
    costs = costs or load_costs()
    mix = mix or load_mix()
    spec = spec.resolved(costs)
    draws = [draw_failures(spec, mix, s, buckets) for s in seeds]
    kept: dict[tuple[str, int], Any] = {}
    if decisions is None:
        decisions = decide_all(spec, mix, needed_keys(draws), seed=seeds[0] if seeds else 0, progress=progress,
                               keep=kept if bus_samples else None)
    ctx = PolicyContext(spec, costs, decisions)
    results = {p: [simulate_policy(spec, fs, mix, p, ctx, seed=s) for s, fs in zip(seeds, draws, strict=True)]
               for p in POLICIES}
    u0 = spec.get("restart_s") + spec.get("reschedule_s")
    analytic = {"rsc_ettr": rsc_analytic_ettr(spec, mix, restart_overhead_s=u0),
                "rsc_ettr_with_write": rsc_analytic_ettr(spec, mix, restart_overhead_s=u0,
                                                         checkpoint_write_s=_num(costs, "job", "checkpoint_write_s")),
                "restart_overhead_s": u0}
    run = CampaignRun(spec, list(seeds), results, dict(decisions), [len(d) for d in draws], analytic)
    if bus_samples and kept:
        run.bus = bus_check(kept, bus_samples, progress=progress)
    return run


BUS_FIRST = tuple(k.value for k in (FaultKind.GPU_LOST, FaultKind.HANG_STUCK_RANK, FaultKind.THERMAL_THROTTLE,
                                    FaultKind.USER_EXCEPTION, FaultKind.IB_LINK_PERSISTENT, FaultKind.NAN_LOSS))


def bus_check(kept: Mapping[tuple[str, int], Any], n: int,
              progress: Callable[[str], None] | None = None) -> list[tuple[Decision, Decision]]:
    """Send ``n`` rendered failures (one per kind, the common ones first) through the embedded broker
    to the online DiagnosisService; returns (batch decision, bus decision) pairs."""

    order = [k for k in BUS_FIRST if any(kk == k for kk, _ in kept)]
    order += sorted({k for k, _ in kept} - set(order))
    pairs: list[tuple[Decision, Decision]] = []
    with EmbeddedBroker() as broker:
        for kind in order[:n]:
            key = min(k for k in kept if k[0] == kind)
            online = decide_online(kept[key], bootstrap=broker.bootstrap)
            pairs.append((kept[key].decision, online))
            if progress:
                progress(f"bus {kind}: batch {kept[key].decision.action} / bus {online.action}")
    return pairs
