"""Schema round trips, configuration errors and a produce/consume through the real broker."""

from __future__ import annotations

import time

import orjson
import pytest

from faultlens import schema
from faultlens.config import load_config
from faultlens.errors import ConfigError, SchemaError
from faultlens.stream.bus import Consumer, Producer, ensure_topics


def _gpu_sample() -> schema.GpuSample:
    return schema.GpuSample(
        ts=1760000001.5, node="n001", gpus=[schema.GpuState(index=i, uuid=f"GPU-{i}", temp_c=60.0 + i) for i in range(8)]
    )


def test_every_kind_round_trips_through_json() -> None:
    rec = _gpu_sample()
    back = schema.decode("gpu", schema.encode(rec))
    assert back == rec
    assert orjson.loads(schema.encode(rec))["v"] == schema.SCHEMA_VERSION
    ev = schema.KernelEvent(ts=1760000002.0, node="n1", kind="xid", raw="[1.0] NVRM: Xid (PCI:0000:3b:00): 79, pid=1", xid=79)
    assert schema.decode("kernel", schema.encode(ev)) == ev


@pytest.mark.parametrize(
    "payload, reason",
    [
        (b"{not json", "malformed_json"),
        (b'{"v": 99, "ts": 1760000001, "node": "n", "gpus": []}', "unknown_version"),
        (b'{"v": 1, "node": "n", "gpus": []}', "missing_field"),
        (b'{"v": 1, "ts": "yesterday", "node": "n", "gpus": []}', "bad_type"),
        (b"[1, 2]", "not_an_object"),
        (b'{"v":1}' + b" " * (schema.MAX_MESSAGE_BYTES + 1), "oversized"),
    ],
)
def test_bad_messages_raise_with_a_stable_reason(payload: bytes, reason: str) -> None:
    with pytest.raises(SchemaError) as info:
        schema.decode("gpu", payload)
    assert info.value.reason == reason


def test_lake_rows_match_the_lake_schema() -> None:
    import pyarrow as pa

    rows = schema.lake_row(_gpu_sample())
    table = pa.Table.from_pylist(rows, schema=schema.lake_schema("gpu"))
    assert table.num_rows == 8 and table.column("gpu").to_pylist() == list(range(8))
    inc = schema.Incident(id="i1", job="j", opened_ts=1760000001, updated_ts=1760000002, status="open", category="pcie",
                          kind="gpu_lost", title="t", suspects=[{"node": "n1", "score": 1.0}])
    t = pa.Table.from_pylist(schema.lake_row(inc), schema=schema.lake_schema("incidents"))
    assert orjson.loads(t.column("suspects")[0].as_py())[0]["node"] == "n1"


def test_cloudevent_envelope_carries_the_record() -> None:
    act = schema.Action(id="a1", incident_id="i1", job="j1", ts=1760000100.0, type="evict_nodes", nodes=["n1"])
    ce = schema.cloudevent(act)
    assert ce["specversion"] == "1.0" and ce["subject"] == "j1" and ce["data"]["type"] == "evict_nodes"
    assert schema.decode("actions", orjson.dumps(ce)) == act


def test_config_errors_name_file_and_key(tmp_path) -> None:
    f = tmp_path / "faultlens.toml"
    f.write_text('[guard]\nmax_evictions_per_job_per_hour = "many"\n')
    with pytest.raises(ConfigError) as info:
        load_config(f, env={})
    assert str(f) in str(info.value) and "guard.max_evictions_per_job_per_hour" in str(info.value)
    f.write_text("[nope]\nx = 1\n")
    with pytest.raises(ConfigError, match="unknown section"):
        load_config(f, env={})


def test_config_precedence_file_env_flags(tmp_path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[bus]\nbootstrap_servers = "file:9092"\nsasl_password = "hunter2"\n[guard]\ndry_run = true\n')
    cfg = load_config(f, env={"FAULTLENS_BOOTSTRAP": "env:9092", "FAULTLENS_GUARD_DRY_RUN": "false"})
    assert cfg.bus.bootstrap_servers == "env:9092" and cfg.guard.dry_run is False
    cfg = load_config(f, env={}, overrides=["guard.dry_run=false"], flags={"bus.bootstrap_servers": "flag:1"})
    assert cfg.bus.bootstrap_servers == "flag:1"
    assert "hunter2" not in str(cfg.describe())


@pytest.mark.broker
def test_produce_and_consume_through_the_embedded_broker(bus) -> None:
    ensure_topics(bus)
    with Producer(bus) as producer:
        for i in range(50):
            producer.send(schema.GpuSample(ts=1_760_000_000.0 + i, node=f"n{i % 4}", gpus=[schema.GpuState(index=0)]))
        producer.flush()
    consumer = Consumer(bus, ["gpu"], group_id="g-basic")
    got = []
    deadline = time.monotonic() + 30
    while len(got) < 50 and time.monotonic() < deadline:
        got += consumer.poll(500)
    consumer.close()
    assert len(got) == 50
    assert {m.key for m in got} == {"n0", "n1", "n2", "n3"}
    assert sorted(schema.decode("gpu", m.value).ts for m in got) == [1_760_000_000.0 + i for i in range(50)]
