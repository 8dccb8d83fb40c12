"""A training campaign: one long job, failures from a published mix, five ways of handling them, ETTR.

How much training time does faultlens give back, compared with what teams do
today? One job (default 9,600 GPUs, 70B-dense, 90 days) meets failures drawn
from ``failure_mix.toml`` (Llama 3's interruptions per kind; every split sourced
or marked assumed). The same draw is handled by five policies (``POLICIES``,
campaign_policies.py) with the costs of ``campaign_costs.toml``. faultlens is
charged per failure by a draw from its kind's measured decisions: a sample of
renders per kind, each decided by the real engine (campaign_outcomes.py).

The timeline (``Timeline``) is a list of segments ``(start, end, rate, cause)``:
``rate`` is the productive fraction of wall-clock (1 healthy, 0 stopped, in
between when slow) and ``cause`` names where the rest went (``CAUSES``). Per
failure it charges detection, localisation, waiting for machines when the warm
standbys are gone (the shortfall rescheduled, BR 8.2.1), restart, recompute of
the work since the last checkpoint; a fault left unfixed recurs after
``recur_after_s`` ("recurrence"); a slow machine costs throughput ("degraded");
checkpoint writes cost their blocking time. Failures that arrive while the job
is still recovering wait until it runs. ETTR = productive time / wall-clock
(BR 8.1.3, after Meta RSC); ``rsc_analytic_ettr`` is RSC's estimate beside it.
"""

from __future__ import annotations

import heapq
import math
import tomllib
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from faultlens.datasets.campaign_compound import COMPOUND
from faultlens.datasets.campaign_outcomes import draw
from faultlens.datasets.campaign_render import Decision, SliceLayout
from faultlens.datasets.faults import FAULTS
from faultlens.vocabulary import ActionType, IncidentKind

A = ActionType
MIX_PATH = Path(__file__).with_name("failure_mix.toml")
COSTS_PATH = Path(__file__).with_name("campaign_costs.toml")
POLICIES: tuple[str, ...] = ("none", "restart", "group_evict", "faultlens", "oracle")
CAUSES: tuple[str, ...] = ("detection", "localisation", "standby_wait", "restart", "recompute", "recurrence",
                           "degraded", "checkpoint")
STOPPED = ("fail_stop", "hang", "nan")  # failure classes that stop the job
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
    """One [kind.*] row of failure_mix.toml (its rate = its category's rate x its share)."""

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
    render_as: str = ""  # the simulator fault rendered for it ("" = its name)
    category: str = ""
    share: float = 1.0
    machines: int = 1  # machines it takes at once (a correlated event: a rack's power, a leaf switch)

    @property
    def rendered(self) -> str:
        return self.render_as or self.name


@dataclass(frozen=True)
class Cost:
    value: float | str
    source: str
    assumed: bool = False
    range: tuple[float, float] | None = None


def _marked(where: str, v: Any) -> Cost:
    """A { value, source[, assumed, range] } table as a Cost (a ValueError names what is missing)."""
    if not isinstance(v, dict) or "value" not in v or not v.get("source"):
        raise ValueError(f"{where}: every number needs {{ value = ..., source = ... }} (or assumed = true, range)")
    rng = v.get("range")
    if v.get("assumed") and (not isinstance(rng, list) or len(rng) != 2 or not rng[0] <= v["value"] <= rng[1]):
        raise ValueError(f"{where}: assumed needs range = [low, high] around its value")
    return Cost(v["value"], str(v["source"]), bool(v.get("assumed", False)),
                (float(rng[0]), float(rng[1])) if rng else None)


