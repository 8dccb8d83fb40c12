"""Simulator outputs: determinism, healthy runs without fault signatures, schema round trips,
the live writer, the simulated NVML backend, suites and the CLI."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import orjson

from faultlens import schema
from faultlens.cli import main
from faultlens.collectors.nvml_backend import NvmlBackend
from faultlens.datasets.cluster import ClusterSpec
from faultlens.datasets.nvml_sim import SimulatedNvml
from faultlens.datasets.scenario import FaultSpec, Scenario, ScenarioSpec
from faultlens.datasets.scenario_files import LiveWriter, write_batch_dir
from faultlens.datasets.suite import long_run_spec, write_suite
from faultlens.stream.topology import Topology

CLUSTER = ClusterSpec(nodes=2, tp=4, pp=2, dp=2, microbatches=4, job="jt")


def _spec(kind: str | None = None, seed: int = 3, **kw) -> ScenarioSpec:
    faults = (FaultSpec(kind=kind, id="f1", **kw),) if kind else ()
    return ScenarioSpec(name=kind or "healthy", seed=seed, cluster=CLUSTER, duration_s=300, faults=faults)


def _digest(d: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(d.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(d)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    a = write_batch_dir(Scenario(_spec("gpu_lost")), tmp_path / "a")
    b = write_batch_dir(Scenario(_spec("gpu_lost")), tmp_path / "b")
    c = write_batch_dir(Scenario(_spec("gpu_lost", seed=4)), tmp_path / "c")
    assert _digest(a) == _digest(b) != _digest(c)


def test_batch_dir_layout_and_job(tmp_path: Path) -> None:
    d = write_batch_dir(Scenario(_spec("hang_stuck_rank")), tmp_path / "d")
    job = orjson.loads((d / "job.json").read_bytes())
    topo = Topology.from_job(job)
    assert (topo.tp, topo.pp, topo.dp, topo.world_size) == (4, 2, 2, 16) and topo.node_of(15) == "n002"
    truth = orjson.loads((d / "truth.json").read_bytes())
    assert set(truth) == {"scenario", "seed", "job", "start_ts", "duration_s", "nodes", "gpus_per_node", "faults"}
    for node in ("n001", "n002"):
        assert (d / "nodes" / node / "kernel.log").exists() and (d / "nodes" / node / "gpu.jsonl").exists()
        assert len(list((d / "nodes" / node / "nccl").glob("rank*.log"))) == 8
    assert sorted(int(p.stem) for p in (d / "stacks").glob("*.txt")) == list(range(16))


def test_healthy_has_no_fault_signature(tmp_path: Path) -> None:
    d = write_batch_dir(Scenario(_spec()), tmp_path / "h")
    assert orjson.loads((d / "truth.json").read_bytes())["faults"] == []
    text = "\n".join(p.read_text() for p in d.rglob("*.log"))
    for bad in (r"Xid", r"NCCL WARN", r"Watchdog caught", r"Traceback", r"Link DOWN", r"oom-killer",
                r"blocked for more than", r"fallen off the bus", r"AER:", r"exitcode"):
        assert not re.search(bad, text), bad
    assert not (d / "stacks").exists()
    counters = ("ecc_sbe", "ecc_dbe", "ecc_sbe_agg", "ecc_dbe_agg", "retired_pages", "remapped_rows_unc",
                "pcie_replay", "nvlink_errors", "nvlink_crc_errors")
    for node in ("n001", "n002"):
        lines = (d / "nodes" / node / "gpu.jsonl").read_text().splitlines()
        first, last = orjson.loads(lines[0]), orjson.loads(lines[-1])
        for g0, g1 in zip(first["gpus"], last["gpus"], strict=True):
            assert all(g0[c] == g1[c] for c in counters)
            assert not g1["lost"] and not g1["remap_pending"] and g1["throttle_reasons"] in (0, 1)
    steps = [orjson.loads(x) for f in (d / "steps").glob("*.jsonl") for x in f.read_text().splitlines()]
    assert all(s["loss"] is not None for s in steps)


def test_records_round_trip_through_the_schema(tmp_path: Path) -> None:
    d = write_batch_dir(Scenario(_spec("thermal_throttle")), tmp_path / "t")
    for line in (d / "nodes" / "n001" / "gpu.jsonl").read_text().splitlines()[:50]:
        rec = schema.decode("gpu", line)
        assert len(rec.gpus) == 8 and schema.decode("gpu", schema.encode(rec)) == rec
    for f in (d / "steps").glob("*.jsonl"):
        for line in f.read_text().splitlines()[:50]:
            rec = schema.decode("steps", line)
            assert rec.tokens == 8192 * 4 and rec.duration_s > 0
            assert schema.decode("steps", schema.encode(rec)) == rec
    rank0 = (d / "stacks" / "0.txt").read_text()
    assert schema.decode("stacks", schema.encode(schema.StackDump(ts=1760000001.0, job="jt", node="n001", rank=0, pid=1,
                                                                 text=rank0))).text == rank0


def test_live_writer_reaches_the_batch_dir_bytes(tmp_path: Path) -> None:
    sc = Scenario(_spec("ecc_uncorrectable"))
    batch = write_batch_dir(sc, tmp_path / "batch")
    live = LiveWriter(Scenario(_spec("ecc_uncorrectable")), tmp_path / "live")
    n1 = live.advance(sc.start_ts + 100)
    kernel_so_far = (tmp_path / "live" / "nodes").rglob("gpu.jsonl")
    assert n1 > 0 and all(len(p.read_text().splitlines()) <= 101 for p in kernel_so_far)
    t = sc.start_ts + 100
    while not live.finished:
        t += 37
        live.advance(t)
    assert _digest(batch) == _digest(tmp_path / "live")
    ts = [e.ts for e in sc.events(until_ts=sc.start_ts + 60)]
    assert ts == sorted(ts) and ts[-1] <= sc.start_ts + 60


def test_simulated_nvml_backend() -> None:
    sc = Scenario(_spec("gpu_lost", node="n002", gpu=3, onset_s=100))
    clock_now = [sc.start_ts + 50]
    nvml = SimulatedNvml(sc, "n002", clock=lambda: clock_now[0])
    assert isinstance(nvml, NvmlBackend)
    nvml.open()
    assert nvml.device_count() == 8
    before = nvml.read()
    assert not before[3].lost and before[3].util > 50
    assert nvml.wait_events(0) == []
    clock_now[0] = sc.start_ts + 130
    states = nvml.read()
    assert states[3].lost and not states[2].lost
    events = nvml.wait_events(0)
    assert {(e.kind, e.xid) for e in events} >= {("xid", 79), ("gpu_lost", None)}
    assert nvml.wait_events(0) == []
    nvml.close()


def test_suite_and_long_run(tmp_path: Path) -> None:
    out = write_suite(tmp_path / "suite", 3, seed=2, max_nodes=4, durations=(300.0,))
    index = orjson.loads((out / "index.json").read_bytes())
    assert [s["kind"] for s in index["scenarios"]] == ["healthy", "gpu_lost", "ecc_uncorrectable"]
    for s in index["scenarios"]:
        assert (out / s["dir"] / "truth.json").exists() and (out / s["dir"] / "job.json").exists()
    spec = long_run_spec(1, ClusterSpec.for_nodes(16), 3600.0, acceleration=2000.0)
    assert len(spec.faults) >= 3 and all(0 < f.onset_s < 3600 for f in spec.faults)


def test_cli_writes_a_scenario(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    rc = main(["simulate", "scenario", "--fault", "host_oom", "--nodes", "2", "--duration", "300", "--seed", "1",
               "--out", str(tmp_path / "cli")])
    assert rc == 0 and "host_oom" in capsys.readouterr().out
    truth = orjson.loads((tmp_path / "cli" / "truth.json").read_bytes())
    assert truth["faults"][0]["expected_action"] == "restart_job"
