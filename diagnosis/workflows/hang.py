"""Hang: a job's steps stopped while its hosts are alive, or a watchdog said a collective timed out.

It watches each job's steps and GPUs (diagnosis.progress: the silence against the job's own pace,
``settings.HangSettings``); a silence past the threshold opens (or joins) the job's hang. The hang
then asks for stacks (online), gives an explicit cause ``grace_s`` to explain it, ranks every
machine as its root (diagnosis.hangroot: stacks, Flight Recorder, GPU figures, machine faults in the
window) and evicts the root, or restarts with stop-time diagnostics within the blast radius: a job
is never left hung on a notification alone.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from faultlens import flightrec
from faultlens.decode import GpuColumns
from faultlens.diagnosis import hangroot
from faultlens.diagnosis.decision import Decision
from faultlens.diagnosis.guardlog import job_cap
from faultlens.diagnosis.incidents import OpenIncident
from faultlens.diagnosis.pauses import pause_line, shipped_pauses
from faultlens.diagnosis.progress import check_hang
from faultlens.diagnosis.settings import HangSettings
from faultlens.diagnosis.stacks import StackVerdict
from faultlens.diagnosis.workflows.base import BaseWorkflow, Desk
from faultlens.diagnosis.workflows.job_wide import JOBWIDE_HOLD
from faultlens.diagnosis.workflows.machine_fault import HANG_ROOT
from faultlens.schema import GpuSample, NcclEvent, StackDump, StepTiming
from faultlens.vocabulary import ActionType, IncidentKind

if TYPE_CHECKING:
    from faultlens.diagnosis.engine import JobState

# Machine incidents that explain a hang rooted on their machine (a process blocked in I/O).
HOST_STALL_KINDS = frozenset({IncidentKind.HUNG_TASK})


class HangWorkflow(BaseWorkflow):
    name = "hang"
    kinds = frozenset({IncidentKind.HANG})
    reads: tuple[type, ...] = (StepTiming, GpuSample, NcclEvent)

    def __init__(self, settings: HangSettings):
        self.settings = settings
        self.pauses = shipped_pauses()  # the frameworks' pause lines (a bad catalog fails here, at start)

    # ------------------------------------------------------------------ what the job does

    def observe(self, desk: Desk, record: Any, job: str) -> bool:
        if type(record) is StepTiming:
            desk.job(record.job).progress.observe_step(record)
            return False
        if type(record) is NcclEvent:  # the framework's own words: an evaluation or a checkpoint save
            line = pause_line(record.raw, self.pauses)
            if line is not None and job in desk.state.jobs:
                desk.state.jobs[job].progress.observe_pause(line.rule.name, record.ts, line.rule.max_s,
                                                            ends=line.ends)
            return False
        state = desk.state.jobs.get(desk.state.node_job.get(record.node, ""))
        if state is not None:
            state.progress.observe_gpu(record)
            _gpu_since_last_step(state, record)
        return False

    @staticmethod
    def observe_steady(job: JobState, columns: GpuColumns) -> None:
        """``observe`` on a columnar GPU sample that repeats its node's counters (the engine's steady path)."""
        progress = job.progress
        last = progress.last_step_ts
        if last is None:
            return
        ts = columns.ts
        grace = max(5.0, 2.0 * progress.median_step_s())
        utils = columns.floats("util")
        progress.observe_gpu_means(ts, utils, [m for m in columns.floats("mem_used_mb") if m], grace)
        if ts > last + grace:
            _gpu_figures_since_last_step(job, columns.node, last, zip(columns.ints("index"), utils,
                                                                       columns.floats("power_w"), strict=True))

    def watch(self, desk: Desk, job: JobState, now: float, final: bool) -> None:
        """Steps stopped while the hosts are alive (diagnosis.progress): open (or join) the job's hang."""
        hang = self.settings
        call = check_hang(job.progress, now, hang, final=final, stacks=job.stacks.values())
        if call is None:
            job.progress.hang_pending_since = None
            return
        if hang.dwell_s > 0 and not final:
            wall = time.time()
            since = job.progress.hang_pending_since
            if since is None or since > wall:
                job.progress.hang_pending_since = wall
                return
            if wall - since < hang.dwell_s:
                return
        inc = desk.book.job_incident(job.name, IncidentKind.HANG, call.ts, confidence=call.confidence,
                                     rule="engine:no_step_progress", text=call.text, figures=call.figures)
        if inc is None:
            return
        job.progress.hang_open, job.progress.hang_step = inc.id, job.progress.last_step
        if not call.subset:
            job.progress.silence_hang, job.progress.silence_hang_step = inc.id, job.progress.last_step
        for r in call.lagging_ranks[:16]:
            node = job.topology.placement.get(r, (None, None))[0] if job.topology else None
            if node:
                inc.suspect(node, 0.4, f"rank {r} stopped before the others", rank=r)

    # ------------------------------------------------------------------ the hang incident

    def decide(self, desk: Desk, inc: OpenIncident) -> None:
        return None  # a hang decides on its tick: after the stacks and the grace for an explicit cause

    def on_tick(self, desk: Desk, inc: OpenIncident, now: float, final: bool) -> None:
        """Ask for stacks (online), wait for an explicit cause, then demarcate from the evidence."""
        if inc.decided:
            return
        job = desk.job(inc.job)
        if _pause_ended(job, inc):
            return
        st = inc.state
        st.pending = st.pending or "hang"
        cmd = desk.mode.request_stacks(inc, now, "hang")
        if cmd is not None:
            desk.state.outputs.append(cmd)
        ready_at = desk.mode.stacks_ready_at(inc, now, grace_s=self.settings.grace_s, wait_s=self.settings.stacks_wait_s,
                                             answered=_every_rank_answered(job, inc),
                                             answered_wait_s=self.settings.answered_wait_s)
        if now < ready_at and not final:
            return
        verdict: StackVerdict | None = None
        dumps = desk.mode.usable_dumps(job.stacks.values(), now, final=final)
        if dumps and job.topology is not None:
            verdict = desk.state.aggregator.aggregate(dumps, job.topology)
            inc.evidence.append({"ts": now, "source": "stacks", "rule": "stacks:aggregate",
                                 "text": f"{len(verdict.groups)} stack group(s); outliers {verdict.outliers[:32]}; "
                                         f"no answer from {verdict.missing[:32]}",
                                 "figures": {"groups": [[fp.split(chr(10), 1)[0], len(r)] for fp, r in verdict.groups[:8]],
                                             "outliers": verdict.outliers[:256]}})
        st.pending = None
        allowed = job_cap(desk.config.guard, max(1, len(job.nodes)))
        ranking = _rank_hang(desk, inc, job, dumps, verdict, now, allowed) if job.topology is not None else None
        lagging = tuple(s["node"] for s in inc.top_suspects() if any("stopped before" in x for x in s["reasons"]))
        if ranking is not None and ranking.roots and _explained_by_host(desk, inc, ranking.roots):
            return  # the root machine's own incident (its hung task) decides; the hang is muted into it
        if ranking is not None and ranking.roots:
            decision = _evict_roots(ranking, verdict)
        else:
            decision = desk.policy.decide_hang(inc, verdict, stacks_expected=desk.mode.stacks_expected,
                                               max_nodes=allowed, lagging_nodes=lagging if len(lagging) <= allowed else ())
            decision = _never_left_hung(decision, ranking, inc, allowed)
        inc.confidence = max(inc.confidence, decision.confidence)
        if decision.nodes:
            inc.summary = decision.reason
        taken = desk.act(inc, decision)
        if taken is not None and taken.type == ActionType.NOTIFY and decision.type == ActionType.EVICT_NODES:
            # the guard rails refused the eviction: the job must not stay hung on a notification alone
            named = tuple(ranking.best(allowed)) if ranking is not None and ranking.best(allowed) else decision.nodes[:allowed]
            desk.act(inc, Decision(ActionType.RUN_DIAGNOSTICS, named, f"hang: eviction refused by the guard rails; "
                                   f"restart with stop-time diagnostics on {', '.join(named) or 'the job'}", 0.6))