def load_mix(path: str | Path | None = None, kinds: Iterable[str] | None = None,
             overrides: Mapping[str, float] | None = None) -> dict[str, FailureKind]:
    """failure_mix.toml -> kind -> FailureKind; ``kinds`` keeps only those (a ValueError names unknown ones).

    ``overrides``: "category.<c>.rate_per_mgpuh" or "kind.<k>.<field>" -> value (the sensitivity run); a
    changed share scales the other shares of its category so they still sum to 1.
    """

    p = Path(path) if path else MIX_PATH
    raw = tomllib.loads(p.read_text())
    over = dict(overrides or {})
    cats = {c: float(_marked(f"{p}: [category.{c}]", t["rate_per_mgpuh"]).value)
            for c, t in raw.get("category", {}).items()}
    for key, v in over.items():
        if key.startswith("category."):
            cats[key.split(".")[1]] = v
    rows = raw.get("kind", {})
    shares: dict[str, float] = {}
    for name, row in rows.items():
        shares[name] = float(_marked(f"{p}: [kind.{name}] share", row.get("share")).value)
    for key, v in over.items():
        parts = key.split(".")
        if parts[0] == "kind" and parts[2] == "share":
            cat = rows[parts[1]]["category"]
            rest = [n for n in rows if rows[n]["category"] == cat and n != parts[1]]
            left = sum(shares[n] for n in rest)
            for n in rest:
                shares[n] = shares[n] * (1.0 - v) / left if left else (1.0 - v) / len(rest)
            shares[parts[1]] = v
    out: dict[str, FailureKind] = {}
    for name, row in rows.items():
        where = f"{p}: [kind.{name}]"
        render = str(row.get("render_as", name))
        if render not in FAULTS and render not in COMPOUND:
            raise ValueError(f"{where}: no simulator fault kind {render!r}")
        if row.get("class") not in FAULT_CLASSES:
            raise ValueError(f"{where}: class must be one of {FAULT_CLASSES}, got {row.get('class')!r}")
        if row.get("category") not in cats:
            raise ValueError(f"{where}: category {row.get('category')!r} has no [category.*] table")

        def num(field_: str, row: Mapping[str, Any] = row, where: str = where, name: str = name) -> float:
            if f"kind.{name}.{field_}" in over:
                return over[f"kind.{name}.{field_}"]
            return 0.0 if field_ not in row else float(_marked(f"{where} {field_}", row[field_]).value)

        try:
            out[name] = FailureKind(name=name, rate_per_mgpuh=cats[row["category"]] * shares[name],
                                    fault_class=row["class"], recur_after_s=num("recur_after_s"),
                                    machine_fault=bool(row["machine_fault"]), source=str(row["share"]["source"]),
                                    episode_mean_s=num("episode_mean_s"), outage_s=num("outage_s"),
                                    restart_fixes=bool(row.get("restart_fixes", False)),
                                    job_wide=bool(row.get("job_wide", False)), render_as=render,
                                    category=row["category"], share=shares[name],
                                    machines=int(num("machines")) if "machines" in row else 1)
        except KeyError as exc:
            raise ValueError(f"{where}: missing {exc.args[0]!r}") from None
    for cat in cats:
        total = sum(k.share for k in out.values() if k.category == cat)
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"{p}: the shares of category {cat} sum to {total:g}, not 1")
    if kinds is not None:
        wanted = list(kinds)
        unknown = [k for k in wanted if k not in out]
        if unknown:
            raise ValueError(f"{p}: no failure kind {', '.join(unknown)} (have {', '.join(sorted(out))})")
        out = {k: out[k] for k in wanted}
    return out


def load_costs(path: str | Path | None = None,
               overrides: Mapping[str, float] | None = None) -> dict[str, dict[str, Cost]]:
    """campaign_costs.toml -> section ("job", "policy.none", ...) -> name -> Cost.

    ``overrides``: "<section>.<name>" -> value (the sensitivity run)."""
    p = Path(path) if path else COSTS_PATH
    raw = tomllib.loads(p.read_text())
    out: dict[str, dict[str, Cost]] = {"job": {}}
    for name, c in raw.get("job", {}).items():
        out["job"][name] = _marked(f"{p}: [job] {name}", c)
    for pol, table in raw.get("policy", {}).items():
        if pol not in POLICIES:
            raise ValueError(f"{p}: [policy.{pol}] is not one of {POLICIES}")
        out[f"policy.{pol}"] = {k: _marked(f"{p}: [policy.{pol}] {k}", v) for k, v in table.items()
                                if k != "about"}
    for key, v in (overrides or {}).items():
        sec, name = key.rsplit(".", 1)
        out[sec][name] = replace(out[sec][name], value=v)
    return out


def assumed_figures() -> list[tuple[str, float, tuple[float, float], str]]:
    """(override key, value, range, source) of every figure marked assumed in the two TOML files."""
    out = []
    for sec, table in load_costs().items():
        out += [(f"{sec}.{n}", float(c.value), c.range, c.source) for n, c in table.items() if c.assumed and c.range]
    raw = tomllib.loads(MIX_PATH.read_text())
    for group in ("category", "kind"):
        for name, row in raw.get(group, {}).items():
            for field_, v in row.items():
                if isinstance(v, dict) and v.get("assumed"):
                    out.append((f"{group}.{name}.{field_}", float(v["value"]), tuple(v["range"]), str(v["source"])))
    return out


