"""NaN/Inf loss: first look for a machine, else stop-time checks on the job's machines.

ByteRobust treats NaN or Inf in the loss as possible silent data corruption: a GPU that
computes wrong numbers poisons its own rank's loss and gradients first, and the
all-reduce then spreads the NaN to every rank one step later. So the watch keeps, per
rank, the first step at which its loss or grad norm stopped being a number (JSON has
no NaN: a loss that turns null where it was a number counts) or jumped far above its
own running level. When a minority of ranks went bad at an earlier step than the rest,
their machines are the suspects; a log line that names a rank (Megatron's "found NaN
in local grad norm") names one directly. Machine evidence in the window (ECC, Xid,
row remapping on a node of the job) is looked up by the engine. With none of it, the
decision is stop-time diagnostics on every machine of the job, never "no action".
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from faultlens.schema import StepTiming

DIVERGE_FACTOR = 10.0  # a loss/grad norm this many times the rank's running level has diverged
WARMUP_STEPS = 5
LOOKBACK_STEPS = 20  # a divergence this many steps before the first NaN still leads to it
RANK_IN_TEXT_RE = re.compile(r"\brank[\s:=#]*(\d+)", re.IGNORECASE)


def _finite(x: float | None) -> bool:
    return x is not None and not math.isnan(x) and not math.isinf(x)


@dataclass
class RankLevel:
    """A rank's running level of loss and grad norm (EMA) and its first bad step."""

    loss: float | None = None
    grad: float | None = None
    n: int = 0
    seen_loss: bool = False
    first_bad: tuple[int, float, str] | None = None  # (step, ts, what): first non-finite value
    diverged: tuple[int, float, str] | None = None  # the latest jump far above the running level


@dataclass
class NanWatch:
    """Per job: which ranks went bad first (plain data, ``to_dict``/``from_dict``)."""

    ranks: dict[int, RankLevel] = field(default_factory=dict)
    nan_signals: int = 0
    named: dict[int, str] = field(default_factory=dict)  # rank -> a log line that named it

    def observe(self, rec: StepTiming) -> str | None:
        """The reason this step is non-finite (a NaN signal), or None. Divergence is recorded, not signalled."""
        lv = self.ranks.setdefault(rec.rank, RankLevel())
        bad = None
        if rec.loss is not None and not _finite(rec.loss):
            bad = f"loss={rec.loss}"
        elif rec.grad_norm is not None and not _finite(rec.grad_norm) and rec.loss is None:
            bad = f"grad_norm={rec.grad_norm}"
        elif rec.loss is None and lv.seen_loss and (rec.grad_norm is None or not _finite(rec.grad_norm)):
            bad = "loss missing where it was a number (JSON has no NaN)"
        if bad is not None:
            if lv.first_bad is None:
                lv.first_bad = (rec.step, rec.ts, bad)
            return bad
        if rec.grad_norm is not None and not _finite(rec.grad_norm):
            # The loss is still a number: a gradient that overflowed on this rank. Not a NaN signal
            # (fp16 loss scaling skips such steps on every rank together), but a lead when this rank
            # is alone in it and the loss goes NaN within LOOKBACK_STEPS.
            if lv.first_bad is None and (lv.diverged is None or rec.step > lv.diverged[0] + LOOKBACK_STEPS):
                lv.diverged = (rec.step, rec.ts, f"grad_norm={rec.grad_norm}")
            return None
        diverged = self._diverged(lv, rec)
        if diverged and lv.first_bad is None and (lv.diverged is None or rec.step > lv.diverged[0] + LOOKBACK_STEPS):
            lv.diverged = (rec.step, rec.ts, diverged)
        if _finite(rec.loss):
            lv.seen_loss = True
        if not diverged:
            lv.loss = _ema(lv.loss, rec.loss)
            lv.grad = _ema(lv.grad, rec.grad_norm)
            lv.n += 1
        return None

    @staticmethod
    def _diverged(lv: RankLevel, rec: StepTiming) -> str | None:
        if lv.n < WARMUP_STEPS:
            return None
        for name, value, level in (("loss", rec.loss, lv.loss), ("grad_norm", rec.grad_norm, lv.grad)):
            if _finite(value) and level is not None and level > 0 and abs(value) > DIVERGE_FACTOR * level:  # type: ignore[arg-type]
                return f"{name}={value:.4g}, {abs(value) / level:.0f}x its running level"  # type: ignore[arg-type]
        return None

    def name_rank(self, rank: int, text: str) -> None:
        self.named.setdefault(rank, text[:300])

    def culprit_ranks(self) -> tuple[list[int], str]:
        """Ranks that went bad first, as a minority; ([], why not) when no rank stands out."""
        if self.named:
            ranks = sorted(self.named)
            return ranks, f"rank(s) {ranks} reported NaN in their own gradients first: {next(iter(self.named.values()))}"
        nonfinite = [lv.first_bad[0] for lv in self.ranks.values() if lv.first_bad is not None]
        if not nonfinite:
            return [], "no rank went bad before the others"
        horizon = min(nonfinite) - LOOKBACK_STEPS
        bad: dict[int, tuple[int, float, str]] = {}
        for r, lv in self.ranks.items():
            marks = [m for m in (lv.first_bad, lv.diverged) if m is not None and m[0] >= horizon]
            if marks:
                bad[r] = min(marks)
        first = min(step for step, _, _ in bad.values())
        leaders = sorted(r for r, (step, _, _) in bad.items() if step == first)
        reporting = len(self.ranks)
        if len(leaders) * 2 > reporting or reporting < 2:
            return [], f"{len(leaders)}/{reporting} ranks went bad together at step {first}: no rank went first"
        whats = bad[leaders[0]][2]
        later = sorted({step for step, _, _ in bad.values() if step > first})
        return leaders, (f"rank(s) {leaders[:16]} diverged first at step {first} ({whats}); "
                         f"{len(bad) - len(leaders)} other rank(s) followed" + (f" from step {later[0]}" if later else ""))

    def to_dict(self) -> dict[str, Any]:
        return {"nan_signals": self.nan_signals, "named": {str(k): v for k, v in self.named.items()},
                "ranks": {str(r): {"loss": lv.loss, "grad": lv.grad, "n": lv.n, "seen_loss": lv.seen_loss,
                                   "first_bad": list(lv.first_bad) if lv.first_bad else None,
                                   "diverged": list(lv.diverged) if lv.diverged else None}
                          for r, lv in self.ranks.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> NanWatch:
        w = cls(nan_signals=int(d.get("nan_signals", 0)), named={int(k): v for k, v in (d.get("named") or {}).items()})
        for r, v in (d.get("ranks") or {}).items():
            fb, dv = v.get("first_bad"), v.get("diverged")
            w.ranks[int(r)] = RankLevel(v.get("loss"), v.get("grad"), int(v.get("n", 0)), bool(v.get("seen_loss")),
                                        (int(fb[0]), float(fb[1]), str(fb[2])) if fb else None,
                                        (int(dv[0]), float(dv[1]), str(dv[2])) if dv else None)
        return w


def _ema(level: float | None, value: float | None, alpha: float = 0.2) -> float | None:
    if not _finite(value):
        return level
    v = abs(float(value))  # type: ignore[arg-type]
    return v if level is None else (1 - alpha) * level + alpha * v


def rank_named_in(text: str, default: int | None) -> int | None:
    """The rank a NaN log line names ("Rank 3: found NaN ..."), else the line's own rank."""
    m = RANK_IN_TEXT_RE.search(text)
    return int(m.group(1)) if m else default
