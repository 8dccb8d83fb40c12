"""Replaying time-ordered records through an engine on event time (the batch path and tests)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from faultlens.diagnosis.engine import DiagnosisEngine, Output


def run_records(engine: DiagnosisEngine, records: Iterable[Any], *, tick_every_s: float = 10.0,
                progress: Callable[[int], None] | None = None, progress_every: int = 20_000) -> list[Output]:
    """Feed time-ordered records, ticking on event time; a final tick settles what is pending.

    ``progress(n)`` is called every ``progress_every`` records with the count so far.
    """
    outputs: list[Output] = []
    next_tick: float | None = None
    for n, rec in enumerate(records, 1):
        if progress is not None and n % progress_every == 0:
            progress(n)
        ts = getattr(rec, "ts", None)
        if isinstance(ts, (int, float)):
            if next_tick is None or ts - next_tick > 100 * tick_every_s:
                if next_tick is not None:  # a long silence in the input: one tick covers it
                    outputs.extend(engine.tick(next_tick))
                next_tick = ts + tick_every_s
            while ts >= next_tick:
                outputs.extend(engine.tick(next_tick))
                next_tick += tick_every_s
        outputs.extend(engine.observe(rec))
    outputs.extend(engine.tick(engine.now))
    outputs.extend(engine.tick(engine.now, final=True))
    return outputs
