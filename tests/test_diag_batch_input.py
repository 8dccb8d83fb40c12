"""The batch path's input side: the schema's fast decoding, the reader's clock anchoring, estimated times in evidence."""

import copy
import json
import os
import random

import msgspec
import pytest

from faultlens import decode, schema
from faultlens.collectors.batch import read_batch_dir
from faultlens.config import Config
from faultlens.datasets.cluster import ClusterSpec
from faultlens.datasets.scenario import FaultSpec, Scenario, ScenarioSpec
from faultlens.datasets.scenario_files import write_batch_dir
from faultlens.diagnosis.batch import diagnose_records
from faultlens.diagnosis.rules import CounterRules
from faultlens.errors import SchemaError
from faultlens.schema import GpuSample, GpuState

T0 = 1_763_700_000.0  # 2025-11-21 04:40 UTC: a year that is not this one, so a year-less time can go wrong


# --------------------------------------------------------------------------- schema fast path


def _deep(x):
    """A record as nested tuples that include every value's type (0 and 0.0 differ)."""
    if isinstance(x, msgspec.Struct):
        return (type(x).__name__, tuple((name, _deep(getattr(x, name))) for name in x.__struct_fields__))
    if isinstance(x, list):
        return ("list", tuple(_deep(i) for i in x))
    if isinstance(x, dict):
        return ("dict", tuple((k, _deep(v)) for k, v in x.items()))
    return (type(x).__name__, repr(x))


def _outcome(fn, kind, obj):
    try:
        return ("ok", _deep(fn(kind, copy.deepcopy(obj))))
    except SchemaError as exc:
        return ("error", str(exc))


def _generic(kind, obj):
    """The decoder's per-field path alone, without its typed fast path."""
    cls = schema.RECORDS[kind]
    if not isinstance(obj, dict):
        raise SchemaError("not_an_object", kind=kind)
    decode._version(obj, kind)
    return decode._check(decode._tolerant(cls, kind, obj, None), kind)


GPU = {"index": 0, "uuid": "GPU-1", "pci_bus": "00000000:18:00.0", "util": 0, "mem_util": 3, "mem_used_mb": 531,
       "temp_c": 39, "power_w": 68.6, "sm_clock_mhz": 345, "mem_clock_mhz": 2619, "throttle_reasons": 1, "ecc_sbe": 0,
       "ecc_dbe": 0, "ecc_sbe_agg": 1, "ecc_dbe_agg": 0, "retired_pages": 0, "remap_pending": False,
       "remap_failure": False, "remapped_rows_corr": 0, "remapped_rows_unc": 0, "pcie_replay": 0, "nvlink_errors": 0,
       "nvlink_crc_errors": 0, "nvlink_replay_errors": 0, "nvlink_recovery_errors": 0, "recovery_action": 0, "lost": False}
BASES = {
    "gpu": {"v": 1, "ts": T0, "node": "n001", "job": "j1", "gpus": [GPU, {**GPU, "index": 1}]},
    "steps": {"v": 1, "ts": T0, "job": "j1", "rank": 3, "node": "n001", "step": 7, "duration_s": 1.5, "n_seqs": 4,
              "sum_len": 10, "sum_len_sq": 30, "tokens": 10, "loss": 2.25, "grad_norm": None},
    "kernel": {"v": 1, "ts": T0, "node": "n001", "kind": "xid", "raw": "r", "xid": 79, "fields": {"a": 1}},
    "jobs": {"v": 1, "ts": 0.0, "job": "j", "tp": 1, "pp": 1, "dp": 1, "ranks": {"0": {"node": "n", "gpu": 0}}},
}
ODD_VALUES = [0, 1, 2.5, 3.0, -1, True, False, None, "x", [], {}, {"a": 1}]


@pytest.mark.parametrize("kind", sorted(BASES))
def test_fast_decoding_equals_the_checked_path(kind):
    """Same records (value types included) and the same errors, over seeded mutations of valid objects."""
    rng = random.Random(kind)
    fast_hits = 0
    for _trial in range(1500):
        obj = copy.deepcopy(BASES[kind])
        for _ in range(rng.choice([0, 1, 1, 2])):
            target = obj
            if kind == "gpu" and rng.random() < 0.6:
                target = rng.choice(obj["gpus"]) if isinstance(obj.get("gpus"), list) and obj["gpus"] else obj
            if not isinstance(target, dict) or not target:
                continue
            key, op = rng.choice(list(target)), rng.random()
            if op < 0.5:
                target[key] = rng.choice(ODD_VALUES)
            elif op < 0.65:
                del target[key]
            elif op < 0.75:
                target["unknown_key"] = 1
            elif op < 0.9:
                items = list(target.items())
                rng.shuffle(items)
                target.clear()
                target.update(items)
            elif kind == "gpu":
                obj["gpus"] = rng.choice([[], [1], [{"index": 0}], [{}]])
        fast = _outcome(schema.from_dict, kind, obj)
        assert fast == _outcome(_generic, kind, obj), obj
        fast_hits += fast[0] == "ok"
    assert fast_hits > 300


