"""A partition's clock (diagnosis/online/clocks.py): event time, and a bounded idle advance."""

from __future__ import annotations

import time

from faultlens.diagnosis.online.clocks import PartitionClocks

T = 1_700_000_000.0


def test_a_quiet_partition_moves_on_for_its_settle_times_but_never_far_enough_to_call_a_hang() -> None:
    """A simulated fleet that ended was restarted as hung once its partition's clock ran on with the wall
    clock (tests/test_e2e_pipeline.py in CI): silence alone moves the clock at most idle_max_s."""
    clocks = PartitionClocks(max_skew_s=5.0, idle_after_s=2.0, idle_max_s=30.0)
    assert clocks.now(0, time.monotonic()) is None
    clocks.heard(0, T)
    mono = time.monotonic()
    assert clocks.now(0, mono + 1.0) == T  # not quiet yet: event time
    assert abs(clocks.now(0, mono + 10.0) - (T + 10.0)) < 0.5  # an exception's settle ends
    assert abs(clocks.now(0, mono + 600.0) - (T + 30.0)) < 0.5  # ...but ten minutes of nothing is not a hang
    clocks.heard(0, T + 5.0)  # a record: event time again, and the quiet starts over
    assert clocks.now(0, time.monotonic() + 1.0) == T + 5.0
    clocks.heard(0, None)  # a record with no time of its own (action-status) is still heard
    assert clocks.times[0] == T + 5.0


def test_a_record_from_the_future_does_not_move_the_clock_past_the_allowed_skew() -> None:
    clocks = PartitionClocks(max_skew_s=5.0, idle_after_s=0.0, idle_max_s=30.0)
    clocks.heard(3, 4_102_444_800.0)  # 2100-01-01
    assert clocks.times[3] <= time.time() + 5.0
    clocks.forget(3)
    assert clocks.now(3, time.monotonic()) is None
