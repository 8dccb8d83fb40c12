"""Step marks and the hang dwell (diagnosis/online/watermark.py): a backlog whose GPU samples come before
its step timings is no hang; a job whose steps were read and stopped still is, once it lasted the dwell.

The fleet (tests/fleetgen) goes through the online service's apply stage as repartitioned messages, the
way benchmarks/engine_throughput.py feeds it, in the order a client draining a backlog may hand it over:
the GPU samples 100 s ahead of the step timings. Marks are interleaved as a repartitioner sends them:
after the forwards they cover, to every partition."""

from __future__ import annotations

import collections
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from faultlens.diagnosis.online import watermark
from faultlens.stream.bus import Consumer, Message, Producer, ensure_topics
from faultlens.stream.topics import DEFAULT_PARTITIONS, REPARTITION_PARTITIONS
from tests import fleetgen

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import engine_throughput  # noqa: E402 - the benchmark's fleet-to-messages and service set-up

STEPS_PARTITIONS = 4
STEPS_DEFAULT = range(DEFAULT_PARTITIONS["steps"])
LEAD_S = 100.0


def _stream(*, marks: bool, stop_steps_of: str | None = None, lead_s: float = LEAD_S) -> list[Message]:
    """The fleet as repartitioned messages, GPU samples ``lead_s`` ahead of the steps; with ``marks``, a
    mark to every partition after every 400 messages saying how far the steps were read (the newest
    step forwarded per step partition; the wall clock less the lateness once all was read)."""
    fl = fleetgen.fleet(jobs=4, nodes_per_job=4, unjobbed=0, duration_s=240, gpu_interval_s=1.0, faulty_jobs=0,
                        t0=time.time() - 300)
    if stop_steps_of is not None:  # that job's steps stop half way: a real hang
        cut = fl.records[0].ts + 120
        fl.records = [r for r in fl.records if not (type(r).KIND == "steps" and r.job == stop_steps_of and r.ts > cut)]
    msgs = engine_throughput._messages(fl, REPARTITION_PARTITIONS)
    topologies = [m for m in msgs if m.header("k") == b"jobs"]
    rest = sorted((m for m in msgs if m.header("k") != b"jobs"),
                  key=lambda m: m.timestamp_ms / 1000 - (lead_s if m.header("k") == b"gpu" else 0.0))
    read: dict[int, float] = dict.fromkeys(range(STEPS_PARTITIONS), 0.0)
    out: list[Message] = []
    offsets: collections.Counter[int] = collections.Counter()

    def put(m: Message) -> None:
        out.append(dataclasses.replace(m, offset=offsets[m.partition]))
        offsets[m.partition] += 1

    def mark(until: dict[int, float]) -> None:
        value = watermark.encode("x.steps", STEPS_PARTITIONS, until)
        for d in range(REPARTITION_PARTITIONS):
            put(Message(kind="diag-repartition", topic="x.diag-repartition", partition=d, offset=0,
                        key=watermark.WM_KEY, value=value, timestamp_ms=0, headers=(("k", watermark.WM_KIND),)))

    for m in topologies:
        put(m)
    for i, m in enumerate(rest):
        put(m)
        if m.header("k") == b"steps":
            p = watermark.steps_partition(m.key or "", STEPS_PARTITIONS)
            read[p] = max(read[p], m.timestamp_ms / 1000)
        if marks and i % 400 == 399:
            mark(dict(read))
    if marks:
        mark(dict.fromkeys(range(STEPS_PARTITIONS), time.time() - watermark.LATENESS_S))  # read to the end
    return out


def _outputs(stream: list[Message], *, dwell_s: float = 0.0, then_wait_s: float = 0.0) -> tuple[list[Any], list[Any]]:
    """What the service decided while applying ``stream``, and after ``then_wait_s`` more of wall time."""
    svc = engine_throughput._service(REPARTITION_PARTITIONS)
    svc.tick_interval_s = 0.0
    svc.hang_dwell_s = dwell_s
    outputs: list[Any] = []

    def drain() -> list[Any]:
        out = [o for st in svc.states.values() for o in st.outbox]
        for st in svc.states.values():
            st.outbox = []
        return out

    for i in range(0, len(stream), 500):
        svc._apply(stream[i:i + 500])
        outputs += drain()
    svc._tick(force=True)
    outputs += drain()
    time.sleep(then_wait_s)
    svc._tick(force=True)
    return outputs, drain()