def test_fast_decoding_converts_ints_where_floats_are_declared():
    s = schema.decode("gpu", json.dumps(BASES["gpu"]))
    assert type(s.gpus[0].util) is float and type(s.gpus[0].power_w) is float and type(s.gpus[0].index) is int
    assert s == _generic("gpu", json.loads(json.dumps(BASES["gpu"])))


# --------------------------------------------------------------------------- counter rules: steady samples


def test_counter_rules_skip_steady_samples_without_changing_results():
    rng = random.Random(5)
    samples, state = [], {}
    for t in range(600):
        gpus = []
        for i in range(4):
            c = state.setdefault(i, {"ecc_dbe": 0, "retired_pages": 0, "pcie_replay": 0, "nvlink_errors": 0,
                                     "throttle_reasons": 0, "sm_clock_mhz": 1980.0, "lost": False})
            for k in ("ecc_dbe", "retired_pages", "pcie_replay", "nvlink_errors"):
                if rng.random() < 0.02:
                    c[k] += rng.choice([1, 40])
            if rng.random() < 0.03:
                c["throttle_reasons"], c["sm_clock_mhz"] = rng.choice([(0, 1980.0), (0x40, 1200.0), (0x40, 1980.0)])
                c["lost"] = rng.random() < 0.2
            gpus.append(GpuState(index=i, **c))
        samples.append(GpuSample(ts=T0 + t, node="n001", gpus=gpus))
    fast, full = CounterRules(), CounterRules()
    full._steady_ok = False  # every sample through every rule
    got = [f for s in samples for f in fast.observe(s)]
    assert got == [f for s in samples for f in full.observe(s)]
    assert {f.kind for f in got} >= {"ecc_uncorrectable", "gpu_lost", "pcie_degradation", "thermal_throttle"}


# --------------------------------------------------------------------------- reader clocks


def _write(d, files):
    for rel, text in files.items():
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def _gpu_lines(n, lost_at=None):
    out = []
    for t in range(n):
        gpus = [{**GPU, "index": i, "pci_bus": f"00000000:{0x18 + i:02X}:00.0", "lost": lost_at is not None and t >= lost_at
                 and i == 1} for i in range(2)]
        out.append(json.dumps({"v": 1, "ts": T0 + t, "node": "n001", "job": "j1", "gpus": gpus}))
    return "\n".join(out) + "\n"


JOB = json.dumps({"job": "j1", "tp": 2, "pp": 1, "dp": 1, "ranks": {"0": {"node": "n001", "gpu": 0},
                                                                      "1": {"node": "n001", "gpu": 1}}})


def test_dmesg_times_anchored_on_the_gpu_turning_lost(tmp_path):
    _write(tmp_path, {
        "job.json": JOB,
        "nodes/n001/gpu.jsonl": _gpu_lines(120, lost_at=90),
        "nodes/n001/kernel.log": "[500000.100000] docker0: port 7(veth1) entered forwarding state\n"
                                 "[500080.250000] NVRM: Xid (PCI:0000:19:00): 79, pid=1234, name=python3, GPU has fallen off the bus.\n",
    })
    b = read_batch_dir(tmp_path)
    xid = next(k for k in b.kernel if k.xid == 79)
    assert xid.ts == pytest.approx(T0 + 90) and xid.gpu == 1
    assert xid.fields["ts_estimated"] is True and xid.fields["ts_anchor"] == "hardware"
    assert b.kernel[0].ts == pytest.approx(T0 + 90 - 80.15)  # the same offset for every record of the node
    assert b.clocks["n001"].boot_from == "hardware" and b.clocks["n001"].year == 2025


def test_dmesg_without_anchor_starts_at_the_nodes_first_sample_or_ends_at_its_last(tmp_path):
    _write(tmp_path, {
        "job.json": JOB,
        "nodes/n001/gpu.jsonl": _gpu_lines(60),
        "nodes/n001/kernel.log": "[ 1000.000000] EXT4-fs (nvme0n1p2): mounted filesystem\n"
                                 "[ 1030.000000] mlx5_core 0000:0c:00.0: Port module event: module 0, Cable unplugged\n",
    })
    b = read_batch_dir(tmp_path)
    assert [k.ts for k in b.kernel] == pytest.approx([T0, T0 + 30])
    assert all(k.fields["ts_anchor"] == "first_record" for k in b.kernel)
    # A whole dmesg buffer (boot days before the job): its end is put at the node's last sample instead.
    (tmp_path / "nodes/n001/kernel.log").write_text("[    0.000000] Linux version 5.15.0\n"
                                                     "[300000.000000] mlx5_core 0000:0c:00.0: link down\n")
    b = read_batch_dir(tmp_path)
    assert b.kernel[-1].ts == pytest.approx(T0 + 59) and b.clocks["n001"].boot_from == "last_record"


