"""GPU samples kept columnar (faultlens.decode.GpuColumns) give what reading each sample as its record gives.

Online diagnosis takes a sample that repeats its node's counters without building GpuStates
(rules.CounterRules.steady, engine._steady_gpu). These tests feed the same samples both ways,
with every kind of counter change, a GPU that vanishes, nulls, time going back and a job whose
steps stop, and compare findings, outputs and the state left behind.
"""

from __future__ import annotations

import random
from typing import Any

import msgspec

from faultlens import decode as dec
from faultlens.config import Config, DiagnosisConfig
from faultlens.decode import GpuColumns
from faultlens.diagnosis.engine import DiagnosisEngine
from faultlens.diagnosis.online.state import JobState, restore, snapshot
from faultlens.diagnosis.rules import CounterRules
from faultlens.schema import GpuSample, GpuState, StepTiming
from tests import fleetgen


def _samples(rng: random.Random, nodes: int, seconds: int, t0: float = 1_700_000_000.0) -> list[GpuSample]:
    """1 Hz samples of 8 GPUs per node: mostly steady, with every counter a rule reads changing now and then."""
    state = {(n, g): {"pcie_replay": 0, "nvlink_errors": 0, "ecc_dbe": 0, "retired_pages": 0, "throttle_reasons": 0}
             for n in range(nodes) for g in range(8)}
    out = []
    for k in range(seconds):
        for n in range(nodes):
            gpus = []
            for g in range(8):
                c = state[(n, g)]
                roll = rng.random() * 4
                if roll < 0.001:
                    c["ecc_dbe"] += 1
                elif roll < 0.002:
                    c["retired_pages"] += 1
                elif roll < 0.005:
                    c["pcie_replay"] += rng.choice([1, 40])  # a burst crosses 30/min
                elif roll < 0.007:
                    c["nvlink_errors"] += 15
                elif roll < 0.009 or (c["throttle_reasons"] and roll < 0.1):
                    c["throttle_reasons"] = rng.choice([0, 0x40, 0x20])  # thermal bits (held a while), or none
                if (n, g, k) == (3, 0, 120):
                    c["pcie_replay"] += 40  # 40 replays in a minute: over 30/min
                if (n, g) == (1, 3) and 40 <= k < 60:
                    continue  # GPU 3 of node 1 leaves the samples for 20 s
                clock = 1400.0 if c["throttle_reasons"] else 1980.0
                gpus.append(GpuState(index=g, util=rng.choice([0.0, 90.0 + rng.random()]), temp_c=60.0,
                                     sm_clock_mhz=clock, mem_used_mb=rng.choice([0.0, 70_000.0]),
                                     lost=(n, g) == (2, 5) and k >= 70, **c))
            ts = t0 + k + n * 1e-3
            if n == 0 and k == 50:
                ts -= 3.0  # one sample stamped in the past
            out.append(GpuSample(ts=ts, node=f"node{n}", job="job0", gpus=gpus))
    return out


def _columnar(rules: CounterRules, payload: bytes) -> tuple[list[Any], bool]:
    """What the online engine does with one sample's bytes (engine.observe / _steady_gpu); True: steady."""
    got = dec.decode("gpu", payload, columnar=True)
    if isinstance(got, GpuColumns):
        if rules.steady(got):
            return [], True
        record = got.record()
        found = rules.observe(record)
        rules.begin_run(got, record)
        return found, False
    return rules.observe(got), False


def _memory(rules: CounterRules) -> dict[Any, Any]:
    for node in list(rules._runs):
        rules.end_run(node)
    return {k: (m.last, m.edge, m.quiet, {f: list(h) for f, h in m.history.items()}, m.streak, m.active, m.last_fired)
            for k, m in rules._gpus.items()}


def test_steady_runs_give_the_findings_and_memory_of_sample_by_sample_rules() -> None:
    samples = _samples(random.Random(7), nodes=4, seconds=300)
    steady, plain = CounterRules(), CounterRules()
    taken, kinds = 0, set()
    for s in samples:
        found, took = _columnar(steady, dec.encode_wire(s))
        want = plain.observe(s)
        assert found == want
        taken += took
        kinds |= {f.kind for f in want}
    assert _memory(steady) == _memory(plain)
    assert taken > len(samples) // 3  # most samples repeat their counters: the steady path took them
    assert kinds >= {"ecc_uncorrectable", "pcie_degradation", "nvlink_error", "thermal_throttle", "gpu_lost"}, kinds


