"""Per-job diagnosis state: every part of the engine's state is checkpointed, a checkpoint round trip keeps
what the next decision depends on (open incidents, the IB repeat counter, actions already taken), and a
checkpoint an earlier engine wrote still restores."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import msgspec
import orjson
import pytest

from faultlens.config import Config
from faultlens.diagnosis.engine import DiagnosisEngine, default_detectors
from faultlens.diagnosis.engine_state import ALL_PARTS, checkpointed_fields, state_fields
from faultlens.diagnosis.nodehealth import NodeHealth
from faultlens.diagnosis.online.state import (
    CheckpointError,
    JobState,
    mark_value,
    read_mark,
    restore,
    snapshot,
)
from tests import fleetgen


def _engine(health: NodeHealth | None = None) -> DiagnosisEngine:
    return DiagnosisEngine(Config(), detectors=default_detectors(), node_health=health)


def test_every_part_of_the_engine_state_is_checkpointed() -> None:
    # A new field of EngineState must get a checkpoint part (engine_state.PARTS), or a restored
    # instance silently forgets it.
    assert checkpointed_fields() == state_fields()


def test_checkpoint_round_trip_keeps_open_incidents_and_repeat_counters(tmp_path) -> None:
    health = NodeHealth(tmp_path / "health.duckdb")
    fleet = fleetgen.fleet(jobs=1, nodes_per_job=4, unjobbed=0, duration_s=20, faulty_jobs=0)
    t0 = fleetgen.T0
    engine = _engine(health)
    for r in [*fleet.topologies, *fleet.records]:
        engine.observe(r)
    first = engine.observe(fleetgen.xid_line("j0000n03", 79, t0 + 21))
    engine.observe(fleetgen.ib_down("j0000n02", t0 + 22))
    assert [o.type for o in first if type(o).KIND == "actions"] == ["evict_nodes"]
    state = JobState("job0000", 5, engine, next_offset=77, sources={"gpu/j0000n01": 12})
    state.outbox = list(first)
    blob = snapshot(state)

    back = restore(blob, 5, lambda key: _engine(health), "job0000")
    assert (back.key, back.partition, back.next_offset, back.sources) == ("job0000", 5, 77, {"gpu/j0000n01": 12})
    assert [o.id for o in back.outbox] == [o.id for o in first]
    assert back.engine.node_health is health and back.engine.book.prior_blames.__self__ is health
    assert sorted(i.id for i in back.engine.book.open_incidents()) == sorted(i.id for i in engine.book.open_incidents())
    # The same Xid again: it joins the open incident, and the eviction is not decided twice.
    again = back.engine.observe(fleetgen.xid_line("j0000n03", 79, t0 + 25))
    assert not [o for o in again if type(o).KIND == "actions"]
    # The IB link's second alert within five minutes evicts: the first one came back with the state.
    repeat = back.engine.observe(fleetgen.ib_down("j0000n02", t0 + 60))
    assert [(o.type, o.nodes) for o in repeat if type(o).KIND == "actions"] == [("evict_nodes", ["j0000n02"])]
    health.close()


def test_a_record_forwarded_twice_is_applied_once() -> None:
    st = JobState("j", 0, _engine())
    assert not st.seen("gpu", "n1", 10)
    assert st.seen("gpu", "n1", 10) and st.seen("gpu", "n1", 9)
    assert not st.seen("kernel", "n1", 3) and not st.seen("gpu", "n2", 1) and not st.seen("gpu", "n1", 11)


# --------------------------------------------------------------------------- state without pickle


class _TouchesAFile:
    """What an attacker who can write diag-changelog would send: a pickle that runs code when loaded."""

    path = ""

    def __reduce__(self):
        return (open, (self.path, "w"))


def _pickled_checkpoint(target) -> bytes:
    import pickle  # the attack's own payload: the code under test never unpickles

    _TouchesAFile.path = str(target)
    return zlib.compress(pickle.dumps({"format": 1, "key": "job0000", "engine": _TouchesAFile()}), 1)


def test_a_checkpoint_is_a_versioned_data_document() -> None:
    engine = _engine()
    for r in fleetgen.fleet(jobs=1, nodes_per_job=4, unjobbed=0, duration_s=20, faulty_jobs=1).records:
        engine.observe(r)
    body = msgspec.msgpack.decode(zlib.decompress(snapshot(JobState("job0000", 1, engine))))
    assert (body["format"], body["version"]) == ("faultlens.checkpoint", 2)
    assert set(body["engine"]) == ALL_PARTS


@pytest.mark.parametrize("value", [
    None, b"", b"garbage", zlib.compress(msgspec.msgpack.encode([1, 2])),
    zlib.compress(msgspec.msgpack.encode({"format": "faultlens.checkpoint", "version": 1})),
    zlib.compress(msgspec.msgpack.encode({"format": "faultlens.checkpoint", "version": 2, "key": "j", "next_offset": 0,
                                          "sources": {}, "engine": {"book": {"$o": "subprocess:Popen", "f": {}}}})),
], ids=["null", "empty", "garbage", "a list", "old version", "a class not ours"])
def test_an_unreadable_checkpoint_is_refused_by_name(value) -> None:
    with pytest.raises(CheckpointError):
        restore(value, 0, lambda key: _engine(), "j")


def test_a_pickled_checkpoint_is_never_unpickled(tmp_path) -> None:
    target = tmp_path / "pwned"
    with pytest.raises(CheckpointError, match="not a checkpoint document"):
        restore(_pickled_checkpoint(target), 0, lambda key: _engine(), "job0000")
    assert not target.exists()


def test_the_codec_builds_only_our_classes_and_never_imports() -> None:
    from faultlens.diagnosis.online import codec

    for doc in ({"$o": "os:system", "f": {}}, {"$o": "faultlens.diagnosis.runner:ActionRunner", "f": {}},
                {"$st": "faultlens.config:Config", "f": {}}, {"$o": "faultlens.config:__class__", "f": {}},
                {"$nd": "AAAA", "dtype": "|O", "shape": [1]}, {"$dd": [], "f": "eval"}, {"$ref": 7}):
        with pytest.raises(codec.CodecError):
            codec.decode(doc)
    shared = [1, 2]
    back = codec.decode(orjson.loads(orjson.dumps(codec.encode({"a": shared, "b": shared, (1, "x"): {3}}))))
    assert back["a"] is back["b"] and back[(1, "x")] == {3}


def test_marks_that_do_not_read_are_refused() -> None:
    assert read_mark(mark_value(12, 1.5))["next_offset"] == 12
    for bad in (None, b"", b"null", b"[]", b'{"next_offset": -1}', b'{"next_offset": "5"}', b"\x80\x03pickle"):
        with pytest.raises(CheckpointError):
            read_mark(bad)


def test_a_checkpoint_naming_a_class_not_ours_is_refused_and_nothing_is_built(tmp_path) -> None:
    body = msgspec.msgpack.decode(zlib.decompress(snapshot(JobState("j", 0, _engine()))))
    body["engine"]["book"] = {"$o": "subprocess:Popen", "f": {"args": ["touch", str(tmp_path / "x")]}}
    body["engine"]["guard"] = {"$o": "faultlens.diagnosis.online.state:JobState", "f": {}}
    with pytest.raises(CheckpointError, match="is not one a checkpoint may hold"):
        restore(zlib.compress(msgspec.msgpack.encode(body)), 0, lambda key: _engine(), "j")
    assert not (tmp_path / "x").exists()


def test_a_checkpoint_written_before_the_workflows_split_restores() -> None:
    # A document the 865-line engine wrote (tests/fixtures/checkpoints/v2-before-workflows/README.md).
    here = Path(__file__).parent / "fixtures" / "checkpoints" / "v2-before-workflows"
    expect = json.loads((here / "engine-v2.expected.json").read_text())
    back = restore((here / "engine-v2.ckpt").read_bytes(), 3, lambda key: _engine(), "job0000")
    engine = back.engine
    assert (back.key, back.next_offset, back.sources) == ("job0000", 1234, {"gpu/j0000n01": 77})
    assert [o.id for o in back.outbox] == expect["outbox"]
    assert sorted([i.id, str(i.kind), i.status, sorted(i.decided), i.node] for i in engine.book.incidents.values()) \
        == expect["incidents"]
    assert engine.now == expect["now"] and engine.counts == expect["counts"]
    assert {k: sorted(v) for k, v in engine.state.evicted.items()} == expect["evicted"]
    assert engine.state.jobs["job0000"].progress.last_step == expect["jobs"]["job0000"]["last_step"]
    # It decides on: the same Xid joins the incident that already evicted; the IB link's second alert evicts.
    t0 = fleetgen.T0
    assert not [o for o in engine.observe(fleetgen.xid_line("j0000n03", 79, t0 + 50)) if type(o).KIND == "actions"]
    repeat = engine.observe(fleetgen.ib_down("j0000n02", t0 + 60))
    assert [(o.type, o.nodes) for o in repeat if type(o).KIND == "actions"] == [("evict_nodes", ["j0000n02"])]
    engine.tick(t0 + 120)  # the job's progress, written before it had pause fields, is read on a tick


def test_a_checkpoint_naming_classes_where_they_were_before_the_move_restores() -> None:
    """Checkpoints written before the record schemas left stream/ (and Decision left policy.py) name
    their classes there: a new build restores them, so an upgrade does not start every job afresh."""
    from faultlens.diagnosis.decision import Decision
    from faultlens.diagnosis.online import codec
    from faultlens.schema import GpuState

    gpu = codec.encode(GpuState(index=3, util=55.0))
    decision = codec.encode(Decision("notify", ("n1",), "why", 0.5))
    old_gpu = orjson.loads(orjson.dumps(gpu).replace(b"faultlens.schema:", b"faultlens.stream.schema:"))
    old_decision = orjson.loads(orjson.dumps(decision).replace(b"faultlens.diagnosis.decision:",
                                                               b"faultlens.diagnosis.policy:"))
    assert old_gpu != gpu and old_decision != decision
    assert codec.decode(old_gpu) == GpuState(index=3, util=55.0)
    assert codec.decode(old_decision) == Decision("notify", ("n1",), "why", 0.5)