def _every_rank_answered(job: JobState, inc: OpenIncident) -> bool:
    """Every rank of the job has a stack dump dated after the hang's request (a failed dump included: a
    stopped rank's py-spy error is its answer)."""
    requested = inc.state.requested_ts
    if requested is None or job.topology is None or not job.topology.world_size:
        return False
    return all((d := job.stacks.get(r)) is not None and d.ts >= requested for r in range(job.topology.world_size))


def _pause_ended(job: JobState, inc: OpenIncident) -> bool:
    """The job's steps came back before its silence was decided: it was a pause (an evaluation, a checkpoint
    save), not a hang, and a pause that ends is never a restart. The incident resolves with no action."""
    p = job.progress
    if p.silence_hang != inc.id or p.silence_hang_step is None or p.last_step <= p.silence_hang_step:
        return False
    inc.status, inc.state.pending, inc.dirty = "resolved", None, True
    inc.summary = (f"the job's steps resumed (step {p.last_step}) before the silence was decided: a pause of the "
                   f"job's own, not a hang; no action")
    inc.evidence.append({"ts": p.last_step_ts, "source": "steps", "rule": "hang:pause_ended",
                         "text": inc.summary, "figures": {"resumed_step": p.last_step, "longest_pause_s": round(p.max_gap_s, 1)}})
    p.silence_hang = p.silence_hang_step = None
    return True


