"""The five ways of handling a campaign failure (datasets/campaign.py runs them on the same draw).

Each policy turns one failure into the attempts it makes (``Attempt``: detection, localisation,
the action, the machines it takes out, whether that fixes the fault), every figure from
campaign_costs.toml (with its source) or, for faultlens, from a draw of its kind's measured
decisions (campaign_outcomes.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from faultlens.config import Config
from faultlens.datasets.campaign import (
    CAUSES,
    STOPPED,
    Attempt,
    CampaignSpec,
    Failure,
    FailureKind,
    PolicyContext,
    PolicyResult,
    Timeline,
)
from faultlens.datasets.campaign_outcomes import classify, draw
from faultlens.datasets.campaign_render import Decision
from faultlens.vocabulary import ActionType, FaultKind

A = ActionType


def _fix(k: FailureKind) -> tuple[str, int]:
    """The right action once the culprit is known: (action, machines out)."""
    if k.machine_fault:
        return "evict", k.machines
    if k.rendered == "user_exception":
        return "rollback", 0
    return "restart", 0


def human(ctx: PolicyContext, f: Failure, k: FailureKind) -> list[Attempt]:
    """Policy (a): an on-call human, paged on a crash, localising by hand, watching a dashboard."""
    p = "none"
    lo, hi = ctx.c(p, "localise_min_s"), ctx.c(p, "localise_max_s")
    by_hand = lo + f.u_localise * (hi - lo)
    if k.fault_class == "transient":
        return [Attempt(None, 0.0, "none", fixed=False)]
    if k.fault_class == "fail_slow":
        if k.job_wide:  # noticed, but there is no machine to take out
            return [Attempt(None, 0.0, "none", fixed=False)]
        return [Attempt(ctx.c(p, "failslow_notice_s"), by_hand, "evict", 1, faulty_out=True)]
    action, machines = _fix(k)
    paged = ctx.c(p, "crash_detect_s") + ctx.c(p, "page_s")
    if k.fault_class == "nan":
        return [Attempt(paged, ctx.job("nan_manual_s"), action, machines, faulty_out=machines > 0)]
    if k.fault_class == "hang":
        hlo, hhi = ctx.c(p, "hang_localise_min_s"), ctx.c(p, "hang_localise_max_s")
        return [Attempt(ctx.spec.get("nccl_timeout_s") + paged, hlo + f.u_localise * (hhi - hlo), action, machines,
                        faulty_out=machines > 0)]
    return [Attempt(paged, by_hand, action, machines, faulty_out=machines > 0)]


def blind_restart(ctx: PolicyContext, f: Failure, k: FailureKind) -> list[Attempt]:
    """Policy (b): restart whatever stopped, with the platform's periodic node health checks (RSC);
    people take over what comes back and what is slow."""
    p = "restart"
    checked = str(ctx.costs[f"policy.{p}"]["health_checked"].value).split(",")
    check_s = f.u_check * ctx.c(p, "health_check_interval_s")
    if k.fault_class == "transient":
        return [Attempt(None, 0.0, "none", fixed=False)]
    if k.rendered in checked:  # the check drains the node: the scheduler restarts on a good one
        if k.fault_class == "fail_slow":
            return [Attempt(check_s, 0.0, "evict", 1, faulty_out=True)]
        detect = ctx.c(p, "crash_detect_s")
        return [Attempt(detect, max(0.0, check_s - detect), "evict", k.machines, faulty_out=True)]
    if k.fault_class == "fail_slow":
        return human(ctx, f, k)
    detect = ctx.spec.get("nccl_timeout_s") if k.fault_class == "hang" else ctx.c(p, "crash_detect_s")
    tries = [Attempt(detect, 0.0, "restart", fixed=k.restart_fixes)]
    if k.restart_fixes:
        return tries
    for _ in range(int(ctx.c(p, "blind_restarts")) - 1):
        tries.append(Attempt(detect, 0.0, "restart", fixed=False))
    return tries + human(ctx, f, k)


RESOLVE: dict[str, str] = {FaultKind.GPU_LOST: "resolve_gpu_unavailable_s", FaultKind.ECC_UNCORRECTABLE: "resolve_gpu_memory_s",
           FaultKind.ROW_REMAP_FAILURE: "resolve_gpu_memory_s", FaultKind.NVLINK_ERROR: "resolve_cuda_s",
           FaultKind.IB_LINK_PERSISTENT: "resolve_infiniband_s",
           # correlated events: machines gone (a rack's power) resolve like GPU unavailable, a leaf switch like IB
           "rack_power": "resolve_gpu_unavailable_s", "leaf_switch": "resolve_infiniband_s"}


def group_evict(ctx: PolicyContext, f: Failure, k: FailureKind) -> list[Attempt]:
    """Policy (c): ByteRobust-style inspection; a machine for explicit faults, the PP group for hangs.

    BR Table 6 times run from localisation to a successful restart: only what exceeds the platform's
    own restart is charged as localisation (no double charge)."""
    p = "group_evict"
    group = ctx.spec.nodes_per_replica
    d = ctx.decision(f, k)
    shown = d.detect_s if d is not None and d.detect_s is not None else 0.0  # when the evidence appeared

    def seen(name: str) -> float:  # an inspection sees an event no sooner than it is in the signals
        return max(ctx.c(p, name), shown)

    if k.fault_class == "transient":
        return [Attempt(None, 0.0, "none", fixed=False)]  # one flap: tolerated (2 alerts in 5 min to evict)
    if k.fault_class == "nan":
        action, machines = _fix(k)
        resolve = max(0.0, ctx.job("nan_resolution_s") - ctx.restart_floor(machines))
        return [Attempt(ctx.c(p, "crash_detect_s"), resolve, action, machines, faulty_out=machines > 0)]
    if k.fault_class == "fail_slow":
        if k.job_wide:  # every rank alike: aggregation finds no odd group
            return [Attempt(None, 0.0, "none", fixed=False)]
        if k.rendered == "thermal_throttle":
            return [Attempt(seen("thermal_detect_s"), 0.0, "evict", 1, faulty_out=True)]
        if k.rendered == "pcie_degradation":
            return [Attempt(seen("pcie_detect_s"), 0.0, "evict", 1, faulty_out=True)]
        return [Attempt(ctx.c(p, "hang_detect_s"), ctx.c(p, "aggregation_s"), "evict", group, faulty_out=True)]
    if k.rendered == "hung_task":  # a kernel event on one host (BR 4.1 host inspection of dmesg), once the
        # kernel has written it (faultlens may open its hang incident sooner, from the steps and stacks)
        return [Attempt(max(seen("kernel_detect_s"), ctx.c(p, "hung_task_timeout_s")), 0.0, "evict", 1,
                        faulty_out=True)]
    if k.fault_class == "hang":
        return [Attempt(ctx.c(p, "hang_detect_s"), ctx.c(p, "aggregation_s"), "evict", group, faulty_out=True)]
    if k.rendered == "user_exception":
        return [Attempt(ctx.c(p, "crash_detect_s"), max(0.0, ctx.c(p, "resolve_code_s") - ctx.restart_floor(0)),
                        "rollback")]
    if not k.machine_fault:
        return [Attempt(ctx.c(p, "kernel_detect_s"), 0.0, "restart", fixed=k.restart_fixes)] + (
            [] if k.restart_fixes else human(ctx, f, k))
    network = k.rendered.startswith("ib_") or k.rendered == "leaf_switch"
    detect = seen("network_detect_s") if network else seen("gpu_detect_s")
    resolve = ctx.c(p, RESOLVE.get(k.rendered, "resolve_cuda_s"))
    return [Attempt(detect, max(0.0, resolve - ctx.restart_floor(1)), "evict", k.machines, faulty_out=True)]


def oracle(ctx: PolicyContext, f: Failure, k: FailureKind) -> list[Attempt]:
    """Policy (e): knows at once what broke and does the right thing."""
    if k.fault_class == "transient" or (k.fault_class == "fail_slow" and k.job_wide):
        return [Attempt(None, 0.0, "none", fixed=False)]
    if k.fault_class == "fail_slow":  # the cheapest of evicting, riding it out and the planner's plan (if any)
        ds = [d for d in ctx.outcomes.get(k.rendered, ()) if d.right and d.adapt_ratio is not None]
        best = max(ds, key=lambda d: d.adapt_ratio or 0.0, default=None)
        return [Attempt(0.0, 0.0, "best", 1, faulty_out=True, adapt_ratio=(best.adapt_ratio or 1.0) if best else 1.0,
                        adapt_pause_s=best.adapt_pause_s if best else 0.0)]
    action, machines = _fix(k)
    return [Attempt(0.0, 0.0, action, machines, faulty_out=machines > 0)]


def _faultlens_first(ctx: PolicyContext, f: Failure, k: FailureKind, d: Decision) -> Attempt:
    """What one measured decision does to this failure."""
    stopped = k.fault_class in STOPPED
    act = d.action
    if act in ("none", A.NOTIFY) or d.detect_s is None:
        return Attempt(None, 0.0, "none", fixed=not stopped and k.fault_class != "fail_slow")
    detect, decide = d.detect_s + ctx.online_latency(k.rendered), d.decide_s  # batch + the online path
    if act == A.ADAPT_PARALLELISM and k.fault_class == "fail_slow":
        return Attempt(detect, decide, "adapt", fixed=d.culprit_named, adapt_ratio=d.adapt_ratio or 1.0,
                       adapt_pause_s=d.adapt_pause_s)
    if act in (A.EVICT_NODES, A.ADAPT_PARALLELISM):
        fixed = (d.culprit_named and k.machine_fault) or k.restart_fixes
        named = d.named
        if k.machines > 1 and d.culprit_named:  # a correlated event, rendered on RENDERED_MACHINES machines:
            # the mix may say more; the guard rails evict at most their per-job cap in an hour (the rest stay)
            guard = Config().guard
            cap = min(guard.max_evictions_per_job_per_hour, max(1, int(guard.max_evicted_fraction * ctx.spec.nodes)))
            named, fixed = min(k.machines, cap) + d.extra_machines, fixed and k.machines <= cap
        return Attempt(detect, decide, "evict", named, fixed=fixed, faulty_out=d.culprit_named)
    if act == A.RUN_DIAGNOSTICS:  # stop-time checks, fallible (BR 9 recall); when they pass, a reattempt
        check = ctx.job("nan_resolution_s") if k.fault_class == "nan" else ctx.job(
            "stop_time_check_kernel_s" if k.rendered == "hung_task" else "stop_time_check_s")  # BR Table 6's row
        # a NaN gets BR's whole procedure (EUD, bit-wise alignment, replay: Table 6's 4,289 s), as group_evict does
        if k.fault_class == "nan" or f.u_recall < ctx.job("diagnostics_recall"):
            action, machines = _fix(k)
            return Attempt(detect, decide + check, action, machines, faulty_out=machines > 0)
        return Attempt(detect, decide + check, "restart", fixed=k.restart_fixes)
    if act == A.ROLLBACK_CODE:
        return Attempt(detect, decide, "rollback", fixed=k.rendered == "user_exception" or k.restart_fixes)
    return Attempt(detect, decide, "restart", fixed=k.restart_fixes or (d.right and not k.machine_fault))


def faultlens(ctx: PolicyContext, f: Failure, k: FailureKind) -> list[Attempt]:
    """Policy (d): a draw from what the engine decided on its kind's rendered failures.

    Right: the action is taken. Missing on a stopped job: the runner's default restart (with the
    platform's health checks), then people. Wrong: the fault recurs (a stopped job stops again, a
    slow machine is looked at again after ``failslow_recheck_s``) and is decided again by a fresh
    draw; wrong twice on a stopped job, people take over.
    """
    d = ctx.decision(f, k)
    if d is None:
        raise ValueError(f"no measured faultlens decisions for {k.rendered} (kind {k.name})")
    stopped = k.fault_class in STOPPED
    first = _faultlens_first(ctx, f, k, d)
    lead: list[Attempt] = []
    ov = ctx.outcomes.get("overlap")
    if f.overlap and ov and stopped and k.machine_fault and not draw(ov, f.u_overlap).right:
        # it came while the one before was handled and the engine (measured on overlap renders) did not
        # name it then: the job restarts without it out, stops again at once, and it is decided afresh
        lead = [Attempt(0.0, 0.0, "restart", fixed=False)]
    return lead + _faultlens_attempts(ctx, f, k, d, first)


def _faultlens_attempts(ctx: PolicyContext, f: Failure, k: FailureKind, d: Decision, first: Attempt) -> list[Attempt]:
    stopped = k.fault_class in STOPPED
    if stopped and first.detect_s is None:
        return blind_restart(ctx, f, k)
    if first.fixed or k.fault_class == "transient":
        return [first]
    again = ctx.decision(f, k, second=True)
    second = _faultlens_first(ctx, f, k, again) if again is not None else None
    if not stopped:
        return [first, second] if second is not None else [first]
    if second is None or second.detect_s is None:
        return [first] + _handover(ctx, f, k, first, d)
    return [first, second] if second.fixed else [first, second] + _handover(ctx, f, k, second, again)


def _handover(ctx: PolicyContext, f: Failure, k: FailureKind, last: Attempt, d: Decision | None) -> list[Attempt]:
    """People take over from faultlens: paged when faultlens sees the fault again (its own detection),
    not after the NCCL timeout or the job's exit that policy none waits for; a hang whose machine
    faultlens named is localised as an explicit fault (BR 2.2's 2-15 min), not by BR's > 1.5 h hunt
    for an unknown machine."""
    people = human(ctx, f, k)
    if not people or people[0].detect_s is None or last.detect_s is None:
        return people
    first = replace(people[0], detect_s=last.detect_s + ctx.c("none", "page_s"))
    if k.fault_class == "hang" and d is not None and d.culprit_named:
        lo, hi = ctx.c("none", "localise_min_s"), ctx.c("none", "localise_max_s")
        first = replace(first, localise_s=lo + f.u_localise * (hi - lo))
    return [first] + people[1:]


POLICY_FUNCS: dict[str, Callable[[PolicyContext, Failure, FailureKind], list[Attempt]]] = {
    "none": human, "restart": blind_restart, "group_evict": group_evict, "faultlens": faultlens, "oracle": oracle,
}


def simulate_policy(spec: CampaignSpec, failures: Sequence[Failure], mix: Mapping[str, FailureKind],
                    policy: str, ctx: PolicyContext, *, seed: int = 0) -> PolicyResult:
    """One policy over one failure draw: the timeline, ETTR and the unproductive time by cause.

    Checkpoint writes are charged on the productive time: ``checkpoint_write_s`` per
    ``checkpoint_interval_s`` of training (the same for every policy)."""

    handle = POLICY_FUNCS[policy]
    tl = Timeline(spec, shortfall_s=ctx.job("shortfall_reschedule_s"))
    end = spec.duration_s
    recheck = ctx.job("failslow_recheck_s")
    deferred = dropped = wrong = handled = 0
    outcomes = dict.fromkeys(("right", "late", "over_eviction", "wrong_machine", "missed", "made_wrong"), 0)
    for f in failures:
        if f.t >= end:
            continue
        if tl.now >= end:
            dropped += 1
            continue
        if f.t < tl.now:
            deferred += 1
            f = replace(f, overlap=True)
        tl.run_until(f.t)
        k = mix[f.kind]
        attempts = handle(ctx, f, k)
        wrong += sum(not a.fixed for a in attempts[:-1]) + (k.fault_class in STOPPED and not attempts[-1].fixed)
        handled += 1
        if policy == "faultlens":
            made = f.u_wrong < ctx.error_rate
            d = ctx.decision(f, k)
            outcomes["made_wrong" if made else classify(d, ctx.job("late_after_s"))] += 1  # type: ignore[arg-type]
        if k.fault_class in STOPPED:
            tl.stop(k, attempts)
        elif k.fault_class == "fail_slow":
            ds = ctx.outcomes.get(k.rendered)
            tl.slow(k, f, attempts, draw(ds, f.u_draw).slow_speed if ds else 1.0, recheck)
        else:
            tl.transient(k, attempts[0])
    tl.run_until(end)
    clipped = [(s, min(e, end), r, c) for s, e, r, c in tl.segments if s < end]
    lost = dict.fromkeys(CAUSES, 0.0)
    productive = 0.0
    for s, e, r, c in clipped:
        productive += (e - s) * r
        if r < 1.0:
            lost[c] = lost.get(c, 0.0) + (e - s) * (1.0 - r)
    lost["checkpoint"] = productive * ctx.job("checkpoint_write_s") / spec.get("checkpoint_interval_s")
    productive -= lost["checkpoint"]
    return PolicyResult(policy=policy, seed=seed, ettr=productive / end, lost_by_cause=lost, failures=handled,
                        deferred=deferred, dropped=dropped, wrong=wrong, machines_out=tl.machines_out,
                        standby_waits=tl.waits, segments=clipped, healthy_out=tl.healthy_out,
                        outcomes=outcomes if policy == "faultlens" else {})
