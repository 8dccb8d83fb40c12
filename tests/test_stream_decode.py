"""The one decoder (faultlens/decode.py): its coercion table, and stream and batch paths agreeing on one corpus."""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace

import orjson
import pyarrow as pa
import pytest

from faultlens import decode, schema
from faultlens.collectors.batch import read_batch_dir
from faultlens.datasets.cluster import ClusterSpec
from faultlens.datasets.scenario import FaultSpec, Scenario, ScenarioSpec
from faultlens.datasets.scenario_files import write_batch_dir
from faultlens.errors import SchemaError
from faultlens.records import LastKnown
from faultlens.stream import decode_arrow
from tests.conftest import FIXTURES

CORPUS = FIXTURES / "decode" / "gpu.jsonl"
DONE_WHEN = b'{"v":1,"ts":1763700001.0,"node":"n001","job":"j1","gpus":[{"index":0,"remap_pending":1,"temp_c":"N/A"}]}'
JOB = {"job": "j1", "tp": 1, "pp": 1, "dp": 1, "ranks": {}}


def _recs(values: list[bytes]) -> list[SimpleNamespace]:
    return [SimpleNamespace(offset=i, key=None, value=v, headers=[]) for i, v in enumerate(values)]


def _gpu(temp_c=None, **kw) -> dict:
    return {"v": 1, "ts": 1760000005.0, "node": "n", "gpus": [{"index": 0, **({"temp_c": temp_c} if temp_c is not None else {}), **kw}]}


# --------------------------------------------------------------------------- the coercion table


@pytest.mark.parametrize("value, expected", [
    (1, True), (0, False), (2, True), (1.0, True), (0.0, False), ("Yes", True), ("No", False), ("yes", True),
    ("true", True), ("False", False), ("Enabled", True), ("Disabled", False), ("Active", True),
    ("Not Active", False), ("1", True), ("0", False), (" on ", True), (True, True),
])  # fmt: skip
def test_booleans_read_as_real_producers_write_them(value, expected) -> None:
    issues: list = []
    rec = decode.from_obj("gpu", _gpu(remap_pending=value), issues)
    assert rec.gpus[0].remap_pending is expected and issues == []


@pytest.mark.parametrize("field, value, expected", [
    ("temp_c", "72", 72.0), ("temp_c", "72 C", 72.0), ("power_w", "412.35 W", 412.35), ("util", "97 %", 97.0),
    ("mem_used_mb", "81559 MiB", 81559.0), ("sm_clock_mhz", "1980 MHz", 1980.0), ("temp_c", 61, 61.0),
    ("ecc_sbe", 3.0, 3), ("ecc_sbe", "7", 7), ("throttle_reasons", "0x0000000000000004", 4),
    ("index", "3", 3), ("uuid", "GPU-1", "GPU-1"),
])  # fmt: skip
def test_numbers_read_from_strings_units_and_integral_floats(field, value, expected) -> None:
    issues: list = []
    g = decode.from_obj("gpu", {"v": 1, "ts": 1760000005.0, "node": "n", "gpus": [{"index": 0, field: value}]}, issues).gpus[0]
    got = getattr(g, field)
    assert got == expected and type(got) is type(expected) and issues == []


@pytest.mark.parametrize("field, value, reason", [
    ("temp_c", "N/A", "not_available"), ("temp_c", "[N/A]", "not_available"),
    ("mem_clock_mhz", "[Not Supported]", "not_supported"), ("temp_c", "Unknown Error", "unknown_error"),
    ("temp_c", "[Unknown Error]", "unknown_error"), ("power_w", "[GPU is lost]", "gpu_lost"),
    ("temp_c", float("nan"), "nan"), ("temp_c", "NaN", "nan"), ("power_w", float("inf"), "infinity"),
    ("power_w", "400 kW", "bad_unit"), ("ecc_sbe", 1.5, "not_integral"), ("ecc_sbe", 2**70, "out_of_range"),
    ("remap_pending", "maybe", "bad_type"), ("remap_pending", "N/A", "not_available"), ("mem_util", [1], "bad_type"),
    ("ecc_dbe", True, "bad_type"),
])  # fmt: skip
def test_an_unreadable_field_is_null_and_reported_the_rest_kept(field, value, reason) -> None:
    issues: list = []
    g = decode.from_obj("gpu", {"v": 1, "ts": 1760000005.0, "node": "n", "gpus": [{"index": 0, field: value, "util": 50}]},
                        issues).gpus[0]
    assert getattr(g, field) is None
    assert [(i.field, i.reason) for i in issues] == [(f"gpus.{field}", reason)]
    if field != "util":
        assert g.util == 50.0


