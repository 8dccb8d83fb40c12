"""Poison never stops a service (issue 24 item 4): every message that broke one, recorded here.

Each test replays the input that broke a service when the issue was filed:

* one JSON GPU sample stamped in milliseconds stopped the stream processor on every restart
  ("year 57303 is out of range") -- the JSON batch path never checked the time;
* one GPU sample stamped 2100 moved the clock of every job on its partition: a real Xid 79's
  action was dated 2100-01-01 and its incident closed at once;
* a tombstone on the actions topic gave three tracebacks in the runner;
* lake paths with a quote broke the catalog's views.
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import msgspec
import orjson
import pytest

from faultlens import decode, schema
from faultlens.config import Config, LakeConfig
from faultlens.diagnosis.engine import DiagnosisEngine
from faultlens.errors import SchemaError
from faultlens.stream.bus.consume_loop import ConsumeLoop
from faultlens.stream.decode_arrow import decode_batch
from tests import fleetgen

# The recorded message: a producer that wrote Date.now() (milliseconds) as the time.
MS_SAMPLE = b'{"v":1,"ts":1746150000000,"node":"gpu-a17","job":"llm-70b","gpus":[{"index":0,"util":97.0,"temp_c":71.0}]}'
# The same sample from a clock at 2100, one at 1970 (a boot-relative time), one in microseconds.
Y2100_SAMPLE = b'{"v":1,"ts":4102444800.0,"node":"gpu-a17","job":"llm-70b","gpus":[{"index":0,"util":97.0}]}'
Y1970_SAMPLE = b'{"v":1,"ts":1234.5,"node":"gpu-a17","job":"llm-70b","gpus":[{"index":0,"util":97.0}]}'
US_SAMPLE = b'{"v":1,"ts":1746150000000000,"node":"gpu-a17","job":"llm-70b","gpus":[{"index":0,"util":97.0}]}'
GOOD_TS = 1_760_000_000.0


def good_sample(i: int) -> bytes:
    return (b'{"v":1,"ts":%.1f,"node":"gpu-a%02d","job":"llm-70b","gpus":[{"index":0,"util":97.0,"temp_c":71.0}]}'
            % (GOOD_TS + i, i))


POISON = [(MS_SAMPLE, "ts_milliseconds"), (US_SAMPLE, "ts_microseconds"), (Y2100_SAMPLE, "ts_future"),
          (Y1970_SAMPLE, "ts_past")]


@pytest.mark.parametrize(("payload", "reason"), POISON)
def test_every_decode_path_refuses_a_time_out_of_bounds_with_its_reason(payload: bytes, reason: str) -> None:
    obj = msgspec.json.decode(payload)
    tolerant = dict(obj, gpus=[{"index": 0, "temp_c": "N/A"}])  # the per-field path
    packed = schema.GpuSample(ts=obj["ts"], node="n1", gpus=[schema.GpuState(index=0, util=1.0)])
    for attempt in (
        lambda: decode.decode("gpu", payload),  # the typed fast path
        lambda: decode.decode("gpu", msgspec.json.encode(tolerant)),
        lambda: decode.decode("gpu", decode.encode_wire(packed), content_type=decode.MSGPACK_TYPE),
        lambda: decode.from_obj("gpu", obj),
    ):
        with pytest.raises(SchemaError) as err:
            attempt()
        assert err.value.reason == reason, err.value


def test_an_iso_time_in_2100_and_a_future_dated_action_are_refused() -> None:
    with pytest.raises(SchemaError, match="ts_future"):
        decode.from_obj("kernel", {"ts": "2100-01-01T00:00:00Z", "node": "n1", "kind": "xid", "raw": "x"})
    action = schema.Action(id="act-1", incident_id="inc-1", job="j1", ts=4102444800.0, type="evict_nodes",
                           nodes=["n1"], confidence=0.99, reason="Xid 79")
    with pytest.raises(SchemaError, match="ts_future"):
        schema.decode("actions", schema.encode(action))


def test_the_runner_refuses_an_action_dated_an_hour_ahead(tmp_path) -> None:
    """Actions are stamped on diagnosis's bounded clock: one dated past the skew is not acted on."""
    import orjson

    from faultlens.config import RunnerConfig
    from faultlens.diagnosis.runner.runner import ActionRunner

    ahead = schema.Action(id="act-ahead", incident_id="inc-1", job="j1", ts=time.time() + 3600, type="evict_nodes",
                          nodes=["n1"], confidence=0.99, reason="Xid 79")
    runner = ActionRunner(Config(runner=RunnerConfig(state_path=str(tmp_path / "ledger.jsonl"))))
    out = runner.handle(orjson.dumps(schema.cloudevent(ahead)))
    assert out.dead_letter is not None and out.dead_letter.reason == "ts_future"
    assert out.status is not None and out.status.status == "refused"
    on_time = schema.Action(id="act-now", incident_id="inc-1", job="j1", ts=time.time() + 60, type="notify",
                            nodes=[], confidence=0.99, reason="Xid 79")
    assert runner.handle(orjson.dumps(schema.cloudevent(on_time))).dead_letter is None


