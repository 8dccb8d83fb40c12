"""Fail-slow detection on workload-normalised step time (ResiHP-style).

Each rank's compute time is divided by what the workload predicts
(models/predictor.py), so a batch of long sequences leaves the ratio near 1.0.
A one-sided CUSUM per rank on ``log(ratio)`` (reference drift ``k``, decision
threshold ``h``) accumulates persistent excess and ignores jitter: a 10%
slowdown crosses the default threshold in about a dozen steps, a 40% one in two.

Localisation: the slow machine's ranks *compute* longer while every other rank
*waits* longer (its comm time rises), so the ranks whose compute ratio alarms
name the machine, and the others' wait is the corroborating evidence (against the job's
healthy wait, or, with no history yet, against the slow ranks' own wait in the same step: in a
synchronous all-reduce the slowest rank waits least, its peers by about its extra compute). When most
ranks alarm together, or step duration rises with no rank's compute behind it
(a slow data loader or file system: every rank waits on input), the finding is
job-level (``kind="job_slow"``, action ``notify``): there is no machine to blame.

Detector interface (the diagnosis engine plugs detectors in structurally):
``name``, ``set_topology``, ``observe(record) -> list[Finding]``,
``tick(now) -> list[Finding]``; ``observe_step(records)`` scores a whole step at
once (batch readers and benchmarks).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from faultlens.models.params import load_params
from faultlens.models.predictor import JobStepPredictor, StepResiduals, huber_fit
from faultlens.schema import Finding, StepTiming
from faultlens.stream.topology import DIMS, Topology


@dataclass(frozen=True)
class FailSlowParams:
    drift_ref: float = 0.05  # k = log(1 + drift_ref): half the smallest slowdown we must catch (10%)
    threshold: float = 0.5  # h, in summed log-ratio units
    job_fraction: float = 0.5  # this share of ranks alarming at once: job-level, not a machine
    job_confirm_steps: int = 5  # duration-only excess must last this long before job_slow
    rearm_steps: int = 50  # a reported node is reported again only after this many quiet steps
    stale_s: float = 120.0  # an incomplete step is scored anyway after this long
    late_steps: int = 5  # ... or once this many newer steps have arrived
    warmup_steps: int = 20
    skip_first_steps: int = 5  # a job's first steps (compilation, cache warm-up) are slow by nature
    min_job_slowdown: float = 0.10  # a job-level alarm needs this mean excess over its alarm run
    job_warmup_steps: int = 50  # healthy steps before the job-level step-time fit is trusted
    refit_every: int = 25
    window_steps: int = 200
    peer_z: float = 3.0  # a machine's excess over the peers' median must be this many noise scales ...
    min_peer_margin: float = 0.04  # ... and at least this (log units) over the peers and over its own baseline
    noise_floor: float = 0.01  # the job's noise scale (robust spread of its ranks' log ratios) is never below this
    baseline_alpha: float = 0.02  # weight of a step in a rank's own baseline (out of alarm runs only)
    confirm_steps: int = 2  # an alarm run shorter than this is not blamed, whatever its size ...
    quiet_noise: float = 0.03  # ... on a job this quiet; a noisier job's alarms must last noise/quiet_noise times longer
    max_confirm_steps: int = 16  # (never more than this)

    @classmethod
    def from_catalog(cls, path: str | None = None) -> FailSlowParams:
        return cls(**load_params("failslow", cls, path))


@dataclass
class _Job:
    predictor: JobStepPredictor
    rank_index: dict[int, int] = field(default_factory=dict)
    cusum: np.ndarray = field(default_factory=lambda: np.zeros(0))
    run_len: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    run_sum: np.ndarray = field(default_factory=lambda: np.zeros(0))
    job_cusum: float = 0.0
    job_alarm_steps: int = 0
    job_alarm_excess: list[float] = field(default_factory=list)  # log excess of the current alarm run
    compute_alarm_steps: int = 0  # consecutive steps with most ranks' compute alarming together
    job_slow_reported: bool = False
    overhead: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=200))  # (max pred, duration)
    duration_fit: np.ndarray | None = None
    wait_base: deque[float] = field(default_factory=lambda: deque(maxlen=200))
    reported: dict[str, int] = field(default_factory=dict)  # node -> step reported
    quiet: dict[str, int] = field(default_factory=dict)
    pending: dict[int, list[StepTiming]] = field(default_factory=dict)
    pending_ts: dict[int, float] = field(default_factory=dict)
    expected: int = 0
    steps: int = 0
    scored_upto: int = -1  # highest step scored
    run_rel: np.ndarray = field(default_factory=lambda: np.zeros(0))  # sum of the excess over the peers' median, per run
    baseline: np.ndarray = field(default_factory=lambda: np.zeros(0))  # a rank's own usual excess over its peers
    spread: deque[float] = field(default_factory=lambda: deque(maxlen=200))  # per step: robust spread of log ratios


class FailSlowDetector:
    """Per-rank CUSUM on the workload residual ratio, rolled up per node and group."""

    name = "failslow"

    def __init__(self, params: FailSlowParams | None = None, *, seed: int = 0) -> None:
        self.params = params or FailSlowParams.from_catalog()
        self.seed = seed
        self._k = math.log1p(self.params.drift_ref)
        self._topologies: dict[str, Topology] = {}
        self._jobs: dict[str, _Job] = {}

    # ---- interface
    def set_topology(self, topology: Topology) -> None:
        self._topologies[topology.job] = topology
        job = self._jobs.get(topology.job)
        if job is not None:
            job.predictor.topology = topology
            job.expected = topology.world_size

    def observe(self, record: object) -> list[Finding]:
        if not isinstance(record, StepTiming):
            return []
        job = self._job(record.job)
        out: list[Finding] = []
        if record.step <= job.scored_upto:
            return out  # a straggling record of a step already scored: scoring it again would count it twice
        # Older steps that never completed are scored once a few newer steps exist
        # (ranks' records reach us through different agents, not in step order).
        for step in sorted(s for s in job.pending if s <= record.step - self.params.late_steps):
            out += self._score(record.job, job, job.pending.pop(step))
            job.pending_ts.pop(step, None)
        bucket = job.pending.setdefault(record.step, [])
        bucket.append(record)
        job.pending_ts[record.step] = max(job.pending_ts.get(record.step, 0.0), record.ts)
        if job.expected and len(bucket) >= job.expected:
            out += self._score(record.job, job, job.pending.pop(record.step))
            job.pending_ts.pop(record.step, None)
        return out

    def tick(self, now: float) -> list[Finding]:
        out: list[Finding] = []
        for name, job in self._jobs.items():
            for step in sorted(s for s, ts in job.pending_ts.items() if ts < now - self.params.stale_s):
                out += self._score(name, job, job.pending.pop(step))
                job.pending_ts.pop(step, None)
        return out

    def observe_step(self, records: Iterable[StepTiming]) -> list[Finding]:
        """Score one complete step (every rank's timing) at once."""
        recs = list(records)
        if not recs:
            return []
        return self._score(recs[0].job, self._job(recs[0].job), recs)

    # ---- state
    def _job(self, name: str) -> _Job:
        job = self._jobs.get(name)
        if job is None:
            p = self.params
            topo = self._topologies.get(name)
            job = self._jobs[name] = _Job(predictor=JobStepPredictor(
                topology=topo, window_steps=p.window_steps, refit_every=p.refit_every,
                warmup_steps=p.warmup_steps, seed=self.seed))
            job.expected = topo.world_size if topo else 0
        return job

    def _index(self, job: _Job, ranks: np.ndarray) -> np.ndarray:
        new = [int(r) for r in ranks if int(r) not in job.rank_index]
        if new:
            for r in new:
                job.rank_index[r] = len(job.rank_index)
            grow = len(job.rank_index) - len(job.cusum)
            job.cusum = np.concatenate([job.cusum, np.zeros(grow)])
            job.run_len = np.concatenate([job.run_len, np.zeros(grow, dtype=np.int64)])
            job.run_sum = np.concatenate([job.run_sum, np.zeros(grow)])
            job.run_rel = np.concatenate([job.run_rel, np.zeros(grow)])
            job.baseline = np.concatenate([job.baseline, np.zeros(grow)])
        return np.fromiter((job.rank_index[int(r)] for r in ranks), dtype=np.int64, count=len(ranks))

    # ---- scoring
    def _score(self, name: str, job: _Job, recs: list[StepTiming]) -> list[Finding]:
        job.scored_upto = max(job.scored_upto, recs[0].step)
        if not job.expected or len(recs) > job.expected:
            job.expected = max(job.expected, len(recs))
        job.steps += 1
        if job.steps <= self.params.skip_first_steps:
            return []
        res = job.predictor.observe_step(recs)
        if not res.ready:
            return []
        idx = self._index(job, res.ranks)
        x = np.log(np.where(np.isfinite(res.ratio), res.ratio, 1.0))
        s = np.maximum(0.0, job.cusum[idx] + x - self._k)
        started = (job.cusum[idx] == 0) & (s > 0)
        job.run_len[idx] = np.where(s > 0, np.where(started, 1, job.run_len[idx] + 1), 0)
        job.run_sum[idx] = np.where(s > 0, np.where(started, x, job.run_sum[idx] + x), 0.0)
        job.cusum[idx] = s
        # Against the peers: the excess of each rank over the median rank at this very step (a step that
        # slowed the whole job moves the median too), scaled by how much ranks spread apart on this job.
        d = x - float(np.median(x))
        job.spread.append(1.4826 * float(np.median(np.abs(d))))
        job.run_rel[idx] = np.where(s > 0, np.where(started, d, job.run_rel[idx] + d), 0.0)
        quiet = s == 0  # against its own history: a rank's usual excess, learnt out of alarm runs only
        job.baseline[idx] = np.where(quiet, job.baseline[idx] + self.params.baseline_alpha * (d - job.baseline[idx]),
                                     job.baseline[idx])
        alarm = s > self.params.threshold
        blamed = alarm & self._sustained(job, idx)

        wait = float(np.nanmedian(res.comm_s)) if np.isfinite(res.comm_s).any() else math.nan
        max_pred = float(np.nanmax(res.predicted_s))
        duration = float(np.median(res.duration_s))
        out: list[Finding] = []
        frac = float(alarm.mean())
        # Without fwd/bwd/comm a rank's time is the whole step's, shared by all: nothing to localise.
        breakdown = any(r.comm_s is not None or r.fwd_s is not None for r in recs)
        together = float(np.exp(np.median(x)) - 1.0)
        job.compute_alarm_steps = job.compute_alarm_steps + 1 if (frac >= self.params.job_fraction or (
            alarm.any() and not breakdown)) else 0
        # The whole job slower together: for long enough (longer on a noisy job) and by a real margin.
        job_level = job.compute_alarm_steps >= self._steps_needed(job, 1) and together >= self._job_margin(job)
        if alarm.any() and not breakdown:
            if job_level:
                out += self._job_slow(name, job, res, reason="step", figure=together)
        elif blamed.any():
            # A rank clear of its peers is a machine, even while a stale fit has most ranks alarming.
            out += self._localise(name, job, res, blamed, x)
        elif frac >= self.params.job_fraction and job_level:
            out += self._job_slow(name, job, res, reason="compute", figure=together)
        # Duration with no compute behind it: every rank waited on something outside the GPUs.
        # Step time ~ c0 + c1 * (slowest rank's predicted compute): pipeline fill/drain grows
        # with the work, the all-reduce and optimizer step do not.
        if len(job.overhead) >= self.params.job_warmup_steps and (job.duration_fit is None or job.steps % self.params.refit_every == 0):
            pairs = np.asarray(job.overhead)
            job.duration_fit = huber_fit(np.column_stack([np.ones(len(pairs)), pairs[:, 0]]), pairs[:, 1])
        if job.duration_fit is not None:
            expected = float(job.duration_fit[0] + job.duration_fit[1] * max_pred)
            jr = math.log(duration / max(expected, 1e-9))
            job.job_cusum = max(0.0, job.job_cusum + jr - self._k)
            if job.job_cusum > self.params.threshold:
                job.job_alarm_steps += 1
                job.job_alarm_excess.append(jr)
            else:
                job.job_alarm_steps, job.job_alarm_excess = 0, []
            excess = math.expm1(float(np.mean(job.job_alarm_excess[-self.params.job_confirm_steps:]))) if job.job_alarm_excess else 0.0
            if (job.job_alarm_steps >= self._steps_needed(job, self.params.job_confirm_steps) and not alarm.any()
                    and excess >= self._job_margin(job)):
                out += self._job_slow(name, job, res, reason="duration", figure=excess)
        healthy_step = not alarm.any() and job.job_cusum == 0.0
        if healthy_step:
            job.overhead.append((max_pred, duration))
            if math.isfinite(wait):
                job.wait_base.append(wait)
        if job.job_slow_reported and healthy_step:
            job.job_slow_reported = False
            job.predictor.frozen = False
        # Re-arm nodes that have been quiet for a while.
        quiet_nodes = set(job.reported) - {res.nodes[i] for i in np.flatnonzero(alarm)}
        for node in quiet_nodes:
            job.quiet[node] = job.quiet.get(node, 0) + 1
            if job.quiet[node] >= self.params.rearm_steps:
                job.reported.pop(node)
                job.quiet.pop(node)
                topo = self._topologies.get(name)
                job.predictor.excluded -= set(topo.ranks_on(node)) if topo else set()
        return out

    def noise(self, job: _Job) -> float:
        """The job's noise scale: the median over recent steps of its ranks' robust spread (log units)."""
        return max(self.params.noise_floor, float(np.median(job.spread)) if job.spread else 0.0)

    def _steps_needed(self, job: _Job, base: int) -> int:
        """``base`` steps on a quiet job; proportionally more on a noisy one (contention comes in bursts)."""
        p = self.params
        scale = max(1.0, self.noise(job) / p.quiet_noise)
        return int(min(max(base, p.max_confirm_steps), math.ceil(base * scale)))

    def _job_margin(self, job: _Job) -> float:
        """The least job-wide excess that is a slowdown and not the job's own jitter."""
        return max(self.params.min_job_slowdown, math.expm1(self.noise(job)))

    def _sustained(self, job: _Job, idx: np.ndarray) -> np.ndarray:
        """Ranks whose alarm run stands clear of their peers and of their own history.

        A machine is slow only against both: over the run, its mean excess over the median rank must
        exceed ``peer_z`` noise scales (and ``min_peer_margin``), measured from its own usual excess when
        that is positive (a rank that always lags a little is not slower today), for ``confirm_steps``.
        On a quiet GPU fleet (spread ~1.5%) a 10% slowdown clears this; on jittery CPU ranks (spread
        10-30%, contention phases that last a hundred steps) it takes a real slowdown, not a phase.
        """
        p = self.params
        n = job.run_len[idx]
        rel = job.run_rel[idx] / np.maximum(n, 1)
        need = max(p.min_peer_margin, p.peer_z * self.noise(job))
        steps = self._steps_needed(job, p.confirm_steps)
        return (n >= steps) & (rel >= need) & (rel - np.maximum(job.baseline[idx], 0.0) >= need)

    def _localise(self, name: str, job: _Job, res: StepResiduals, alarm: np.ndarray,
                  x: np.ndarray) -> list[Finding]:
        out = []
        topo = self._topologies.get(name)
        alarmed_nodes = sorted({res.nodes[i] for i in np.flatnonzero(alarm)})
        for node in alarmed_nodes:
            job.quiet.pop(node, None)
            if node in job.reported:
                continue
            on_node = np.array([n == node for n in res.nodes])
            # The node's other ranks half-way to the threshold are part of the same slowdown.
            sel = np.flatnonzero(on_node & (job.cusum[self._index(job, res.ranks)] > self.params.threshold / 2))
            ranks = [int(res.ranks[i]) for i in sel]
            ri = np.array([job.rank_index[r] for r in ranks])
            slowdown = float(np.median(np.exp(job.run_sum[ri] / np.maximum(job.run_len[ri], 1)) - 1.0))
            residual = float(np.median(res.ratio[sel]))
            steps = int(np.max(job.run_len[ri]))
            others = np.array([n != node for n in res.nodes])
            peer_ratio = float(np.nanmedian(res.ratio[others])) if others.any() else math.nan
            if math.isfinite(peer_ratio) and residual <= peer_ratio:
                # No slower than its peers at this very step (a real CPU job under load: residual 1.26,
                # peers 1.29, and a healthy node drained): not now; a machine that is slow stays slow.
                continue
            wait_inc = math.nan
            if job.wait_base and np.isfinite(res.comm_s[others]).any():
                wait_inc = float(np.nanmedian(res.comm_s[others]) - np.median(job.wait_base))
            # No healthy history of the wait yet (a job minutes old): the same step's peers wait longer than
            # the slow ranks by at least half their extra compute (a real rank capped at 5% of a CPU: peers'
            # comm 0.3-0.5 s, its own 0.1 s, its compute +0.3 s)
            own_wait, than = res.comm_s[sel], "than their usual"
            if not math.isfinite(wait_inc) and np.isfinite(own_wait).any() and np.isfinite(res.comm_s[others]).any():
                extra = float(np.median(res.compute_s[sel]) - np.median(res.compute_s[others]))
                gap = float(np.nanmedian(res.comm_s[others]) - np.nanmedian(own_wait))
                if extra > 0 and gap >= 0.5 * extra:
                    wait_inc, than = gap, f"than rank(s) {_short(ranks)}"
            job.reported[node] = res.step
            job.predictor.excluded |= set(ranks)
            gpus = sorted({topo.gpu_of(r) for r in ranks if r in topo.placement}) if topo else []
            groups = self._groups(topo, ranks)
            corroborated = math.isfinite(wait_inc) and wait_inc > 0
            confidence = min(0.95, 0.6 + 0.2 * corroborated + min(0.15, slowdown))
            text = (f"{node}: rank(s) {_short(ranks)} compute {slowdown:+.0%} over their workload-predicted "
                    f"time for {steps} steps (residual {residual:.2f}, peers {peer_ratio:.2f})")
            if corroborated:
                text += f"; the other ranks wait {wait_inc:+.3f} s more per step {than}"
            out.append(Finding(
                ts=res.ts, kind="fail_slow", category="unknown",
                severity="critical" if slowdown >= 0.2 else "warning", action="evict_node",
                confidence=round(confidence, 3), source="model:failslow", rule="failslow.cusum", text=text,
                node=node, job=name, gpu=gpus[0] if len(gpus) == 1 else None,
                rank=ranks[0] if len(ranks) == 1 else None,
                figures={"slowdown": round(slowdown, 4), "residual": round(residual, 4), "steps": steps,
                         "step": res.step, "ranks": ranks, "gpus": gpus, "peer_residual": round(peer_ratio, 4),
                         "peer_wait_increase_s": None if not math.isfinite(wait_inc) else round(wait_inc, 4),
                         "cusum": round(float(np.max(job.cusum[ri])), 3), "groups": groups}))
        return out

    @staticmethod
    def _groups(topo: Topology | None, ranks: list[int]) -> dict[str, list[int]]:
        """Per parallel dimension, the one group holding every slow rank (when there is one)."""
        if topo is None or not ranks or max(ranks) >= topo.world_size:
            return {}
        out = {}
        for d in DIMS:
            groups = {topo.group(r, d) for r in ranks}
            if getattr(topo, d) > 1 and len(groups) == 1:
                out[d] = list(groups.pop())
        return out

    def _job_slow(self, name: str, job: _Job, res: StepResiduals, *, reason: str, figure: float) -> list[Finding]:
        if job.job_slow_reported:
            return []
        job.job_slow_reported = True
        job.predictor.frozen = True
        where = {"compute": "every rank's compute",
                 "step": "step time (no per-rank fwd/bwd/comm reported, so no machine can be singled out)",
                 "duration": "step time with no rank's compute behind it (input, storage or the whole fabric)"}[reason]
        return [Finding(
            ts=res.ts, kind="job_slow", category="storage" if reason == "duration" else "unknown",
            severity="warning", action="notify", confidence=0.7, source="model:failslow", rule=f"failslow.job_{reason}",
            text=f"job {name} slower together: {where} {figure:+.0%} over the workload prediction; no single machine",
            job=name, figures={"slowdown": round(figure, 4), "step": res.step, "reason": reason,
                               "ranks_alarming": int((job.cusum > self.params.threshold).sum())})]


def _short(ranks: list[int]) -> str:
    return ",".join(map(str, ranks)) if len(ranks) <= 4 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)})"