def cost_rows(costs: Mapping[str, Mapping[str, Cost]]) -> list[tuple[str, str, str, str]]:
    """(section, name, value, source) for printing the one table of costs."""
    return [(sec, name, f"{c.value}" + (f" (assumed {c.range[0]:g}-{c.range[1]:g})" if c.range else ""), c.source)
            for sec, table in costs.items() for name, c in table.items()]


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
    """One failure of the draw, shared by every policy. The uniforms place it in each policy's ranges."""

    t: float  # seconds into the campaign
    kind: str
    u_draw: float  # which of its kind's measured faultlens decisions it gets
    u_localise: float  # where in the by-hand localisation range it falls
    episode_s: float  # fail_slow: how long it lasts if nothing is done
    u_wrong: float = 1.0  # the error-rate sweep makes its decision wrong when u_wrong < the rate
    u_check: float = 0.5  # where in the health-check period it falls
    u_recall: float = 0.0  # stop-time checks find the culprit when u_recall < their recall
    u_redraw: float = 0.5  # the second look at a fail-slow after a wrong or missed decision
    overlap: bool = False  # it arrived while the job was still handling the failure before it

    @property
    def u_overlap(self) -> float:
        """Which measured overlap decision it draws (uniform: the fractional sum of two independent uniforms)."""
        return (self.u_draw + self.u_localise) % 1.0


