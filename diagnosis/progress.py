"""A job's training progress and its hosts' liveness: a hang found from the data itself.

A hung job leaves no error line of its own: its step streams stop while its hosts go
on (NVML samples keep coming; a rank stuck in a collective keeps its GPU spinning, a
stuck process keeps its GPU memory; py-spy can still dump its stack). A job that
finished stops its steps too, but its GPUs go idle and release their memory, or
nothing more is heard from its hosts at all. So a hang is called when:

* the silence since the job's last step is well past the job's own pace: the larger
  of ``min_silence_s``, ``step_multiple`` median steps and ``gap_multiple`` times the
  longest pause the job has already survived (a checkpoint save), capped by
  ``max_silence_s`` (settings.HangSettings); at the end of a batch input, where no
  more can come, a shorter ``end_*`` threshold applies;
* and the hosts are seen alive after the last step: GPU samples that are busy or still
  hold the job's memory, or stack dumps taken after it. Samples that are all idle with
  the memory released say the job ended, and no hang is opened.

Ranks whose own steps stopped while the job's others go on (or that stopped a step
behind) are named in the evidence: they are where the stacks should look first.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from faultlens.diagnosis.settings import HangSettings
from faultlens.schema import GpuSample, StackDump, StepTiming

BUSY_UTIL = 30.0  # a GPU this busy after the last step is spinning (NCCL kernels wait busily)
IDLE_UTIL = 10.0


@dataclass
class HangCall:
    """What the progress watch saw when it called a hang."""

    ts: float  # when the silence crossed the threshold
    confidence: float
    text: str
    figures: dict[str, Any]
    lagging_ranks: list[int]
    subset: bool = False  # some ranks stopped while the others step on (not the whole job's silence)


@dataclass
class JobProgress:
    """Steps and host liveness of one job (plain data: ``to_dict``/``from_dict`` for checkpoints)."""

    last_step_ts: float | None = None
    last_step: int = -1
    durations: deque[float] = field(default_factory=lambda: deque(maxlen=256))
    max_gap_s: float = 0.0  # longest pause between two steps the job came through
    steps_seen: int = 0
    rank_last: dict[int, tuple[float, int]] = field(default_factory=dict)  # rank -> (ts, step)
    util_seen: bool = False  # util was ever above idle while stepping (else util is not reported)
    mem_ref: float = 0.0  # running mean of GPU memory used while stepping
    after_n: int = 0  # GPU samples after the last step (+ grace), and what they showed
    after_busy: int = 0
    after_idle: int = 0
    after_held: int = 0
    after_released: int = 0
    hang_open: str | None = None
    hang_pending_since: float | None = None  # online: wall time a silence was first judged a hang (dwell)
    hang_step: int | None = None  # the job's last step when the hang was called
    subset_called: list[int] = field(default_factory=list)  # the silent subset already reported
    ended_step: int | None = None  # judged finished at this step (idle, memory released)
    # One of the job's own pauses its framework announced (diagnosis.pauses): which, since when, at which
    # step, how long it may last, and when its end line came (None: not yet). Cleared by the next step.
    pause: str | None = None
    pause_since: float | None = None
    pause_step: int | None = None
    pause_max_s: float = 0.0
    pause_ended: float | None = None
    # The hang a silence of the whole job opened (its incident id) and the job's last step then: a step
    # after it says the silence was a pause that ended (workflows.hang), never a restart.
    silence_hang: str | None = None
    silence_hang_step: int | None = None

    def observe_step(self, rec: StepTiming) -> None:
        prev = self.last_step_ts
        if rec.step > self.last_step:
            if prev is not None and self.steps_seen >= 3:
                self.max_gap_s = max(self.max_gap_s, rec.ts - prev)
            self.last_step = rec.step
            self.steps_seen += 1
            if rec.duration_s is not None and rec.duration_s > 0:
                self.durations.append(float(rec.duration_s))
                self.__dict__.pop("_median", None)  # median_step_s's cache
        if prev is None or rec.ts > prev:
            self.last_step_ts = rec.ts
            if self.after_n:
                self.after_n = self.after_busy = self.after_idle = self.after_held = self.after_released = 0
        last = self.rank_last.get(rec.rank)
        if last is None or rec.step >= last[1]:
            self.rank_last[rec.rank] = (rec.ts, rec.step)
        if self.ended_step is not None and rec.step > self.ended_step:
            self.ended_step = None
        if self.hang_open is not None and self.hang_step is not None and rec.step > self.hang_step + 2:
            self.hang_open = self.hang_step = None  # training resumed: a later stop is a new hang
        if self.pause is not None and self.pause_step is not None and rec.step > self.pause_step:
            self.pause = self.pause_since = self.pause_step = self.pause_ended = None  # the pause is over

    def observe_pause(self, name: str, ts: float, max_s: float, *, ends: bool) -> None:
        """A framework line that begins (or ends) one of the job's own pauses (diagnosis.pauses)."""
        if ends:
            if self.pause is not None:
                self.pause_ended = ts
            return
        if self.pause is None or self.pause_step != self.last_step:
            self.pause, self.pause_since, self.pause_step, self.pause_ended = name, ts, self.last_step, None
        self.pause_max_s = max_s

    def median_step_s(self) -> float:
        # Kept until the next duration (not a field: never written): read for every GPU sample, a
        # median of 256 floats each time was ~5% of a big post-mortem.
        median = self.__dict__.get("_median")
        if median is None:
            median = self.__dict__["_median"] = statistics.median(self.durations) if self.durations else 1.0
        return median

    def observe_gpu(self, sample: GpuSample) -> None:
        if self.last_step_ts is None or not sample.gpus:
            return
        utils = [g.util for g in sample.gpus if g.util is not None]
        mems = [g.mem_used_mb for g in sample.gpus if g.mem_used_mb]
        self.observe_gpu_means(sample.ts, utils, mems, max(5.0, 2.0 * self.median_step_s()))

    def observe_gpu_means(self, ts: float, utils: list[float], mems: list[float], grace: float) -> None:
        """observe_gpu on a sample's known utilisations and non-zero memory figures (the columnar hot
        path reads them without a GpuState); ``grace``: max(5 s, twice the median step)."""
        if self.last_step_ts is None:
            return
        util = sum(utils) / len(utils) if utils else None
        mem = sum(mems) / len(mems) if mems else None
        if ts <= self.last_step_ts + grace:
            if util is not None and util > IDLE_UTIL:
                self.util_seen = True
            if mem is not None:
                self.mem_ref = mem if self.mem_ref <= 0 else 0.95 * self.mem_ref + 0.05 * mem
            return
        self.after_n += 1
        if util is not None and self.util_seen:
            self.after_busy += util >= BUSY_UTIL
            self.after_idle += util < IDLE_UTIL
        if mem is not None and self.mem_ref > 0:
            self.after_held += mem >= 0.5 * self.mem_ref
            self.after_released += mem < 0.2 * self.mem_ref
        elif mem is None and self.mem_ref > 0:
            self.after_released += 1  # memory was reported while training and is gone

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("durations", "rank_last")}
        d["durations"] = list(self.durations)
        d["rank_last"] = {str(r): list(v) for r, v in self.rank_last.items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> JobProgress:
        p = cls(**{k: v for k, v in d.items() if k not in ("durations", "rank_last")})
        p.durations.extend(d.get("durations") or [])
        p.rank_last = {int(r): (float(v[0]), int(v[1])) for r, v in (d.get("rank_last") or {}).items()}
        return p


def silence_threshold(p: JobProgress, hang: HangSettings, *, final: bool) -> float:
    """Seconds without a step that make a hang, from the job's own pace (see the module doc)."""
    median = p.median_step_s()
    if final:
        return min(hang.max_silence_s, max(hang.end_min_silence_s, hang.end_step_multiple * median,
                                           hang.end_gap_multiple * p.max_gap_s))
    return min(hang.max_silence_s, max(hang.min_silence_s, hang.step_multiple * median,
                                       hang.gap_multiple * p.max_gap_s))


def check_hang(p: JobProgress, now: float, hang: HangSettings, *, final: bool,
               stacks: Iterable[StackDump] = ()) -> HangCall | None:
    """A hang call when the job's steps stopped while its hosts are alive; None otherwise."""
    if p.last_step_ts is None or p.hang_open is not None or p.steps_seen < 2:
        return None
    if p.ended_step is not None and p.ended_step >= p.last_step:
        return None
    threshold = silence_threshold(p, hang, final=False)
    silence = now - p.last_step_ts
    if silence < threshold and final:
        threshold = silence_threshold(p, hang, final=True)
    threshold = _past_the_pause(p, threshold)
    if silence < threshold:
        silent = _lagging_ranks(p, threshold)
        if silent and silent != p.subset_called:
            p.subset_called = silent
            return _subset_call(p, now, threshold, silent)
        return None
    lagging = _lagging_ranks(p, 0.0)
    stacks_after = sum(1 for d in stacks if d.ts > p.last_step_ts)
    alive, why = _liveness(p, stacks_after)
    if alive is False:
        p.ended_step = p.last_step
        return None
    if alive is None:
        return None  # nothing heard from the hosts since: the input ended or the hosts are gone, not a hang
    median = p.median_step_s()
    figures: dict[str, object] = {"silence_s": round(silence, 1), "threshold_s": round(threshold, 1), "last_step": p.last_step,
               "median_step_s": round(median, 3), "longest_pause_s": round(p.max_gap_s, 1),
               "gpu_samples_after": p.after_n, "busy_after": p.after_busy, "memory_held_after": p.after_held,
               "stacks_after": stacks_after, "end_of_input": final}
    if lagging:
        figures["lagging_ranks"] = lagging[:64]
    past = ""
    if p.pause is not None:
        figures["pause"] = p.pause
        past = f", past the job's own {p.pause} pause"
    text = (f"no step progress for {silence:.0f} s (last step {p.last_step}; median step {median:.2f} s; "
            f"threshold {threshold:.0f} s{past}) while the hosts are alive: {why}")
    return HangCall(ts=p.last_step_ts + threshold, confidence=0.6, text=text, figures=figures, lagging_ranks=lagging)


def _past_the_pause(p: JobProgress, threshold: float) -> float:
    """The silence that makes a hang while the job is in one of its own announced pauses: up to the pause's
    ``max_s`` from its start while it lasts, and the usual ``threshold`` counted from its end line after."""
    if p.pause is None or p.pause_since is None or p.last_step_ts is None:
        return threshold
    if p.pause_ended is not None:
        return max(threshold, p.pause_ended - p.last_step_ts + threshold)
    return max(threshold, p.pause_since - p.last_step_ts + p.pause_max_s)


def _liveness(p: JobProgress, stacks_after: int) -> tuple[bool | None, str]:
    """True (alive), False (the job ended: idle and memory released), None (nothing heard)."""
    if stacks_after:
        return True, f"{stacks_after} stack dump(s) taken after the last step"
    if p.after_n == 0:
        return None, "no samples after the last step"
    n = p.after_n
    if p.after_busy >= 0.5 * n:
        return True, f"{p.after_busy}/{n} GPU samples busy after the last step"
    if p.after_held >= 0.5 * n:
        return True, f"{p.after_held}/{n} GPU samples still hold the job's memory"
    informative = p.util_seen or p.mem_ref > 0  # util/memory were reported while the job trained
    idle = p.after_idle >= 0.9 * n if p.util_seen else True
    released = p.after_released >= 0.5 * n if p.mem_ref > 0 else True
    if n >= 2 and informative and idle and released:
        return False, "GPUs idle with memory released: the job ended"
    return True, f"{n} GPU samples after the last step"


def _lagging_ranks(p: JobProgress, silent_s: float) -> list[int]:
    """Ranks behind the job's last step and silent for over ``silent_s`` before it (a minority only)."""
    if len(p.rank_last) < 2 or p.last_step_ts is None:
        return []
    top = max(step for _, step in p.rank_last.values())
    behind = [r for r, (ts, step) in p.rank_last.items() if step < top and p.last_step_ts - ts > silent_s]
    if len(behind) > len(p.rank_last) // 2:
        return []  # most ranks behind: the reporting is sparse, not a subset stopped
    return sorted(behind)


def _subset_call(p: JobProgress, now: float, threshold: float, lagging: list[int]) -> HangCall:
    ts = max(p.rank_last[r][0] for r in lagging) + threshold
    text = (f"ranks {lagging[:16]} stopped stepping (silent for over {threshold:.0f} s) while the job's other "
            f"ranks go on to step {p.last_step}")
    return HangCall(ts=min(ts, now), confidence=0.5, text=text,
                    figures={"lagging_ranks": lagging[:64], "threshold_s": round(threshold, 1), "last_step": p.last_step},
                    lagging_ranks=lagging, subset=True)