def test_time_bounds_come_from_the_config() -> None:
    from faultlens.config import load_config

    cfg = load_config(None, env={}, overrides=["time.earliest_ts=0", "time.max_future_s=10"])
    bounds = decode.TimeBounds.from_config(cfg)
    assert bounds.problem(1234.5) is None
    assert bounds.problem(time.time() + 60)[0] == "ts_future"


def _records(values: list[bytes | None]) -> list[SimpleNamespace]:
    return [SimpleNamespace(offset=i, key=b"n", value=v, headers=[]) for i, v in enumerate(values)]


@pytest.mark.parametrize(("payload", "reason"), POISON)
def test_the_json_batch_path_dead_letters_the_bad_stamp_and_keeps_the_rest(payload, reason, tmp_path) -> None:
    from faultlens.stream.lake import LakeWriter

    out = decode_batch("gpu", "t.gpu", 0, _records([good_sample(0), payload, good_sample(2)]))
    assert [(d.offset, d.reason) for d in out.dead] == [(1, reason)]
    assert out.tables["gpu"].num_rows == 2
    LakeWriter(tmp_path / "lake").write_table_counted("gpu", out.tables["gpu"], stem="t")  # writes, no year 57303


def test_the_msgpack_batch_path_dead_letters_a_ms_stamp() -> None:
    def wire(ts: float) -> bytes:
        return decode.encode_wire(schema.GpuSample(ts=ts, node="n1", gpus=[schema.GpuState(index=0, util=5.0)]))

    out = decode_batch("gpu", "t.gpu", 0, _records([wire(GOOD_TS), wire(1746150000000.0), wire(GOOD_TS + 1)]))
    assert [(d.offset, d.reason) for d in out.dead] == [(1, "ts_milliseconds")]
    assert out.tables["gpu"].num_rows == 2


def test_a_tombstone_is_a_dead_letter_on_the_decode_path() -> None:
    out = decode_batch("kernel", "t.kernel", 3, _records([None, b""]))
    assert [d.reason for d in out.dead] == ["tombstone", "empty_message"]


def test_a_job_clock_never_runs_ahead_of_the_wall_clock() -> None:
    """The recorded case: a GPU sample stamped 2100 (one the decoder lets through when its bounds are
    loose), then a real Xid 79: the action is dated now, and its incident is not closed at once."""
    engine = DiagnosisEngine(Config())
    now = time.time()
    for r in fleetgen.fleet(jobs=1, nodes_per_job=4, unjobbed=0, duration_s=5, faulty_jobs=0).topologies:
        engine.observe(r)
    engine.observe(schema.GpuSample(ts=4102444800.0, node="j0000n01", gpus=[schema.GpuState(index=0, util=90.0)]))
    assert engine.now <= time.time() + Config().time.max_clock_skew_s
    out = engine.observe(fleetgen.xid_line("j0000n03", 79, now))
    actions = [o for o in out if type(o).KIND == "actions"]
    assert [a.type for a in actions] == ["evict_nodes"]
    assert actions[0].ts < now + 3600
    engine.tick(now + 1)
    assert [i.status for i in engine.book.incidents.values() if i.kind == "gpu_lost"] == ["mitigated"]  # not closed


class _FakeConsumer:
    """Only what ConsumeLoop asks of a consumer; the bus itself is tested in the broker tests below."""

    def __init__(self, batch):
        self.batch = batch
        self.raw = SimpleNamespace(assignment=lambda: set())

    def poll(self, timeout_ms, max_records):
        out, self.batch = self.batch, []
        return out


def test_the_consume_loop_dead_letters_tombstones_before_any_handler_sees_them(caplog) -> None:
    from faultlens.stream.bus import Message

    seen: list[int] = []
    msgs = [Message("actions", "t.actions", 0, 0, "j1", None, 0), Message("actions", "t.actions", 0, 1, "j1", b"", 0),
            Message("actions", "t.actions", 0, 2, "j1", b'{"x":1}', 0)]

    def handle(batch):
        for m in batch:
            m.value.decode()  # a handler that assumes bytes: a tombstone would raise here
            seen.append(m.offset)

    from faultlens.metrics import ServiceMetrics

    metrics = ServiceMetrics("runner")
    loop = ConsumeLoop(_FakeConsumer(msgs), handle, name="runner", metrics=metrics)
    with caplog.at_level(logging.WARNING):
        assert loop.step() == 3
    assert seen == [2]
    assert loop.stats.by_reason == {"tombstone": 1, "empty_message": 1} and loop.stats.handler_errors == 0
    labels = {"topic": "t.actions", "reason": "tombstone"}
    assert metrics.registry.get_sample_value("faultlens_dead_letters_total", labels) == 1.0
    assert not [r for r in caplog.records if r.exc_info], "no traceback for a tombstone"


