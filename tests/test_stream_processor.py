"""The stream processor against the real embedded broker: exactly N rows, crashes, dead letters, outages."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from faultlens import schema
from faultlens.config import BusConfig, Config, LakeConfig
from faultlens.errors import LakeError
from faultlens.stream.bus import Consumer, Producer, ensure_topics
from faultlens.stream.bus.embedded_broker import EmbeddedBroker, free_port
from faultlens.stream.catalog import open_lake
from faultlens.stream.processor import StreamProcessor

pytestmark = pytest.mark.broker
T0 = 1_760_000_000.0


def mixed_records(n: int, start: int = 0) -> list:
    """n records of several kinds; every one is a distinct lake row (gpu: 2 GPUs each)."""
    out = []
    for i in range(start, start + n):
        k = i % 5
        if k in (0, 1):
            out.append(schema.GpuSample(ts=T0 + i, node=f"n{i % 7}", job="j1",
                                        gpus=[schema.GpuState(index=g, temp_c=60.0 + g) for g in range(2)]))  # fmt: skip
        elif k == 2:
            out.append(schema.StepTiming(ts=T0 + i, job="j1", rank=i % 16, node=f"n{i % 7}", step=i, duration_s=1.0 + i % 3))
        elif k == 3:
            out.append(schema.KernelEvent(ts=T0 + i, node=f"n{i % 7}", kind="xid", raw=f"NVRM: Xid (PCI:0000:3b:00): 79 #{i}", xid=79))
        else:
            out.append(schema.NcclEvent(ts=T0 + i, node=f"n{i % 7}", kind="watchdog_timeout", raw=f"timeout #{i}", seq_num=i))
    return out


def expected_rows(records: list) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        counts[r.KIND] = counts.get(r.KIND, 0) + len(schema.lake_row(r))
    return counts


def lake_counts(lake: Path) -> dict[str, tuple[int, int]]:
    """table -> (rows, distinct rows by natural key): equal means no duplicates."""
    keys = {"gpu": "node, ts, gpu", "steps": "job, rank, step", "kernel": "raw", "nccl": "raw"}
    db = open_lake(lake)
    try:
        return {t: db.execute(f"SELECT count(*), count(DISTINCT ({k})) FROM {t}").fetchone() for t, k in keys.items()}
    finally:
        db.close()


def produce(bus: BusConfig, records: list) -> None:
    with Producer(bus) as p:
        for r in records:
            p.send(r)
        p.flush()


def config_for(bus: BusConfig, tmp_path: Path) -> Config:
    return Config(bus=bus, lake=LakeConfig(path=str(tmp_path / "lake"), catalog_path=str(tmp_path / "catalog.duckdb"),
                                           group_id=f"{bus.topic_prefix}-stream", flush_interval_s=0.5))  # fmt: skip


# Both Kafka clients the processor can fetch with (stream/bus/lake_fetchers.py). confluent-kafka is a declared
# dependency of the server and test extras (the default fetcher on a real cluster), so it is
# tested, never skipped: a missing install fails here rather than passing quietly.
FETCHERS = ["kafka", "confluent"]


@pytest.mark.parametrize("fetcher", FETCHERS)
def test_n_mixed_messages_become_exactly_n_rows_and_bad_ones_dead_letters(bus, tmp_path, fetcher) -> None:
    ensure_topics(bus)
    records = mixed_records(600)
    produce(bus, records[:300])
    with Producer(bus) as p:
        p.send_raw("gpu", "n1", b"{not json")
        p.send_raw("kernel", "n2", b'{"v": 99, "ts": 1, "node": "n2", "kind": "xid", "raw": "x"}')
        p.send_raw("steps", "j1", b'{"v":1,"ts":1,"job":"j1","rank":0,"node":"n","step":1,"duration_s":1,"pad":"'
                   + b"x" * schema.MAX_MESSAGE_BYTES + b'"}')
        p.flush()
    produce(bus, records[300:])  # good messages after the bad ones still land

    proc = StreamProcessor(config_for(bus, tmp_path), flush_interval_s=0.3, fetcher=fetcher)
    stats = proc.run(exit_when_idle_s=2.0, max_runtime_s=60)

    want = expected_rows(records)
    got = lake_counts(tmp_path / "lake")
    assert {t: got[t] for t in want} == {t: (n, n) for t, n in want.items()}
    assert stats.dead_letters == {"malformed_json": 1, "unknown_version": 1, "oversized": 1}
    db = open_lake(tmp_path / "lake")
    reasons = db.execute('SELECT reason, topic FROM deadletter ORDER BY reason').fetchall()
    assert reasons == [("malformed_json", f"{bus.topic_prefix}.gpu"), ("oversized", f"{bus.topic_prefix}.steps"),
                       ("unknown_version", f"{bus.topic_prefix}.kernel")]  # fmt: skip
    assert db.execute("SELECT sum(steps) FROM steps_1m").fetchone()[0] == want["steps"]
    assert db.execute("SELECT sum(samples) FROM gpu_1m").fetchone()[0] == want["gpu"]

    dl = Consumer(bus, ["deadletter"], group_id=None)
    got_dl, deadline = [], time.monotonic() + 20
    while len(got_dl) < 3 and time.monotonic() < deadline:
        got_dl += dl.poll(300)
    dl.close()
    assert sorted(schema.decode("deadletter", m.value).reason for m in got_dl) == ["malformed_json", "oversized", "unknown_version"]


@pytest.mark.parametrize("fetcher", FETCHERS)
def test_a_restarted_processor_resumes_after_its_last_commit(bus, tmp_path, fetcher) -> None:
    """The next processor seeks each partition to the lake's last committed offset + 1 (not Kafka's)."""
    ensure_topics(bus)
    records = mixed_records(400)
    produce(bus, records[:200])
    StreamProcessor(config_for(bus, tmp_path), flush_interval_s=0.3, fetcher=fetcher).run(exit_when_idle_s=1.5, max_runtime_s=60)
    produce(bus, records[200:])
    StreamProcessor(config_for(bus, tmp_path), flush_interval_s=0.3, fetcher=fetcher).run(exit_when_idle_s=1.5, max_runtime_s=60)
    want = expected_rows(records)
    got = lake_counts(tmp_path / "lake")
    assert {t: got[t] for t in want} == {t: (n, n) for t, n in want.items()}


def test_ranges_written_ahead_of_their_commit_land_exactly_once(bus, tmp_path) -> None:
    """Buffers written ahead (files first, named by the next commit's manifest) give the same lake."""
    ensure_topics(bus)
    records = mixed_records(500)
    produce(bus, records[:250])
    with Producer(bus) as p:
        p.send_raw("gpu", "n1", b"{not json")
        p.flush()
    produce(bus, records[250:])
    proc = StreamProcessor(config_for(bus, tmp_path), flush_interval_s=0.3, write_ahead_rows=20)
    stats = proc.run(exit_when_idle_s=2.0, max_runtime_s=60)
    want = expected_rows(records)
    got = lake_counts(tmp_path / "lake")
    assert {t: got[t] for t in want} == {t: (n, n) for t, n in want.items()}
    assert stats.dead_letters == {"malformed_json": 1}
    db = open_lake(tmp_path / "lake")
    assert db.execute("SELECT count(*) FROM deadletter").fetchone()[0] == 1
    assert db.execute("SELECT sum(samples) FROM gpu_1m").fetchone()[0] == want["gpu"]
    # every file in the lake is named by a manifest (nothing written ahead was left unnamed)
    named = {r[0] for r in db.execute("SELECT file FROM manifest WHERE file IS NOT NULL").fetchall()}
    on_disk = {p.relative_to(tmp_path / "lake").as_posix() for p in (tmp_path / "lake").glob("*/date=*/hour=*/*.parquet")}
    assert on_disk == named and len(named) > 2 * len(want)


def test_a_failed_range_write_commits_nothing_and_a_restart_lands_every_row_once(bus, tmp_path) -> None:
    """The writer pool writes ranges of several partitions at once: one failing range stops the
    processor before its commit's manifest, and the next processor re-reads the whole range."""
    ensure_topics(bus)
    records = mixed_records(400)
    produce(bus, records)
    proc = StreamProcessor(config_for(bus, tmp_path), flush_interval_s=0.3, write_ahead_rows=20, write_threads=3)
    real_write = proc.lake.write_table_counted
    calls = {"n": 0}

    def failing_write(table, data, *, stem=None):
        calls["n"] += 1
        if calls["n"] == 3:
            raise LakeError("disk full (injected)")
        return real_write(table, data, stem=stem)

    proc.lake.write_table_counted = failing_write
    with pytest.raises(LakeError):
        proc.run(exit_when_idle_s=2.0, max_runtime_s=60)
    assert calls["n"] >= 3
    StreamProcessor(config_for(bus, tmp_path), flush_interval_s=0.3).run(exit_when_idle_s=1.5, max_runtime_s=60)
    want = expected_rows(records)
    got = lake_counts(tmp_path / "lake")
    assert {t: got[t] for t in want} == {t: (n, n) for t, n in want.items()}


def _start_processor(bus: BusConfig, tmp_path: Path, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "faultlens.cli", "stream", "--bootstrap-servers", bus.bootstrap_servers,
           "--set", f"bus.topic_prefix={bus.topic_prefix}", "--lake", str(tmp_path / "lake"),
           "--catalog", str(tmp_path / "catalog.duckdb"), "--group", f"{bus.topic_prefix}-stream",
           "--flush-interval-s", "0.2", "--flush-rows", "300", "--exit-when-idle-s", "3"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def kill_processor_repeatedly(bus, tmp_path: Path, log: Path, rng: random.Random, times: int,
                              alive_s: tuple[float, float]) -> int:
    """Start ``faultlens stream`` and kill -9 it after a random while, ``times`` times; returns the kills."""
    kills = 0
    for _ in range(times):
        proc = _start_processor(bus, tmp_path, log)
        time.sleep(rng.uniform(*alive_s))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait(timeout=10)
    return kills


@pytest.mark.slow
def test_kill_9_at_random_instants_loses_and_duplicates_nothing(bus, tmp_path) -> None:
    ensure_topics(bus)
    rng = random.Random(20240611)
    records = mixed_records(4000)
    # Producing goes on while the processor is killed and restarted, so kills
    # land while it consumes, writes files, and commits.
    producer = threading.Thread(target=lambda: [produce(bus, records[i:i + 200]) or time.sleep(0.4)
                                                for i in range(0, len(records), 200)])  # fmt: skip
    producer.start()
    log = tmp_path / "processor.log"
    kills = kill_processor_repeatedly(bus, tmp_path, log, rng, 10, (1.5, 4.5))
    producer.join(timeout=60)
    proc = _start_processor(bus, tmp_path, log)
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]

    want = expected_rows(records)
    got = lake_counts(tmp_path / "lake")
    assert kills >= 8
    assert {t: got[t] for t in want} == {t: (n, n) for t, n in want.items()}, log.read_text()[-3000:]
    assert "deleted" in log.read_text() or kills  # orphan clean-up is logged when a kill left files


@pytest.mark.slow
def test_processor_reconnects_after_the_broker_restarts(tmp_path) -> None:
    port = free_port()
    broker = EmbeddedBroker(port=port).start()
    try:
        bus = BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix="outage", linger_ms=5)
        ensure_topics(bus)
        before, after = mixed_records(200), mixed_records(800, start=200)
        produce(bus, before)
        proc = StreamProcessor(config_for(bus, tmp_path), flush_interval_s=0.3)
        worker = threading.Thread(target=proc.run, kwargs={"max_runtime_s": 120})
        worker.start()
        _wait_rows(tmp_path / "lake", expected_rows(before))

        broker.stop()  # memory only: its topics, offsets and groups are gone
        time.sleep(5)
        broker.start()
        ensure_topics(bus)
        produce(bus, after)
        # The new broker numbers offsets from 0 again; the processor resumes each
        # partition after its last committed offset, so the first messages of the
        # new log (offsets it already committed on the old one) are skipped. A real
        # Kafka keeps log and offsets across a restart, so nothing is skipped there.
        deadline = time.monotonic() + 90
        before_rows = lake_counts(tmp_path / "lake")["gpu"][0]
        while time.monotonic() < deadline and lake_counts(tmp_path / "lake")["gpu"][0] <= before_rows:
            time.sleep(0.3)
        proc.stop()
        worker.join(timeout=30)
        assert not worker.is_alive()
        got = lake_counts(tmp_path / "lake")
        assert got["gpu"][0] > before_rows, "no rows from the restarted broker reached the lake"
        assert all(rows == distinct for rows, distinct in got.values()), got
    finally:
        broker.stop()