def test_year_less_times_take_the_nodes_year_and_untimed_nccl_lines_a_neighbours_time(tmp_path):
    _write(tmp_path, {
        "job.json": JOB,
        "nodes/n001/gpu.jsonl": _gpu_lines(10),
        "nodes/n001/kernel.log": "Nov 21 04:40:05 n001 kernel: NVRM: Xid (PCI:0000:18:00): 48, pid=1, name=python3, "
                                 "An uncorrectable double bit error (DBE) has been detected on GPU.\n",
        "nodes/n001/nccl/launcher.log": "W1121 04:40:01.000000 98927 torch/distributed/run.py:793] Setting OMP_NUM_THREADS\n"
                                        "E1121 04:41:02.500000 98927 torch/distributed/elastic/multiprocessing/api.py:869] "
                                        "failed (exitcode: -6) local_rank: 1 (pid: 2263638) of binary: /usr/bin/python3\n",
        "nodes/n001/nccl/rank0.log": "n001:2263519:2263519 [0] NCCL INFO Bootstrap : Using ib0:10.0.0.1<0>\n"
                                     "[rank0]:[E1121 04:50:00.000000000 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught "
                                     "collective operation timeout: WorkNCCL(SeqNum=8, OpType=ALLREDUCE, NumelIn=1, "
                                     "NumelOut=1, Timeout(ms)=600000) ran for 600021 milliseconds before timing out.\n",
        "nodes/n001/nccl/rank1.log": "n001:2263536:2263536 [1] NCCL INFO Bootstrap : Using ib0:10.0.0.1<0>\n",
    })
    b = read_batch_dir(tmp_path)
    assert b.kernel[0].ts == T0 + 5 and "ts_estimated" not in b.kernel[0].fields
    launcher = sorted(r.ts for r in b.nccl if "torch/distributed" in r.raw)
    assert launcher == pytest.approx([T0 + 1, T0 + 62.5])
    watchdog = next(r for r in b.nccl if r.kind == "watchdog_timeout")
    assert watchdog.ts == T0 + 600
    rank0_info = next(r for r in b.nccl if "Bootstrap" in r.raw and "[0]" in r.raw)
    rank1_info = next(r for r in b.nccl if "Bootstrap" in r.raw and "[1]" in r.raw)
    assert rank0_info.ts == T0 + 600 and rank0_info.fields["ts_anchor"] == "next_line"
    assert rank1_info.ts == T0 and rank1_info.fields["ts_anchor"] == "node_first"
    assert all(r.ts > T0 - 1 for r in b.records())


def test_kernel_lines_before_the_first_time_take_it(tmp_path):
    _write(tmp_path, {"job.json": JOB, "nodes/n001/gpu.jsonl": _gpu_lines(5),
                      "nodes/n001/kernel.log": "n001 kernel: mlx5_core 0000:0c:00.0: Port module event\n"
                                               "2025-11-21T04:40:10,000000+00:00 EXT4-fs (nvme0n1p2): mounted\n"})
    b = read_batch_dir(tmp_path)
    assert [k.ts for k in b.kernel] == [T0 + 10, T0 + 10] and b.kernel[0].fields["ts_anchor"] == "next_line"


def test_explicit_year_wins_and_without_records_the_logs_mtime_gives_it(tmp_path):
    _write(tmp_path, {"job.json": JOB, "nodes/n001/kernel.log": "Nov 21 04:40:05 n001 kernel: hello\n"})
    assert read_batch_dir(tmp_path, year=2023).kernel[0].ts == pytest.approx(1700541605.0)
    os.utime(tmp_path / "nodes/n001/kernel.log", (T0, T0))
    b = read_batch_dir(tmp_path)
    assert b.clocks["n001"].year_from == "mtime" and b.kernel[0].ts == pytest.approx(T0 + 5)


# --------------------------------------------------------------------------- end to end


def test_dmesg_scenario_lands_on_the_jobs_clock_and_evidence_says_estimated(tmp_path):
    spec = ScenarioSpec(name="lost-dmesg", seed=2, cluster=ClusterSpec.for_nodes(2, 8), duration_s=600.0,
                        faults=(FaultSpec(kind="gpu_lost", id="f1"),), kernel_format="dmesg")
    d = write_batch_dir(Scenario(spec), tmp_path / "run")
    truth = json.loads((d / "truth.json").read_text())
    fault = truth["faults"][0]
    b = read_batch_dir(d)
    xid = next(k for k in b.kernel if k.xid == 79)
    assert abs(xid.ts - fault["onset_ts"]) < 2.0 and xid.fields["ts_anchor"] == "hardware"
    start, end = truth["start_ts"], truth["start_ts"] + truth["duration_s"]
    assert all(start - 60 <= r.ts <= end for r in (*b.kernel, *b.nccl))  # no ts=0, no raw seconds since boot
    incidents, actions = diagnose_records(b.job, list(b.records()), Config())
    assert [a.nodes for a in actions if a.type == "evict_nodes"] == [fault["nodes"]]
    kernel_evidence = [e for i in incidents for e in i.evidence if e["source"] == "kernel"]
    assert kernel_evidence and all(e["figures"]["ts_estimated"] for e in kernel_evidence)
