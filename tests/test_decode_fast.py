"""The columnar GPU fast path gives the careful path's record, and leaves every unusual sample to it."""

from __future__ import annotations

import math
import random

import msgspec
import pytest

from faultlens import decode as dec
from faultlens.errors import SchemaError
from faultlens.schema import GpuSample, GpuState


def _careful(payload: bytes) -> GpuSample | str:
    obj = msgspec.msgpack.decode(payload)
    try:
        return dec.from_obj("gpu", dec.columns_to_obj(obj, "gpu"))
    except SchemaError as exc:
        return exc.reason


def _sample(rng: random.Random, n: int) -> GpuSample:
    gpus = []
    for i in range(n):
        gpus.append(GpuState(
            index=i, util=rng.choice([0.0, 97.5, rng.random() * 100]), temp_c=60.0 + rng.random(),
            power_w=rng.choice([0.0, 650.25]), throttle_reasons=rng.choice([0, 0, 4, 1 << 40]),
            ecc_dbe=rng.choice([0, 0, 3]), uuid=rng.choice(["", f"GPU-{i:04x}"]),
            pci_bus=rng.choice(["", f"0000:{i:02x}:00.0"]), remap_pending=rng.choice([False, False, True]),
            mem_used_mb=rng.choice([0.0, 81920.0])))
    return GpuSample(ts=1_700_000_000.0 + rng.random(), node=f"n{rng.randrange(99)}", job=rng.choice([None, "j1"]),
                     gpus=gpus)


def test_fast_path_answers_for_agent_samples_with_the_careful_record() -> None:
    rng = random.Random(3)
    answered = 0
    for _ in range(300):
        sample = _sample(rng, rng.choice([0, 1, 8]))
        payload = dec.encode_wire(sample)
        got = dec.decode("gpu", payload, content_type=dec.MSGPACK_TYPE)
        assert got == _careful(payload) == sample
        answered += dec.columnar_gpu_fast(msgspec.msgpack.decode(payload)) is not None
    assert answered > 150  # flags set (0/1 columns) go the careful way; the rest is fast


@pytest.mark.parametrize("change", [
    {"data": None},  # not bytes
    {"n": 7},  # data length does not match
    {"cols": "index,util,util"},  # a repeated column
    {"cols": "index,bogus"},  # an unknown column
    {"extra": 1},  # an unknown key (reported by the careful path)
    {"v": 99},  # an unreadable version
    {"ts": float("nan")},
    {"ts": 1e300},
    {"uuid": "a\nb"},  # two uuids for eight GPUs
    {"nulls": {"util": [None] * 8}},
])
def test_unusual_samples_go_the_careful_way(change: dict) -> None:
    rng = random.Random(5)
    sample = _sample(rng, 8)
    obj = dict(msgspec.msgpack.decode(dec.encode_wire(msgspec.structs.replace(
        sample, gpus=[msgspec.structs.replace(g, remap_pending=False) for g in sample.gpus]))))
    assert dec.columnar_gpu_fast(dict(obj)) is not None
    obj.update(change)
    assert dec.columnar_gpu_fast(obj) is None
    payload = msgspec.msgpack.encode(obj)
    try:
        got: GpuSample | str = dec.decode("gpu", payload, content_type=dec.MSGPACK_TYPE)
    except SchemaError as exc:
        got = exc.reason
    assert got == _careful(payload)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_gpu_value_is_nulled_as_before(bad: float) -> None:
    sample = GpuSample(ts=1_700_000_000.0, node="n1", gpus=[GpuState(index=0, util=bad), GpuState(index=1, util=50.0)])
    payload = dec.encode_wire(sample)
    assert dec.columnar_gpu_fast(msgspec.msgpack.decode(payload)) is None
    got = dec.decode("gpu", payload, content_type=dec.MSGPACK_TYPE)
    assert got == _careful(payload)
    assert got.gpus[0].util is None and math.isclose(got.gpus[1].util, 50.0)


def test_the_fast_path_applies_the_time_bounds_of_every_path() -> None:
    """A columnar sample stamped 2100 or 1970 (within the calendar, outside the bounds) is refused by the
    fast path exactly as by the careful one: the lake and the jobs' clocks never see it."""
    for ts, reason in ((4102444800.0, "ts_future"), (12.5, "ts_past")):
        wire = dec.encode_wire(GpuSample(ts=ts, node="bad", gpus=[GpuState(index=0, util=1.0)]))
        with pytest.raises(SchemaError) as info:
            dec.decode("gpu", wire)
        assert info.value.reason == reason