def test_json_nan_and_infinity_tokens_are_read_as_null_not_refused() -> None:
    issues: list = []
    rec = decode.decode("gpu", b'{"v":1,"ts":1760000005,"node":"n","gpus":[{"index":0,"temp_c":NaN,"power_w":-Infinity}]}',
                        issues=issues)
    assert rec.gpus[0].temp_c is None and rec.gpus[0].power_w is None
    assert sorted(i.reason for i in issues) == ["infinity", "nan"]


def test_unknown_keys_are_ignored_and_reported() -> None:
    issues: list = []
    rec = decode.decode("gpu", b'{"v":1,"ts":1760000005,"node":"n","host":"x","gpus":[{"index":0,"fan":"[N/A]","temp_c":50}]}',
                        issues=issues)
    assert rec.gpus[0].temp_c == 50.0
    assert sorted((i.field, i.reason) for i in issues) == [("gpus.fan", "unknown_field"), ("host", "unknown_field")]


@pytest.mark.parametrize("payload, reason", [
    (b"\x00\x01 not json at all", "malformed_json"), (b"GPU 0: NVIDIA H100 80GB HBM3", "malformed_json"),
    (b"", "empty_message"), (b"[1, 2]", "not_an_object"), (b'{"v":1,"node":"n","gpus":[]}', "missing_field"),
    (b'{"v":1,"ts":"N/A","node":"n"}', "bad_type"), (b'{"v":1,"ts":1760000001,"node":null}', "null_field"),
    (b'{"v":2,"ts":1760000001,"node":"n"}', "unknown_version"), (b'{"v":"x","ts":1760000001,"node":"n"}', "unknown_version"),
    (b"\x81\xa1v\xc1", "malformed_msgpack"),
])  # fmt: skip
def test_only_an_unusable_identity_refuses_the_record(payload, reason) -> None:
    with pytest.raises(SchemaError) as exc:
        decode.decode("gpu", payload)
    assert exc.value.reason == reason


def test_steps_and_other_kinds_go_through_the_same_table() -> None:
    issues: list = []
    line = b'{"ts":"1760000005","job":"j","rank":"3","node":"n","step":7,"duration_s":"1.5 s","tokens":"N/A","loss":NaN}'
    s = decode.decode("steps", line, issues=issues)
    assert (s.ts, s.rank, s.duration_s, s.tokens) == (1760000005.0, 3, 1.5, 0) and math.isnan(s.loss)
    # A NaN loss is the measurement NaN-loss diagnosis looks for (coercion.toml [nonfinite_values]): kept, not counted.
    assert sorted((i.field, i.reason) for i in issues) == [("tokens", "not_available")]
    issues.clear()
    s = decode.decode("steps", b'{"ts":1760000005,"job":"j","rank":3,"node":"n","step":7,"duration_s":1,"loss":1.5,'
                               b'"grad_norm":"Infinity","fwd_s":"NaN"}', issues=issues)
    assert s.grad_norm == math.inf and s.fwd_s is None and [(i.field, i.reason) for i in issues] == [("fwd_s", "nan")]
    wire = decode.encode_wire(s)
    assert decode.decode("steps", wire, content_type=decode.content_type_of(wire)).grad_norm == math.inf
    with pytest.raises(SchemaError, match="duration_s"):
        decode.decode("steps", b'{"ts":1760000005,"job":"j","rank":3,"node":"n","step":7,"duration_s":"N/A"}')


