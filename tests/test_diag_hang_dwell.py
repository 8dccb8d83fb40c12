"""The online hang dwell ([diagnosis] hang_dwell_s): a backlog whose GPU samples come before its step
timings is no hang; a job whose steps stopped still is, once the silence lasted the dwell in wall time.

The fleet (tests/fleetgen) goes through the online service's apply stage as repartitioned messages, the
way benchmarks/engine_throughput.py feeds it, in the order a client draining a backlog may hand it over:
the GPU samples 100 s ahead of the step timings (event time moves with the GPU samples)."""

from __future__ import annotations

import collections
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from faultlens.diagnosis.engine import DiagnosisEngine
from faultlens.stream.bus import Message
from faultlens.stream.topics import REPARTITION_PARTITIONS
from tests import fleetgen

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import engine_throughput  # noqa: E402 - the benchmark's fleet-to-messages and service set-up

LEAD_S = 100.0


def _stream(*, stop_steps_of: str | None = None, lead_s: float = LEAD_S) -> list[Message]:
    """The fleet as repartitioned messages, its GPU samples ``lead_s`` ahead of its steps."""
    fl = fleetgen.fleet(jobs=4, nodes_per_job=4, unjobbed=0, duration_s=240, gpu_interval_s=1.0, faulty_jobs=0,
                        t0=time.time() - 300)
    if stop_steps_of is not None:  # that job's steps stop half way: a real hang
        cut = fl.records[0].ts + 120
        fl.records = [r for r in fl.records if not (type(r).KIND == "steps" and r.job == stop_steps_of and r.ts > cut)]
    msgs = engine_throughput._messages(fl, REPARTITION_PARTITIONS)
    topologies = [m for m in msgs if m.header("k") == b"jobs"]
    rest = sorted((m for m in msgs if m.header("k") != b"jobs"),
                  key=lambda m: m.timestamp_ms / 1000 - (lead_s if m.header("k") == b"gpu" else 0.0))
    offsets: collections.Counter[int] = collections.Counter()
    out = []
    for m in topologies + rest:
        out.append(dataclasses.replace(m, offset=offsets[m.partition]))
        offsets[m.partition] += 1
    return out


def _outputs(stream: list[Message], *, dwell_s: float, then_wait_s: float = 0.0) -> tuple[list[Any], list[Any]]:
    """What the service decided while applying ``stream``, and after ``then_wait_s`` more of wall time."""
    svc = engine_throughput._service(REPARTITION_PARTITIONS)
    svc.tick_interval_s = 0.0
    svc.config = dataclasses.replace(svc.config, diagnosis=dataclasses.replace(svc.config.diagnosis, hang_dwell_s=dwell_s))

    def drain() -> list[Any]:
        out = [o for st in svc.states.values() for o in st.outbox]
        for st in svc.states.values():
            st.outbox = []
        return out

    during: list[Any] = []
    for i in range(0, len(stream), 500):
        svc._apply(stream[i:i + 500])
        during += drain()
    svc._tick(force=True)
    during += drain()
    time.sleep(then_wait_s)
    svc._tick(force=True)
    return during, drain()


def _hangs(outputs: list[Any]) -> set[str]:
    return {o.job for o in outputs if type(o).KIND == "incidents" and o.kind == "hang"}


def test_the_default_dwell_is_on() -> None:
    from faultlens.config import DiagnosisConfig

    assert DiagnosisConfig().hang_dwell_s >= 10.0
    service = engine_throughput._service(REPARTITION_PARTITIONS)
    assert service.make_engine().settings.hang.dwell_s == DiagnosisConfig().hang_dwell_s
    assert DiagnosisEngine(service.config).settings.hang.dwell_s == 0.0  # outside the service: at once


def test_a_backlog_whose_gpu_samples_run_ahead_of_its_steps_is_no_hang() -> None:
    at_once, _ = _outputs(_stream(), dwell_s=0.0)
    assert _hangs(at_once), "the skewed backlog no longer makes a false hang without the dwell: the test proves nothing"
    during, after = _outputs(_stream(), dwell_s=2.0, then_wait_s=2.2)
    assert not _hangs(during) and not _hangs(after)
    assert not any(type(o).KIND == "actions" for o in during + after)


@pytest.mark.parametrize("lead_s", [0.0, LEAD_S])
def test_a_job_whose_steps_stopped_is_a_hang_once_it_lasted_the_dwell(lead_s: float) -> None:
    during, after = _outputs(_stream(stop_steps_of="job0002", lead_s=lead_s), dwell_s=2.0, then_wait_s=2.2)
    assert not _hangs(during), "called before the dwell (or the apply took over 2 s)"
    assert _hangs(after) == {"job0002"}
