"""The lake writer, the DuckDB views, the batch decoder to Arrow and compaction (no broker)."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import orjson
import pyarrow as pa
import pyarrow.parquet  # noqa: F401 - pa.parquet below

from faultlens import decode, schema
from faultlens.errors import SchemaError
from faultlens.stream import decode_arrow
from faultlens.stream.catalog import open_lake
from faultlens.stream.compaction import compact_lake, recover
from faultlens.stream.lake import LakeWriter
from faultlens.stream.processor import decode_batch

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
    expected = pa.Table.from_pylist([row for r in recs for row in schema.lake_row(r)], schema=schema.lake_schema("gpu"))
    for encode in (schema.encode, decode.encode_wire):  # JSON, and the agent's MessagePack
        table = decode_arrow._fast_gpu(_recs([encode(r) for r in recs]))
        assert table.equals(expected), encode
    # Missing optional GPU fields take the defaults, as lake_row does.
    minimal = b'{"v":1,"ts":1760000005.0,"node":"n9","gpus":[{"index":3}]}'
    assert decode_arrow._fast_gpu(_recs([minimal])).to_pylist() == schema.lake_row(schema.decode("gpu", minimal))


def test_one_bad_message_does_not_lose_its_batch() -> None:
    good = [schema.encode(_gpu(T0 + i, "n1", [60.0])) for i in range(5)]
    values = [*good[:2], b"{oops", b'{"v":9,"ts":1760000001,"node":"n","gpus":[]}', b'{"v":1,"ts":"x","node":"n"}',
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


def _recs(values: list[bytes]) -> list[SimpleNamespace]:
    return [SimpleNamespace(offset=i, key=None, value=v, headers=[]) for i, v in enumerate(values)]


def test_a_bad_field_nulls_that_field_and_a_bad_identity_is_a_dead_letter() -> None:
    good = schema.encode(_gpu(T0, "n1", [60.0]))
    cases = {  # message -> (gpu rows it gives, dead-letter reason, quarantined fields)
        b'{"v":1,"ts":1760000001,"node":"n","gpus":[{"index":0,"util":null}]}': (1, None, []),
        b'{"v":1,"ts":1760000001,"node":"n","gpus":[{"index":0,"util":"N/A","lost":"Yes"}]}': (1, None, ["gpus.util"]),
        b'{"v":1,"ts":NaN,"node":"n","gpus":[{"index":0}]}': (0, "bad_type", []),
        b'{"v":1,"ts":1760000001,"node":"n\xff","gpus":[{"index":0}]}': (0, "malformed_json", []),
        b'{"v":1,"ts":1760000001,"node":"n","gpus":null}': (0, None, ["gpus"]),
        b'{"v":1,"ts":1760000001,"node":"n","gpus":[{"index":"x"},{"index":1}]}': (1, None, ["gpus.index"]),
        b"\x00\x01 not json at all": (0, "malformed_json", []),
    }
    for bad, (rows, reason, fields) in cases.items():
        if reason or fields:  # the whole-batch path leaves such a batch to the one-by-one path
            assert decode_arrow._fast_gpu(_recs([good, bad])) is None, bad
        out = decode_batch("gpu", "t.gpu", 0, _recs([good, bad]))
        assert out.tables["gpu"].num_rows == 1 + rows, bad
        assert [(d.offset, d.reason) for d in out.dead] == ([(1, reason)] if reason else []), bad
        assert [q.field for q in out.quarantine] == fields, bad
        assert all(q.offset == 1 and q.payload == bad.decode() for q in out.quarantine)
    # Missing GPU fields take the defaults in the batch path.
    assert decode_arrow._fast_gpu(_recs([good, b'{"v":1,"ts":1760000002,"node":"n","gpus":[{"index":1}]}'])).num_rows == 2


def test_a_value_beyond_the_lake_column_is_nulled_not_the_whole_sample() -> None:
    good = schema.encode(_gpu(T0, "n1", [60.0]))
    huge = b'{"v":1,"ts":1760000001,"node":"n","gpus":[{"index":0,"ecc_sbe":99999999999999999999}]}'
    out = decode_batch("gpu", "t.gpu", 0, _recs([good, huge, good]))
    assert out.tables["gpu"].num_rows == 3 and not out.dead
    assert out.tables["gpu"].column("ecc_sbe").to_pylist() == [0, None, 0]
    assert [(q.offset, q.field, q.reason) for q in out.quarantine] == [(1, "gpus.ecc_sbe", "out_of_range")]


def test_gpu_fields_at_their_default_stay_off_the_wire_and_decode_back() -> None:
    healthy = _gpu(T0, "n1", [60.0, 61.0])
    sick = schema.GpuSample(ts=T0, node="n2", gpus=[schema.GpuState(index=0, util=0.0, ecc_dbe=2, remap_pending=True)])
    wire = orjson.loads(schema.encode(healthy))
    assert not set(wire["gpus"][0]) & schema.GPU_SPARSE_FIELDS
    assert {"ecc_dbe", "remap_pending"} <= set(orjson.loads(schema.encode(sick))["gpus"][0])
    for rec in (healthy, sick):
        assert schema.decode("gpu", schema.encode(rec)) == rec
        assert schema.decode("gpu", decode.encode_wire(rec)) == rec
    expected = [row for rec in (healthy, sick) for row in schema.lake_row(rec)]
    assert decode_arrow._fast_gpu(_recs([schema.encode(healthy), schema.encode(sick)])).to_pylist() == expected
    packed = decode_arrow._fast_gpu(_recs([decode.encode_wire(healthy), decode.encode_wire(sick)]))
    assert sorted(packed.to_pylist(), key=str) == sorted(expected, key=str)  # grouped by column layout


def test_the_batch_decoder_agrees_with_the_one_by_one_decoder_on_mutated_messages() -> None:
    """Swap one value for another JSON type; the whole-batch path must refuse or give the same rows."""
    rng = random.Random(11)
    base = orjson.loads(schema.encode(_gpu(T0, "n1", [60.0, 70.0])))
    replacements = [None, 1, 1.0, 1.5, -3, 2**70, True, "x", "12", "N/A", "2026-11-21", [], [1], {}, {"a": 1}]
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
        one_by_one = decode_batch("gpu", "t.gpu", 0, _recs([bad]))
        if expected is not None:
            assert one_by_one.tables["gpu"].to_pylist() == pa.Table.from_pylist(expected, schema=schema.lake_schema("gpu")).to_pylist()
        got = decode_arrow._fast_gpu(_recs([schema.encode(_gpu(T0, "n0", [50.0])), bad]))
        if got is not None:
            checked += 1
            assert expected is not None, bad
            assert got.to_pylist()[1:] == pa.Table.from_pylist(expected, schema=schema.lake_schema("gpu")).to_pylist(), bad
    assert checked > 50  # the fast path took a fair share of them


def test_lake_files_keep_dictionaries_for_strings_only(tmp_path) -> None:
    """Numbers go plain (zstd packs them as well, for less CPU); strings keep their dictionary."""
    lake = LakeWriter(tmp_path)
    sample = schema.GpuSample(ts=T0, node="n1", job="j", gpus=[schema.GpuState(index=i, uuid=f"GPU-{i}") for i in range(4)])
    (path,) = lake.write("gpu", [sample])
    meta = pa.parquet.ParquetFile(path).metadata.row_group(0)
    encodings = {meta.column(i).path_in_schema: set(meta.column(i).encodings) for i in range(meta.num_columns)}
    assert "RLE_DICTIONARY" in encodings["node"] and "RLE_DICTIONARY" in encodings["uuid"]
    assert "RLE_DICTIONARY" not in encodings["temp_c"] and "RLE_DICTIONARY" not in encodings["gpu"]
    assert pa.parquet.read_table(path).column("uuid").to_pylist() == [f"GPU-{i}" for i in range(4)]


def test_running_processors_share_one_gc_threshold_change_and_give_it_back() -> None:
    """The processor's fewer collections (issue 27.4) must not outlive it, nested or concurrent."""
    import gc

    from faultlens.stream import processor_runtime


    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        with processor_runtime.fewer_collections():
            assert gc.get_threshold()[0] == processor_runtime.GC_GEN0_THRESHOLD
            with processor_runtime.fewer_collections():
                assert gc.get_threshold()[0] == processor_runtime.GC_GEN0_THRESHOLD
            assert gc.get_threshold()[0] == processor_runtime.GC_GEN0_THRESHOLD  # the outer run still goes on
        assert gc.get_threshold() == (700, 10, 10)
    finally:
        gc.set_threshold(*before)