def _hangs(outputs: list[Any]) -> set[str]:
    return {o.job for o in outputs if type(o).KIND == "incidents" and o.kind == "hang"}


@pytest.mark.broker
def test_the_step_partition_is_where_a_producer_puts_the_job(bus: Any) -> None:
    jobs = ["job0000", "job0001", "train-7b", "a" * 40, "llama-70b-run3"]
    ensure_topics(bus, names=["steps"])
    with Producer(bus) as p:
        for job in jobs:
            p.send_raw("steps", job, b"x")
        p.flush(10)
    n = len(STEPS_DEFAULT)
    got: dict[str, int] = {}
    with Consumer(bus, ["steps"], group_id=None, from_beginning=True) as c:
        deadline = time.monotonic() + 20
        while len(got) < len(jobs) and time.monotonic() < deadline:
            got.update({m.key or "": m.partition for m in c.poll(200)})
    assert got == {job: watermark.steps_partition(job, n) for job in jobs}
    assert len(set(got.values())) > 1  # spread: the test can fail


def test_marks_are_checked_and_the_newest_stands() -> None:
    marks = watermark.StepMarks()
    assert marks.read_until(3, "job0000") is None
    assert marks.note(3, watermark.encode("x.steps", 4, {0: 100.0, 1: 100.0, 2: 100.0, 3: 100.0}))
    p = watermark.steps_partition("job0000", 4)
    assert marks.read_until(3, "job0000") == 100.0
    assert marks.note(3, watermark.encode("x.steps", 4, dict.fromkeys(range(4), 50.0)))  # a new holder reads again
    assert marks.read_until(3, "job0000") == 50.0
    assert marks.note(3, watermark.encode("x.steps", 4, {0: 100.0, 1: 100.0, 2: 100.0, 3: 100.0}))
    assert marks.read_until(4, "job0000") is None  # another partition has heard nothing
    for bad in (b"", b"garbage", b'{"v": 1}', b'{"v": 1, "topic": "s", "n": 4, "until": {"9": 1.0}}',
                b'{"v": 1, "topic": "s", "n": 4, "until": {"0": "x"}}', b'{"v": 2, "topic": "s", "n": 4, "until": {}}',
                b'{"v": 1, "topic": "s", "n": 4, "until": {"0": NaN}}'):
        assert not marks.note(3, bad)
    assert marks.bad == 7 and marks.read_until(3, "job0000") == 100.0
    marks.forget(3)
    assert marks.read_until(3, "job0000") is None and p in range(4)


def test_a_backlog_whose_gpu_samples_run_ahead_of_its_steps_is_no_hang() -> None:
    without, _ = _outputs(_stream(marks=False))
    assert _hangs(without), "the skewed stream no longer makes a false hang without marks: the test proves nothing"
    with_marks, _ = _outputs(_stream(marks=True))
    assert not _hangs(with_marks) and not any(type(o).KIND == "actions" for o in with_marks)


def test_without_marks_the_dwell_lets_late_steps_arrive_first() -> None:
    """Marks cover what the client has not handed over yet; the dwell what producers send late."""
    during, after = _outputs(_stream(marks=False), dwell_s=2.0, then_wait_s=2.2)
    assert not _hangs(during) and not _hangs(after)


@pytest.mark.parametrize("lead_s", [0.0, LEAD_S])
def test_a_job_whose_steps_were_read_and_stopped_is_still_a_hang(lead_s: float) -> None:
    during, _ = _outputs(_stream(marks=True, stop_steps_of="job0002", lead_s=lead_s))
    assert _hangs(during) == {"job0002"}


def test_a_real_hang_is_called_once_it_has_lasted_the_dwell() -> None:
    during, after = _outputs(_stream(marks=True, stop_steps_of="job0002"), dwell_s=2.0, then_wait_s=2.2)
    assert not _hangs(during), "called before the dwell (or the apply took over 2 s)"
    assert _hangs(after) == {"job0002"}