def _explained_by_host(desk: Desk, hang: OpenIncident, roots: Sequence[str]) -> bool:
    """A hang rooted on a machine whose kernel reported a hung task (a process blocked in I/O) is that
    machine's stall, not a second fault: the hung task, weak while it waited for the job's other nodes,
    is confirmed as the cause and mutes the hang, and one action goes out on that machine (its route's
    ``rooted_action``), not an eviction on the hang's evidence and a second action from the hung task."""
    for other in desk.book.open_incidents(hang.job):
        if other.kind in HOST_STALL_KINDS and other.node in roots and not other.state.folded_into:
            desk.book.confirm_cause(other)
            if hang.status != "resolved":
                return False
            _act_on_rooted_host(desk, other, hang)
            return True
    return False


def _act_on_rooted_host(desk: Desk, host: OpenIncident, hang: OpenIncident) -> None:
    """The stacks and the kernel name the same machine, and no other node of the job reports a stall of its
    own (a shared storage stall is the job-wide rule's, after its hold): the route's ``rooted_action`` at once.
    Without one, or while another node stalls too, the host incident's own route decides after its hold."""
    action = desk.policy.route(host.kind).rooted_action
    if action is None or host.node is None or host.decided:
        return
    rule = desk.state.jobwide.rule_for(host.kind)
    watched = set(rule.source_kinds) if rule is not None else set(HOST_STALL_KINDS)
    shared = {rule.kind} if rule is not None else set()
    if any(o.kind in shared or (o.kind in watched and o.node != host.node) for o in desk.book.open_incidents(host.job)):
        return
    why = (f"{host.kind} on {host.node} and the job's hang (incident {hang.id}) rooted on {host.node} by its stacks: "
           f"the kernel's report and the stacks name one machine")
    if host.state.pending in (JOBWIDE_HOLD, HANG_ROOT):  # decided here: it waits for nothing more
        host.state.pending = host.state.waiting = None
    desk.act(host, Decision(action, (host.node,), why, max(host.confidence, 0.95)))


