"""The engine's settings, built once from the configuration and the policy catalog.

Each figure is written in one place: the step analysis (hang thresholds, settle times)
in the policy catalog's ``[steps]`` table (diagnosis/catalogs/policy.toml), the hang's
upper bound and the online dwell in ``[diagnosis]`` of the configuration. Nothing else
holds a default for them: a ``[steps]`` key missing from the catalog fails at start,
naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from faultlens.config import Config
from faultlens.errors import CatalogError


def _need(steps: Mapping[str, float], key: str) -> float:
    if key not in steps:
        raise CatalogError(f"the [steps] table has no {key}", file="diagnosis/catalogs/policy.toml", entry=f"steps.{key}")
    return float(steps[key])


@dataclass(frozen=True)
class HangSettings:
    """When a silence of a job's steps is a hang, and how long the hang waits before it decides
    (diagnosis.progress: the larger of the three ``*_silence``/``*_multiple`` figures, capped)."""

    min_silence_s: float  # no step for at least this long...
    step_multiple: float  # ...and this many median step intervals...
    gap_multiple: float  # ...and this many times the longest pause the job already came through
    end_min_silence_s: float  # at a batch input's end (nothing more can come): the shorter thresholds
    end_step_multiple: float
    end_gap_multiple: float
    max_silence_s: float  # the upper bound ([diagnosis] hang_no_progress_s)
    grace_s: float  # after a hang opens, wait this long for an explicit cause to explain it
    stacks_wait_s: float  # online: how long to wait for stack answers after dump_stacks
    # online: once every rank answered dump_stacks, decide this long after the request (the Flight Recorder
    # answers, a late explicit cause) instead of waiting out grace_s
    answered_wait_s: float
    # Online service only: a silence must stay a hang this long in wall time before it is called
    # ([diagnosis] hang_dwell_s: a backlog's steps can reach the service after its GPU samples). 0: at once.
    dwell_s: float = 0.0


@dataclass(frozen=True)
class EngineSettings:
    """Everything the engine and its workflows decide with that is not a catalog rule."""

    hang: HangSettings
    nan_settle_s: float  # NaN loss: wait this long (and 3 median steps) for the other ranks
    exception_settle_s: float  # a user exception: wait this long for the other ranks' tracebacks
    notify_delay_s: float  # a held notification goes out after this long if nothing stronger came
    # The live service only: its decisions carry their evidence's age and the engine's lag, and are
    # judged by [diagnosis] max_evidence_age_s (0: off); engines built otherwise (batch, replays, tests
    # of recorded input) carry neither and judge no evidence stale.
    live: bool = False
    max_evidence_age_s: float = 0.0

    @classmethod
    def from_config(cls, config: Config, steps: Mapping[str, float], *, wall_clock_dwell: bool = False) -> EngineSettings:
        """``steps``: the policy catalog's ``[steps]`` table. ``wall_clock_dwell``: the online service's
        engines (they wait ``[diagnosis] hang_dwell_s`` of wall time before calling a hang)."""
        d = config.diagnosis
        hang = HangSettings(
            min_silence_s=_need(steps, "hang_min_silence_s"), step_multiple=_need(steps, "hang_step_multiple"),
            gap_multiple=_need(steps, "hang_gap_multiple"), end_min_silence_s=_need(steps, "end_min_silence_s"),
            end_step_multiple=_need(steps, "end_step_multiple"), end_gap_multiple=_need(steps, "end_gap_multiple"),
            max_silence_s=d.hang_no_progress_s, grace_s=_need(steps, "hang_grace_s"),
            stacks_wait_s=_need(steps, "stacks_wait_s"), answered_wait_s=_need(steps, "stacks_answered_wait_s"),
            dwell_s=d.hang_dwell_s if wall_clock_dwell else 0.0)
        return cls(hang=hang, nan_settle_s=_need(steps, "nan_settle_s"),
                   exception_settle_s=_need(steps, "exception_settle_s"), notify_delay_s=_need(steps, "notify_delay_s"),
                   live=wall_clock_dwell, max_evidence_age_s=d.max_evidence_age_s if wall_clock_dwell else 0.0)
