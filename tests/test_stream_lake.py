"""The lake writer, the DuckDB views, the Arrow GPU decoder and compaction (no broker)."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import orjson
import pyarrow as pa
import pyarrow.parquet  # noqa: F401 - pa.parquet below

from faultlens.errors import SchemaError
from faultlens.stream import schema
from faultlens.stream.catalog import open_lake
from faultlens.stream.compaction import compact_lake, recover
from faultlens.stream.lake import LakeWriter
from faultlens.stream.processor import decode_batch, decode_gpu_batch

T0 = 1_760_000_000.0  # 2025-10-09 08:53:20 UTC


def _gpu(ts: float, node: str, temps: list[float], dbe: int = 0) -> schema.GpuSample:
    return schema.GpuSample(ts=ts, node=node, job="j1",
                            gpus=[schema.GpuState(index=i, temp_c=t, ecc_dbe=dbe, power_w=500.0) for i, t in enumerate(temps)])  # fmt: skip


def test_writer_partitions_by_utc_hour_and_views_read_it(tmp_path) -> None:
    lake = LakeWriter(tmp_path)
    paths = lake.write("gpu", [_gpu(T0, "n1", [60, 61]), _gpu(T0 + 3600, "n1", [62, 63])])
    assert sorted(p.relative_to(tmp_path).parent.as_posix() for p in paths) == [
        "gpu/date=2025-10-09/hour=08", "gpu/date=2025-10-09/hour=09"]  # fmt: skip
    assert not list(tmp_path.rglob("*.tmp"))
    db = open_lake(tmp_path)
    assert db.execute("SELECT count(*), max(temp_c), max(hour) FROM gpu").fetchone() == (4, 63.0, 9)
    # A table with no files yet is an empty view with its columns.
    assert db.execute("SELECT count(*) FROM kernel WHERE xid = 79").fetchone() == (0,)


def test_incidents_latest_and_actions_status_views(tmp_path) -> None:
    lake = LakeWriter(tmp_path)
    inc = dict(id="i1", job="j1", opened_ts=T0, category="gpu_hardware", kind="gpu_lost", title="Xid 79")
    lake.write("incidents", [schema.Incident(**inc, updated_ts=T0, status="open"),
                             schema.Incident(**inc, updated_ts=T0 + 60, status="mitigated")])  # fmt: skip
    lake.write("actions", [schema.Action(id="a1", incident_id="i1", job="j1", ts=T0, type="evict_nodes", nodes=["n1"]),
                           schema.Action(id="a2", incident_id="i1", job="j1", ts=T0, type="notify")])  # fmt: skip
    lake.write("action-status", [schema.ActionStatus(ts=T0 + 1, action_id="a1", job="j1", adapter="dry-run", status="dry_run"),
                                 schema.ActionStatus(ts=T0 + 2, action_id="a1", job="j1", adapter="slurm", status="done")])  # fmt: skip
    db = open_lake(tmp_path)
    assert db.execute("SELECT count(*) FROM incidents").fetchone() == (2,)
    assert db.execute("SELECT status, updated_ts FROM incidents_latest").fetchall() == [("mitigated", T0 + 60)]
    got = db.execute("SELECT id, status, adapter FROM actions_status ORDER BY id").fetchall()
    assert got == [("a1", "done", "slurm"), ("a2", None, None)]


def test_gpu_rollup_partials_merge_exactly_across_commits(tmp_path) -> None:
    from faultlens.stream.catalog import gpu_rollup_partial

    lake = LakeWriter(tmp_path)
    # One minute of node n1 split over two "commits", a DBE counter rising inside it.
    first = [_gpu(T0 + 40 + s, "n1", [60 + s], dbe=1) for s in range(5)]
    second = [_gpu(T0 + 45 + s, "n1", [70 + s], dbe=3) for s in range(5)]
    for batch in (first, second):
        rows = pa.Table.from_pylist([r for rec in batch for r in schema.lake_row(rec)], schema=schema.lake_schema("gpu"))
        lake.write_table("gpu", rows)
        lake.write_table("gpu_1m", gpu_rollup_partial(rows))
    db = open_lake(tmp_path)
    got = db.execute("SELECT samples, temp_c_avg, temp_c_max, ecc_dbe, ecc_dbe_delta FROM gpu_1m").fetchall()
    assert got == [(10, (sum(range(60, 65)) + sum(range(70, 75))) / 10, 74.0, 3, 2)]
    direct = db.execute("SELECT avg(temp_c), max(temp_c) FROM gpu").fetchone()
    assert direct == (got[0][1], got[0][2])


def test_arrow_gpu_decoder_matches_the_schema_module() -> None:
    recs = [_gpu(T0 + i, f"n{i}", [50.0 + i, 51.0]) for i in range(20)]
    table = decode_gpu_batch([schema.encode(r) for r in recs])
    expected = pa.Table.from_pylist([row for r in recs for row in schema.lake_row(r)], schema=schema.lake_schema("gpu"))
    assert table.equals(expected)
    # Missing optional GPU fields take the dataclass defaults, as lake_row does.
    minimal = b'{"v":1,"ts":5.0,"node":"n9","gpus":[{"index":3}]}'
    assert decode_gpu_batch([minimal]).to_pylist() == schema.lake_row(schema.decode("gpu", minimal))


def test_one_bad_message_does_not_lose_its_batch() -> None:
    good = [schema.encode(_gpu(T0 + i, "n1", [60.0])) for i in range(5)]
    values = [*good[:2], b"{oops", b'{"v":9,"ts":1,"node":"n","gpus":[]}', b'{"v":1,"ts":"x","node":"n"}',
              b'{"v":1}' + b" " * schema.MAX_MESSAGE_BYTES, *good[2:]]  # fmt: skip
    records = [SimpleNamespace(offset=i, key=b"n1", value=v) for i, v in enumerate(values)]
    out = decode_batch("gpu", "t.gpu", 0, records)
    assert out.tables["gpu"].num_rows == 5
    assert sorted((d.offset, d.reason) for d in out.dead) == [
        (2, "malformed_json"), (3, "unknown_version"), (4, "bad_type"), (5, "oversized")]  # fmt: skip
    oversized = next(d for d in out.dead if d.reason == "oversized")
    assert oversized.size > schema.MAX_MESSAGE_BYTES > len(oversized.payload)


def test_compaction_keeps_every_row_and_recovers_after_a_crash(tmp_path) -> None:
    lake = LakeWriter(tmp_path)
    for i in range(6):
        lake.write("kernel", [schema.KernelEvent(ts=T0 + i, node="n1", kind="xid", raw=f"line {i}", xid=79)])
    report = compact_lake(tmp_path, min_age_s=0, min_files=4)
    assert (report.files_in, report.files_out) == (6, 1)
    files = list((tmp_path / "kernel").rglob("*.parquet"))
    assert len(files) == 1 and files[0].name.startswith("c-")
    assert open_lake(tmp_path).execute("SELECT count(DISTINCT raw), count(*) FROM kernel").fetchone() == (6, 6)

    # A crash after the redo record, before the rename: recovery completes it.

    for i in range(6, 10):
        lake.write("kernel", [schema.KernelEvent(ts=T0 + i, node="n1", kind="xid", raw=f"line {i}", xid=79)])
    hour = files[0].parent
    olds = sorted(hour.glob("w-*.parquet"))
    tmp = hour / ".c-crash.parquet.tmp"
    merged = pa.concat_tables([pa.parquet.read_table(f) for f in olds])
    pa.parquet.write_table(merged, tmp)
    rec_dir = tmp_path / "_manifest" / "compactions"
    rec_dir.mkdir(parents=True, exist_ok=True)
    (rec_dir / "crash.json").write_text(json.dumps({
        "new": (hour / "c-crash.parquet").relative_to(tmp_path).as_posix(),
        "tmp": tmp.relative_to(tmp_path).as_posix(),
        "old": [f.relative_to(tmp_path).as_posix() for f in olds]}))  # fmt: skip
    assert recover(tmp_path) == 1
    assert not list(hour.glob("w-*")) and not tmp.exists()
    assert open_lake(tmp_path).execute("SELECT count(DISTINCT raw), count(*) FROM kernel").fetchone() == (10, 10)


def test_the_batch_decoder_accepts_only_what_the_schema_accepts() -> None:
    good = schema.encode(_gpu(T0, "n1", [60.0]))
    # Arrow's JSON reader would take each of these; schema.decode refuses them.
    lenient = {
        b'{"v":1,"ts":1,"node":"n","gpus":[{"index":0,"util":null}]}': "null_field",
        b'{"v":1,"ts":NaN,"node":"n","gpus":[{"index":0}]}': "malformed_json",
        b'{"v":1,"ts":1,"node":"n\xff","gpus":[{"index":0}]}': "malformed_json",
        b'{"v":1,"ts":1,"node":"n","gpus":null}': "null_field",
    }
    for bad, reason in lenient.items():
        assert decode_gpu_batch([good, bad]) is None, bad
        out = decode_batch("gpu", "t.gpu", 0, [SimpleNamespace(offset=i, key=None, value=v) for i, v in enumerate([good, bad])])
        assert out.tables["gpu"].num_rows == 1 and [(d.offset, d.reason) for d in out.dead] == [(1, reason)]
    # Missing GPU fields (no null in the text) still take the defaults in the batch path.
    assert decode_gpu_batch([good, b'{"v":1,"ts":2,"node":"n","gpus":[{"index":1}]}']).num_rows == 2


def test_a_value_the_lake_column_cannot_hold_is_a_dead_letter_not_a_crash() -> None:
    good = schema.encode(_gpu(T0, "n1", [60.0]))
    huge = b'{"v":1,"ts":1,"node":"n","gpus":[{"index":0,"ecc_sbe":99999999999999999999}]}'
    out = decode_batch("gpu", "t.gpu", 0, [SimpleNamespace(offset=i, key=None, value=v) for i, v in enumerate([good, huge, good])])
    assert out.tables["gpu"].num_rows == 2
    assert [(d.offset, d.reason) for d in out.dead] == [(1, "bad_type")]


def test_gpu_counters_at_zero_stay_off_the_wire_and_decode_back() -> None:
    healthy = _gpu(T0, "n1", [60.0, 61.0])
    sick = schema.GpuSample(ts=T0, node="n2", gpus=[schema.GpuState(index=0, util=0.0, ecc_dbe=2, remap_pending=True)])
    wire = orjson.loads(schema.encode(healthy))
    assert not set(wire["gpus"][0]) & schema.GPU_SPARSE_FIELDS
    assert "util" in wire["gpus"][0]  # gauges are always sent, zero or not
    assert {"ecc_dbe", "remap_pending", "util"} <= set(orjson.loads(schema.encode(sick))["gpus"][0])
    for rec in (healthy, sick):
        assert schema.decode("gpu", schema.encode(rec)) == rec
    assert decode_gpu_batch([schema.encode(healthy), schema.encode(sick)]).to_pylist() == [
        row for rec in (healthy, sick) for row in schema.lake_row(rec)
    ]


def test_the_batch_decoder_agrees_with_the_schema_module_on_mutated_messages() -> None:
    """Swap one value for another JSON type; the batch path must refuse or give the same rows."""
    rng = random.Random(11)
    base = orjson.loads(schema.encode(_gpu(T0, "n1", [60.0, 70.0])))
    replacements = [None, 1, 1.0, 1.5, -3, 2**70, True, "x", "12", "2026-11-21", [], [1], {}, {"a": 1}]
    checked = 0
    for _ in range(400):
        msg = orjson.loads(orjson.dumps(base))
        if rng.random() < 0.3:
            key = rng.choice(["v", "ts", "node", "job", "gpus"])
            msg[key] = rng.choice(replacements)
        else:
            gpu = rng.choice(msg["gpus"])
            gpu[rng.choice([*gpu, "ecc_sbe", "lost", "recovery_action"])] = rng.choice(replacements)
        bad = json.dumps(msg, separators=(",", ":")).encode()  # json: integers beyond 64 bits too
        try:
            expected = schema.lake_row(schema.decode("gpu", bad))
        except SchemaError:
            expected = None
        got = decode_gpu_batch([schema.encode(_gpu(T0, "n0", [50.0])), bad])
        if got is not None:
            checked += 1
            assert expected is not None, bad
            assert got.to_pylist()[1:] == pa.Table.from_pylist(expected, schema=schema.lake_schema("gpu")).to_pylist(), bad
    assert checked > 50  # the fast path took a fair share of them