def _rank_hang(desk: Desk, inc: OpenIncident, job: JobState, dumps: list[StackDump], verdict: StackVerdict | None,
               now: float, allowed: int) -> hangroot.RootRanking | None:
    """Score every machine as the root of the hang (diagnosis.hangroot) and file them as the suspects."""
    topo = job.topology
    assert topo is not None
    catalog = hangroot.load_frames()
    by_rank = {d.rank: d for d in dumps if d.rank is not None}
    states: dict[int, hangroot.RankState] = {}
    if by_rank:
        for r in range(topo.world_size):
            d = by_rank.get(r)
            states[r] = hangroot.rank_state(r, d.text, catalog, error=d.error) if d is not None else \
                hangroot.RankState(r, "missing", frame="no stack answered")
    majority = verdict.groups[0][1] if verdict is not None and verdict.groups else []
    flight = flightrec.wavefront(job.flight) if job.flight else {}
    if flight:
        inc.evidence.append({"ts": now, "source": "flight_recorder", "rule": "flight_recorder:wavefront",
                             "text": "; ".join(w for whys in list(flight.values())[:4] for w in whys[:1]),
                             "figures": {"ranks": sorted(flight)[:64], "dumps": len(job.flight)}})
    ev = catalog.evidence
    means = {k: (v[1] / v[0], v[2] / v[0]) for k, v in job.gpu_after.items() if v[0] > 0}
    gpu = hangroot.gpu_outliers(means, topo, util_gap=ev["gpu_util_gap"], power_ratio=ev["gpu_power_ratio"],
                                max_share=ev["gpu_max_share"]) if job.gpu_epoch is not None else {}
    machine = _machine_faults(desk, job, inc, float(ev["window_s"]), set(ev["machine_fault_kinds"]))
    if not (states or flight or gpu or machine):
        return None
    ranking = hangroot.rank_roots(states, topo, majority=majority, flight=flight, gpu=gpu, machine=machine,
                                  allowed=allowed, catalog=catalog)
    for s in ranking.suspects[:32]:
        for i, why in enumerate(s.reasons or ["ranked"]):
            inc.suspect(s.node, s.score, why, rank=s.ranks[i] if i < len(s.ranks) else None,
                        gpu=s.gpus[i] if i < len(s.gpus) else None)
    inc.evidence.append({"ts": now, "source": "stacks", "rule": "hangroot:rank",
                         "text": ("root: " + ", ".join(ranking.roots)) if ranking.roots else
                                 f"no single root: {ranking.why_not}",
                         "figures": {"suspects": [[s.node, s.score] for s in ranking.suspects[:8]],
                                     "states": dict(Counter(x.category for x in states.values()))}})
    return ranking


def _machine_faults(desk: Desk, job: JobState, inc: OpenIncident, window_s: float, kinds: set[str]) -> dict[str, str]:
    """Explicit machine faults of the job's machines near the hang: node -> what."""
    out: dict[str, str] = {}
    nodes = set(job.nodes)
    for other in desk.book.incidents.values():
        if other is inc or other.job != job.name or other.node not in nodes or other.kind not in kinds:
            continue
        if other.state.severity not in (None, "critical"):
            continue  # a warning (a non-fatal NVSwitch error, a corrected-error burst) breaks no collective
        if abs(other.opened_ts - inc.opened_ts) <= window_s:
            out.setdefault(str(other.node), f"{other.kind} on {other.node} ({other.summary or other.id})"[:200])
    return out