def _wait_rows(lake: Path, want: dict[str, int], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    got: dict = {}
    while time.monotonic() < deadline:
        if (lake / "_manifest").exists():
            got = {t: v[0] for t, v in lake_counts(lake).items()}
            if all(got.get(t) == n for t, n in want.items()):
                return
        time.sleep(0.3)
    pytest.fail(f"lake rows {got} never reached {want}")


def test_a_bad_field_is_quarantined_and_a_non_json_message_dead_lettered_while_ingest_goes_on(bus, tmp_path) -> None:
    """The done-when of the one decoder, through the broker: remap_pending 1 and temp_c "N/A"
    land as a row with the flag true and the temperature null, counted once; bytes that are
    not JSON go to the dead-letter topic; the agent's MessagePack lands beside JSON."""
    from prometheus_client import CollectorRegistry

    from faultlens import decode

    ensure_topics(bus)
    line = b'{"v":1,"ts":1760000100.0,"node":"n1","job":"j1","gpus":[{"index":0,"remap_pending":1,"temp_c":"N/A"}]}'
    packed = schema.GpuSample(ts=T0 + 200, node="n2", job="j1", gpus=[schema.GpuState(index=g, temp_c=50.0) for g in range(4)])
    with Producer(bus) as p:
        p.send_raw("gpu", "n1", line)
        p.send_raw("gpu", "n1", b"\x00\x01\x02 NVSMI LOG: not json")
        p.send_raw("gpu", "n2", decode.encode_wire(packed))
        p.flush()
    produce(bus, mixed_records(20))  # good messages after the bad one still land

    registry = CollectorRegistry()
    proc = StreamProcessor(config_for(bus, tmp_path), flush_interval_s=0.3, registry=registry)
    stats = proc.run(exit_when_idle_s=2.0, max_runtime_s=60)

    db = open_lake(tmp_path / "lake")
    assert db.execute("SELECT remap_pending, temp_c FROM gpu WHERE node = 'n1' AND ts = 1760000100.0").fetchall() == [(True, None)]
    assert db.execute("SELECT count(*), min(temp_c) FROM gpu WHERE node = 'n2' AND ts = ?", [T0 + 200]).fetchone() == (4, 50.0)
    assert db.execute("SELECT count(*) FROM gpu").fetchone()[0] == 1 + 4 + expected_rows(mixed_records(20))["gpu"]
    q = db.execute("SELECT topic, field, reason, value, node, payload FROM quarantine").fetchall()
    assert q == [("gpu", "gpus.temp_c", "not_available", '"N/A"', "n1", line.decode())]
    assert stats.quarantined == {("gpu", "gpus.temp_c", "not_available"): 1}
    labels = {"topic": "gpu", "field": "gpus.temp_c", "reason": "not_available"}
    assert registry.get_sample_value("faultlens_fields_quarantined_total", labels) == 1.0
    assert stats.dead_letters == {"malformed_json": 1}
    dl = Consumer(bus, ["deadletter"], group_id=None)
    got_dl, deadline = [], time.monotonic() + 20
    while not got_dl and time.monotonic() < deadline:
        got_dl += dl.poll(300)
    dl.close()
    dead = [schema.decode("deadletter", m.value) for m in got_dl]
    assert [(d.reason, d.topic) for d in dead] == [("malformed_json", f"{bus.topic_prefix}.gpu")]
    assert "NVSMI LOG" in dead[0].payload