@pytest.mark.broker
def test_a_tombstone_on_the_actions_topic_gives_the_runner_no_traceback(bus, tmp_path, caplog) -> None:
    """The recorded case: one null value on the actions topic gave three tracebacks in the runner."""
    from faultlens.config import RunnerConfig
    from faultlens.diagnosis.runner.runner import ActionRunner
    from faultlens.stream.bus import Consumer, Producer, ensure_topics

    ensure_topics(bus, names=("actions", "action-status", "deadletter"))
    with Producer(bus) as p:
        p.send_raw("actions", "4242", None)
        p.flush()
    dead = Consumer(bus, ["deadletter"], group_id=None)
    runner = ActionRunner(Config(bus=bus, runner=RunnerConfig(group_id=f"{bus.topic_prefix}-runner",
                                                              state_path=str(tmp_path / "ledger.jsonl"))))
    try:
        with caplog.at_level(logging.WARNING):
            got, deadline = [], time.monotonic() + 30
            import threading

            stop = threading.Event()
            t = threading.Thread(target=runner.run, args=(stop,), kwargs={"max_seconds": 40, "poll_ms": 200})
            t.start()
            while not got and time.monotonic() < deadline:
                got += dead.poll(200)
            stop.set()
            t.join(30)
    finally:
        dead.close()
    letters = [schema.decode("deadletter", m.value) for m in got]
    assert [d.reason for d in letters] == ["tombstone"]
    assert not [r for r in caplog.records if r.exc_info], "a tombstone must not give a traceback"


@pytest.mark.broker
def test_the_processor_goes_on_past_a_ms_stamp_and_a_tombstone_every_restart(bus, tmp_path) -> None:
    """The recorded case: one JSON GPU sample stamped in milliseconds stopped the processor on every restart."""
    from faultlens.stream.bus import Producer, ensure_topics
    from faultlens.stream.catalog import open_lake
    from faultlens.stream.processor import StreamProcessor

    ensure_topics(bus)
    with Producer(bus) as p:
        for i in range(5):
            p.send_raw("gpu", f"gpu-a{i:02d}", good_sample(i))
        p.send_raw("gpu", "gpu-a17", MS_SAMPLE)
        p.send_raw("gpu", "gpu-a17", None)
        p.send_raw("gpu", "gpu-a17", Y2100_SAMPLE)
        for i in range(5, 10):
            p.send_raw("gpu", f"gpu-a{i:02d}", good_sample(i))
        p.flush()
    lake = tmp_path / "it's a \"lake\" dir"  # and a lake path with quotes and a space (the catalog's views)
    config = Config(bus=bus, lake=LakeConfig(path=str(lake), catalog_path=str(tmp_path / "o'cat.duckdb"),
                                             group_id=f"{bus.topic_prefix}-stream", flush_interval_s=0.3))
    for _ in range(2):  # a restart reads on; nothing stops it
        stats = StreamProcessor(config).run(exit_when_idle_s=1.5, max_runtime_s=60)
    db = open_lake(lake)
    try:
        assert db.execute("SELECT count(*) FROM gpu").fetchone()[0] == 10
        reasons = db.execute("SELECT reason, count(*) FROM deadletter GROUP BY ALL ORDER BY 1").fetchall()
        assert reasons == [("tombstone", 1), ("ts_future", 1), ("ts_milliseconds", 1)]
        assert db.execute("SELECT count(*) FROM manifest").fetchone()[0] >= 1
    finally:
        db.close()
    assert isinstance(stats.dead_letters, dict)


def test_the_catalog_reads_a_lake_whose_path_has_quotes(tmp_path) -> None:
    from faultlens.stream.catalog import Catalog, open_lake, sql_literal

    assert sql_literal("a'b") == "'a''b'"
    lake = tmp_path / "o'brien \"lake\""
    cat = Catalog(tmp_path / "c'at.duckdb", lake)
    cat.commit("c1", [{"kind": "gpu", "topic": "t.gpu", "partition": 0, "first_offset": 0, "last_offset": 4,
                       "lake_table": None, "file": None, "rows": 0}])
    cat.close()
    again = Catalog(tmp_path / "other.duckdb", lake)
    assert again.sync_from_lake() == 1
    again.close()
    db = open_lake(lake)
    assert db.execute("SELECT last_offset FROM manifest").fetchall() == [(4,)]
    assert db.execute("SELECT count(*) FROM gpu").fetchone()[0] == 0
    db.close()



def test_a_recorded_directory_keeps_its_own_time_even_ahead_of_this_clock() -> None:
    """The bounds protect live services; a recorded directory (faultlens diagnose DIR) from a machine whose
    clock ran ahead, or a generated scenario dated next month, is read as written (blind scenarios stamped
    weeks ahead lost every step record and their hang to ts_future)."""
    ahead = orjson.dumps({"v": 1, "ts": time.time() + 30 * 86400, "job": "j1", "rank": 0, "node": "n1", "step": 1,
                          "duration_s": 1.0, "n_seqs": 1, "sum_len": 1, "sum_len_sq": 1, "tokens": 1})
    with pytest.raises(SchemaError):
        decode.decode("steps", ahead)
    assert decode.decode("steps", ahead, bounds=decode.RECORDED_TIME).step == 1