def test_the_agents_messagepack_decodes_to_the_same_records() -> None:
    sick = schema.GpuSample(ts=1760000005.0, node="n", job="j", gpus=[
        schema.GpuState(index=0, uuid="GPU-a", util=97.0, ecc_dbe=2, remap_pending=True, temp_c=None),
        schema.GpuState(index=1, uuid="GPU-b", pci_bus="0000:19:00.0", lost=True)])
    step = schema.StepTiming(ts=1760000005.0, job="j", rank=3, node="n", step=7, duration_s=1.5, loss=2.0)
    for rec in (sick, step, schema.GpuSample(ts=1760000001.0, node="n")):
        wire = decode.encode_wire(rec)
        assert decode.is_msgpack(wire) and decode.content_type_of(wire) == decode.MSGPACK_TYPE
        assert decode.decode(type(rec).KIND, wire) == rec
        assert decode.decode(type(rec).KIND, wire, content_type=decode.MSGPACK_TYPE) == rec
    assert not decode.is_msgpack(schema.encode(sick))
    # A NaN the agent put on the wire is nulled and reported, as in JSON.
    issues: list = []
    nan = decode.decode("gpu", decode.encode_wire(schema.GpuSample(ts=1760000001.0, node="n", gpus=[
        schema.GpuState(index=0, temp_c=math.nan, util=5.0)])), issues=issues)
    assert nan.gpus[0].temp_c is None and nan.gpus[0].util == 5.0 and [i.reason for i in issues] == ["nan"]


def test_last_known_reads_a_null_field_as_unchanged() -> None:
    fill = LastKnown()
    first = decode.from_obj("gpu", _gpu(temp_c=60, ecc_dbe=3))
    second = decode.from_obj("gpu", _gpu(temp_c="N/A", ecc_dbe="N/A"))
    assert fill.fill(first) is first
    got = fill.fill(second).gpus[0]
    assert (got.temp_c, got.ecc_dbe) == (60.0, 3)
    assert second.gpus[0].temp_c is None  # the record itself keeps the null
    fresh = LastKnown().fill(decode.from_obj("gpu", _gpu(temp_c="N/A"))).gpus[0]
    assert fresh.temp_c == 0.0  # never known: the default


# --------------------------------------------------------------------------- stream path == batch path


def _stream(lines: list[bytes]) -> tuple[list[dict], list[tuple[int, str]], list[tuple[int, str, str]]]:
    out = decode_arrow.decode_batch("gpu", "t.gpu", 0, _recs(lines))
    rows = out.tables["gpu"].to_pylist() if "gpu" in out.tables else []
    dead = [(d.offset + 1, d.reason) for d in out.dead]
    quarantine = [(q.offset + 1, q.field, q.reason) for q in out.quarantine]
    return _sorted(rows), dead, sorted(quarantine)