def draw_failures(spec: CampaignSpec, mix: Mapping[str, FailureKind], seed: int) -> list[Failure]:
    """Poisson arrivals per kind over the campaign, time-ordered (seeded per kind: changing one kind's
    rate leaves the others' failures where they were)."""
    gpu_hours = spec.gpus * spec.duration_s / 3600.0
    out: list[Failure] = []
    for name in sorted(mix):
        rng = np.random.default_rng([seed, 35, zlib.crc32(name.encode())])
        k = mix[name]
        n = int(rng.poisson(k.rate_per_mgpuh * 1e-6 * gpu_hours))
        times = rng.uniform(0.0, spec.duration_s, n)
        for t in times:
            episode = 0.0
            if k.fault_class == "fail_slow":
                sigma = 1.0  # log-normal with the table's mean: mu = ln(mean) - sigma^2 / 2
                episode = float(rng.lognormal(math.log(k.episode_mean_s) - sigma**2 / 2, sigma))
            u = rng.random(6)
            out.append(Failure(t=float(t), kind=name, u_draw=float(u[0]), u_localise=float(u[1]), episode_s=episode,
                               u_wrong=float(u[2]), u_check=float(u[3]), u_recall=float(u[4]), u_redraw=float(u[5])))
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
    """What the policies read: costs, the job's group size, faultlens's measured decisions per rendered kind."""

    spec: CampaignSpec
    costs: Mapping[str, Mapping[str, Cost]]
    outcomes: Mapping[str, Sequence[Decision]]
    error_rate: float = 0.0  # the sweep: this share of faultlens's decisions made wrong on top of its own
    # per rendered kind: the online path's measured delay beyond the batch decision (campaign_run.bus_check)
    online_extra_s: Mapping[str, float] = field(default_factory=dict)

    def c(self, policy: str, name: str) -> float:
        return _num(self.costs, f"policy.{policy}", name)

    def job(self, name: str) -> float:
        return _num(self.costs, "job", name)

    def decision(self, f: Failure, k: FailureKind, *, second: bool = False) -> Decision | None:
        """The measured decision this failure is charged with (None: no outcomes for its kind)."""
        ds = self.outcomes.get(k.rendered)
        if not ds:
            return None
        d = draw(ds, f.u_redraw if second else f.u_draw)
        if f.u_wrong < self.error_rate and not second:  # the sweep: one healthy machine evicted, the culprit left
            return replace(d, action=A.EVICT_NODES, named=1, culprit_named=False, extra_machines=1, right=False,
                           detect_s=d.detect_s if d.detect_s is not None else 0.0, adapt_ratio=None)
        return d

    def online_latency(self, kind: str) -> float:
        """What the online path adds to a measured (batch) decision of ``kind``: its bus check's measured delay
        beyond the batch one where the bus check ran (never below the agent-to-action floor), else the floor."""
        floor = self.c("faultlens", "online_latency_s")
        return max(floor, self.online_extra_s.get(kind, floor))

    def restart_floor(self, machines: int) -> float:
        return self.spec.get("restart_s") + (self.spec.get("reschedule_s") if machines else 0.0)


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
    shortfall_s: float = float("inf")  # rescheduling only the machines the standbys cannot cover (BR 8.2.1)
    healthy_out: int = 0  # healthy machines taken out (over-eviction, wrong machine)

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

    def take(self, machines: int, faulty: bool | int, cause: str) -> None:
        """Swap ``machines`` out for warm standbys. When the pool is short, wait for evicted machines to
        come back (healthy ones after their checks, the faulty one after repair) or for the shortfall
        to be rescheduled from the cluster (BR 8.2.1), whichever is sooner."""
        if machines <= 0:
            return
        self.machines_out += machines
        faulty = min(machines, int(faulty))  # how many of them are faulty (a correlated event: several)
        self.healthy_out += machines - faulty
        cap = int(self.spec.get("warm_standbys"))
        while self.returning and self.returning[0] <= self.now:
            heapq.heappop(self.returning)
            self.pool = min(cap, self.pool + 1)
        for _ in range(machines - faulty):
            heapq.heappush(self.returning, self.now + self.spec.get("healthy_return_s"))
        for _ in range(faulty):
            heapq.heappush(self.returning, self.now + self.spec.get("repair_s"))
        short = machines - self.pool
        if short <= 0:
            self.pool -= machines
            return
        self.waits += 1
        self.pool = 0
        back = heapq.nsmallest(short, self.returning)[-1] - self.now
        if back <= self.shortfall_s:
            for _ in range(short):
                heapq.heappop(self.returning)
        self.seg(min(back, self.shortfall_s), 0.0, cause if cause == "recurrence" else "standby_wait")

    def restart(self, machines: int, cause: str) -> None:
        """Restart from the last checkpoint, then recompute what was lost."""
        lost = self.lost_work()
        self.seg(self.spec.get("restart_s") + (self.spec.get("reschedule_s") if machines else 0.0), 0.0,
                 cause if cause == "recurrence" else "restart")
        self.anchor = self.now
        self.seg(lost, 0.0, cause if cause == "recurrence" else "recompute")

    def stop(self, k: FailureKind, attempts: Sequence[Attempt]) -> None:
        """A stopped job (crash, hang, NaN): each attempt's costs; an unfixed one recurs.

        A fault that recurs at once (``recur_after_s`` 0) stops the job as it starts: nothing was
        recomputed, so the work since the checkpoint is lost (and recomputed) only once."""
        lost = self.lost_work()
        for i, a in enumerate(attempts):
            rec = i > 0
            last = a.fixed or i == len(attempts) - 1
            self.seg(a.detect_s or 0.0, 0.0, "recurrence" if rec else "detection")
            self.seg(a.localise_s, 0.0, "recurrence" if rec else "localisation")
            self.take(a.machines, k.machines if a.faulty_out else 0, "recurrence" if rec else "standby_wait")
            self.seg(self.spec.get("restart_s") + (self.spec.get("reschedule_s") if a.machines else 0.0), 0.0,
                     "recurrence" if rec else "restart")
            if not last and k.recur_after_s <= 0:
                continue  # fails again as it starts: the same work is still to redo
            self.anchor = self.now
            self.seg(lost, 0.0, "recurrence" if rec else "recompute")
            if last:
                return
            # the fault is still there: the job runs recur_after_s, then it stops again
            self.seg(k.recur_after_s, 1.0, "productive")
            lost = self.lost_work()

    def slow(self, k: FailureKind, f: Failure, attempts: Sequence[Attempt], speed: float, recheck_s: float) -> None:
        """A slow machine: degraded until detected and adapted around or evicted, or its episode ends.

        A wrong or missed first decision leaves it degraded until a second look ``recheck_s`` after
        the first (its own delays on top); a wrong second look leaves it for the rest of the episode."""
        end = self.now + f.episode_s
        a = attempts[0]
        if a.action == "best":  # the oracle: evict now, adapt now, or ride it out, whichever costs least
            options = {"evict": self.spec.get("restart_s") + self.spec.get("reschedule_s") + self.lost_work(),
                       "none": (1.0 - speed) * f.episode_s}
            if a.adapt_ratio < 1.0:
                options["adapt"] = a.adapt_pause_s + (1.0 - max(speed, a.adapt_ratio)) * f.episode_s
            best = min(options, key=lambda o: options[o])
            a = replace(a, action={"evict": "best", "none": "none", "adapt": "adapt"}[best])
        tries = [a] + list(attempts[1:2])
        for i, a in enumerate(tries):
            if a.action == "none" or a.detect_s is None or k.job_wide:
                if i == 0 and len(tries) > 1 and not k.job_wide:
                    self.seg(min(recheck_s, end - self.now), speed, "degraded")
                    continue
                break
            seen = a.detect_s + a.localise_s + (recheck_s if i else 0.0)
            if self.now + seen >= end:
                break
            self.seg(seen, speed, "degraded")
            if a.action == "adapt":
                ratio = max(speed, min(1.0, a.adapt_ratio)) if a.fixed else speed
                pause = min(a.adapt_pause_s, end - self.now)
                self.seg(pause, 0.0, "restart")
                if a.fixed:
                    self.seg(max(0.0, end - self.now), ratio, "degraded")
                    return
            else:  # evict (or the oracle's best)
                self.take(a.machines, a.faulty_out, "standby_wait")
                self.restart(a.machines, "restart")
                if a.fixed or a.action == "best":
                    return
        self.seg(max(0.0, end - self.now), speed, "degraded")

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
    wrong: int  # attempts that did not fix the fault (a stopped job's last one counts when it did not either)
    machines_out: int
    standby_waits: int
    segments: list[tuple[float, float, float, str]]
    healthy_out: int = 0  # healthy machines taken out
    outcomes: dict[str, int] = field(default_factory=dict)  # faultlens: what each charged decision was

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