def _fleet_records() -> list[Any]:
    """A small fleet (fleetgen) with counter changes and a job whose steps stop (its hang window)."""
    fl = fleetgen.fleet(jobs=3, nodes_per_job=2, unjobbed=1, duration_s=240, gpu_interval_s=1.0, faulty_jobs=3)
    rng = random.Random(3)
    records: list[Any] = list(fl.topologies)
    for r in fl.records:
        if isinstance(r, StepTiming) and r.job == "job0001" and r.ts > fleetgen.T0 + 120:
            continue  # job0001 stops stepping: a hang, read GPU by GPU
        if isinstance(r, GpuSample):
            k = int(r.ts - fleetgen.T0)
            gpus = list(r.gpus)
            if r.node == "j0000n01" and k >= 100:
                gpus[2] = msgspec.structs.replace(gpus[2], ecc_dbe=1 + (k >= 150))  # a double-bit error, twice
            if r.node == "j0002n00" and 60 <= k < 120:
                gpus[4] = msgspec.structs.replace(gpus[4], pcie_replay=2 * (k - 60))  # 120 replays/min
            if r.node == "j0002n01" and k % 37 == 0:
                gpus[1] = msgspec.structs.replace(gpus[1], util=None)  # a null: the careful path, the last known
            if rng.random() < 0.01:
                gpus = gpus[:7]  # a GPU left out of one sample
            r = msgspec.structs.replace(r, gpus=gpus)
        records.append(r)
    return records


def _engine() -> DiagnosisEngine:
    return DiagnosisEngine(Config(diagnosis=DiagnosisConfig(catalog_path="")), batch=False)


def _feed(engine: DiagnosisEngine, records: list[Any], *, columnar: bool) -> list[Any]:
    out = []
    for r in records:
        payload = dec.encode_wire(r)
        out.extend(engine.observe(dec.decode(type(r).KIND, payload, columnar=columnar)))
        if int(r.ts) % 10 == 0:
            out.extend(engine.tick(r.ts))
    out.extend(engine.tick(records[-1].ts + 600))
    return out


def test_the_engine_decides_the_same_on_columnar_samples() -> None:
    records = _fleet_records()
    fast, slow = _engine(), _engine()
    got, want = _feed(fast, records, columnar=True), _feed(slow, records, columnar=False)
    assert got == want
    assert slow.counts["findings"] >= 2 and len(slow.incidents()) >= 4  # the counters' findings, the faults'
    assert any(a.type == "evict_nodes" for a in want if type(a).KIND == "actions")
    assert slow.state.jobs["job0001"].progress.after_n > 60  # the samples after its last step, read GPU by GPU
    assert fast.counts == slow.counts
    assert sum(r.samples for r in fast.counters._runs.values()) > 100  # the steady path took samples
    assert [j.progress.to_dict() for j in fast.state.jobs.values()] == [j.progress.to_dict() for j in slow.state.jobs.values()]
    assert [(j.gpu_after, j.gpu_epoch) for j in fast.state.jobs.values()] == [(j.gpu_after, j.gpu_epoch) for j in
                                                                          slow.state.jobs.values()]
    assert slow.state.jobs["job0001"].gpu_after  # the hang's per-GPU figures were gathered
    assert _memory(fast.counters) == _memory(slow.counters)


def test_a_checkpoint_taken_during_a_steady_run_restores_it() -> None:
    records = _fleet_records()
    half = len(records) // 2
    engine = _engine()
    for r in records[:half]:
        engine.observe(dec.decode(type(r).KIND, dec.encode_wire(r), columnar=True))
    assert engine.counters._runs  # runs open at the checkpoint
    back = restore(snapshot(JobState("job", 0, engine)), 0, lambda key: _engine(), "job").engine
    rest = records[half:]
    assert _feed(back, rest, columnar=True) == _feed(engine, rest, columnar=True)
    assert _memory(back.counters) == _memory(engine.counters)