def _batch(root: Path, lines: list[bytes]) -> tuple[list[dict], list[tuple[int, str]], list[tuple[int, str, str]]]:
    (root / "nodes" / "n001").mkdir(parents=True)
    (root / "job.json").write_bytes(orjson.dumps(JOB))
    (root / "nodes" / "n001" / "gpu.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    b = read_batch_dir(root)
    rows = pa.Table.from_pylist([r for s in b.gpu for r in schema.lake_row(s)], schema=schema.lake_schema("gpu"))
    dead = [(int(m[1]), m[2]) for m in (re.match(r".*gpu\.jsonl:(\d+): (?:gpu: )?(\w+)", e) for e in b.errors) if m]
    assert len(dead) == len(b.errors), b.errors
    quarantine = [(int(m[1]), m[2], m[3]) for m in (re.match(r".*gpu\.jsonl:(\d+): ([\w.]+): (\w+): ", q)
                                                    for q in b.quarantine)]
    return _sorted(rows.to_pylist()), sorted(dead), sorted(quarantine)


def _sorted(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: (r["ts"], r["node"], r["gpu"]))


def test_stream_and_batch_paths_give_identical_rows_on_the_corpus(tmp_path) -> None:
    lines = CORPUS.read_bytes().splitlines()
    stream = _stream(lines)
    batch = _batch(tmp_path, lines)
    assert stream == batch
    rows, dead, quarantine = stream
    # What the corpus holds, so the agreement is not vacuous.
    assert len(rows) == 13 and len(dead) == 7
    assert {reason for _, reason in dead} == {"bad_type", "missing_field", "null_field", "unknown_version",
                                              "not_an_object", "malformed_json"}
    assert len(quarantine) >= 20
    by_node = {r["node"]: r for r in rows if r["gpu"] == 0}
    assert by_node["n002"]["remap_pending"] is True and by_node["n002"]["ecc_sbe"] is None  # nvidia-smi -q
    assert by_node["n004"]["power_w"] == 412.35 and by_node["n004"]["throttle_reasons"] == 4  # csv with units
    assert by_node["n005"]["ecc_dbe"] == 3 and by_node["n005"]["nvlink_errors"] is None  # dcgm floats
    assert by_node["n008"]["ts"] == 1763700008.0  # an ISO time
    assert [r["gpu"] for r in rows if r["node"] == "n009"] == [1]  # entries without an index dropped alone


def test_the_done_when_line_in_both_paths(tmp_path) -> None:
    """remap_pending 1 and temp_c "N/A": the flag true, the temperature null, counted once."""
    want = ([1], [(1, "gpus.temp_c", "not_available")])
    for rows, dead, quarantine in (_stream([DONE_WHEN]), _batch(tmp_path, [DONE_WHEN])):
        assert not dead
        assert [(r["remap_pending"], r["temp_c"]) for r in rows] == [(True, None)]
        assert quarantine == want[1]


def test_the_simulators_own_output_agrees_in_both_paths_and_all_three_wires(tmp_path) -> None:
    spec = ScenarioSpec(name="ecc", seed=3, cluster=ClusterSpec.for_nodes(2, 8), duration_s=300.0,
                        faults=(FaultSpec(kind="ecc_uncorrectable", id="f1"),))
    d = write_batch_dir(Scenario(spec), tmp_path / "run")
    b = read_batch_dir(d)
    assert not b.errors and not b.quarantine and b.gpu
    for node_dir in sorted((d / "nodes").iterdir()):
        lines = (node_dir / "gpu.jsonl").read_bytes().splitlines()
        expected = _sorted([r for s in b.gpu if s.node == node_dir.name for r in schema.lake_row(s)])
        rows, dead, quarantine = _stream(lines)
        assert (rows, dead, quarantine) == (expected, [], [])
        fast = decode_arrow._fast_gpu(_recs(lines))  # the whole-batch JSON path
        assert _sorted(fast.to_pylist()) == expected
        packed = [decode.encode_wire(decode.decode("gpu", line)) for line in lines]  # the agent's MessagePack
        assert _sorted(decode_arrow._fast_gpu(_recs(packed)).to_pylist()) == expected
    steps = [line for f in sorted((d / "steps").glob("*.jsonl")) for line in f.read_bytes().splitlines()]
    key = lambda s: (s.ts, s.rank, s.step)  # noqa: E731
    assert steps and sorted((decode.decode("steps", line) for line in steps), key=key) == sorted(b.steps, key=key)


def test_well_typed_messages_take_the_typed_path_and_others_the_table(monkeypatch) -> None:
    calls: list = []
    real = decode._tolerant
    monkeypatch.setattr(decode, "_tolerant", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    sample = schema.GpuSample(ts=1760000001.0, node="n", gpus=[schema.GpuState(index=i, util=50.0) for i in range(8)])
    for wire in (schema.encode(sample), decode.encode_wire(sample)):
        assert decode.decode("gpu", wire) == sample
    assert calls == []
    decode.decode("gpu", DONE_WHEN)
    assert calls and set(calls) == {"gpu"}  # the sample and its GPU entry, field by field