def _evict_roots(ranking: hangroot.RootRanking, verdict: StackVerdict | None) -> Decision:
    """Evict the machine(s) the evidence singles out as the root of the hang."""
    roots = ranking.roots
    top = {s.node: s for s in ranking.suspects}
    why = "; ".join(f"{n} (score {top[n].score:.2f}: {'; '.join(top[n].reasons[:3])})" for n in roots)
    nxt = next((s for s in ranking.suspects if s.node not in roots), None)
    runner_up = f"; next {nxt.node} at {nxt.score:.2f}" if nxt is not None else ""
    return Decision(ActionType.EVICT_NODES, tuple(roots), f"hang rooted at {', '.join(roots)}: {why}{runner_up}"[:900],
                    0.95, plan={"roots": list(roots), "scores": {s.node: s.score for s in ranking.suspects[:8]},
                                "root_ranks": sorted(r for n in roots for r in top[n].ranks)[:64],
                                "outliers": verdict.outliers[:256] if verdict else [],
                                "missing": verdict.missing[:256] if verdict else []})


def _never_left_hung(decision: Decision, ranking: hangroot.RootRanking | None, inc: OpenIncident,
                     allowed: int) -> Decision:
    """The group decision, kept within the blast radius and never a bare notification."""
    best = tuple(ranking.best(allowed)) if ranking is not None else ()
    why_not = f" (no single root: {ranking.why_not})" if ranking is not None and ranking.why_not else ""
    if decision.type == ActionType.EVICT_NODES:
        if len(decision.nodes) <= allowed:
            ordered = tuple(sorted(decision.nodes, key=lambda n: (-inc.suspects.get(n, {}).get("score", 0.0), n)))
            return Decision(ActionType.EVICT_NODES, ordered, f"hang in the {(decision.plan or {}).get('group', '')} "
                            f"group of {ordered[0]}: {decision.reason}{why_not}", decision.confidence, decision.plan)
        named = best or decision.nodes[:allowed]
        return Decision(ActionType.RUN_DIAGNOSTICS, named, f"hang: the group holding every outlier is "
                        f"{len(decision.nodes)} machines, over the blast radius ({allowed}); restart with stop-time "
                        f"diagnostics on the best-ranked {', '.join(named)}{why_not}", 0.6, decision.plan)
    if decision.type == ActionType.NOTIFY:
        cats = Counter(s.category for s in ranking.states.values()) if ranking is not None else Counter()
        common = cats.most_common(1)[0] if cats else ("", 0)
        if common[0] in ("input", "storage") and common[1] >= 0.5 * sum(cats.values()):
            # every rank waits on data or storage together: the shared input/storage, not a machine or a restart
            return Decision(ActionType.NOTIFY, (), f"hang with every rank waiting on {common[0]} ({common[1]} of "
                            f"{sum(cats.values())} ranks): a job-wide {common[0]} stall, no machine to blame", 0.5)
        return Decision(ActionType.RUN_DIAGNOSTICS, best, f"hang with no machine singled out{why_not}: restart with "
                        f"stop-time diagnostics{' on ' + ', '.join(best) if best else ''}", 0.5)
    if decision.type == ActionType.RUN_DIAGNOSTICS and not decision.nodes and best:
        return Decision(ActionType.RUN_DIAGNOSTICS, best, f"{decision.reason}; best-ranked: {', '.join(best)}",
                        decision.confidence)
    return decision


def _gpu_since_last_step(job: JobState, sample: GpuSample) -> None:
    """Per-GPU utilisation and power since the job's last step (what hangroot compares during a hang)."""
    last = job.progress.last_step_ts
    if last is None or sample.ts <= last + max(5.0, 2.0 * job.progress.median_step_s()):
        return
    _gpu_figures_since_last_step(job, sample.node, last, ((g.index, g.util, g.power_w) for g in sample.gpus))


def _gpu_figures_since_last_step(job: JobState, node: str, last: float,
                                 figures: Iterable[tuple[int, float | None, float | None]]) -> None:
    """_gpu_since_last_step on (GPU index, utilisation, power) of a sample after the grace."""
    if job.gpu_epoch != last:
        job.gpu_after, job.gpu_epoch = {}, last
    for index, util, power in figures:
        if util is None and power is None:
            continue
        acc = job.gpu_after.setdefault((node, index), [0.0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += util if util is not None else -1.0
        acc[2] += power or 0.0
