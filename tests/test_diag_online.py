"""The online service through the real embedded broker: a kernel Xid record -> an action on the actions topic."""

import time

import orjson
import pytest

from faultlens import schema
from faultlens.config import Config, DiagnosisConfig
from faultlens.diagnosis.online import DiagnosisService
from faultlens.schema import JobTopology, KernelEvent
from faultlens.stream.bus import Consumer, Producer, ensure_topics
from faultlens.stream.topology import Topology

pytestmark = pytest.mark.broker


def _xid_on_n002(bus, broker, service, actions) -> list:
    """Job j9's topology, then a real Xid 79 on its node n002: the actions-topic messages within 30 s."""
    topo = Topology.packed(tp=8, pp=1, dp=2, gpus_per_node=8, job="j9")
    with Producer(bus, broker.bootstrap) as producer:
        producer.send(JobTopology(ts=time.time(), job="j9", **{k: v for k, v in topo.to_job_dict().items() if k != "job"}))
        producer.flush(5)
        deadline = time.monotonic() + 30
        while service.engine.job_of_node("n002") != "j9" and time.monotonic() < deadline:
            time.sleep(0.05)
        producer.send(KernelEvent(ts=time.time(), node="n002", kind="xid", xid=79,
                                  raw="NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."))
        producer.flush(5)
    got = []
    deadline = time.monotonic() + 30
    while not got and time.monotonic() < deadline:
        got = actions.poll(timeout_ms=200)
    return got


def test_xid_to_action_through_the_bus(bus, broker):
    config = Config(bus=bus, diagnosis=DiagnosisConfig(group_id=f"{bus.topic_prefix}-diag"))
    ensure_topics(bus, broker.bootstrap)
    service = DiagnosisService(config, bootstrap=broker.bootstrap, from_beginning=True).start()
    actions = Consumer(bus, ["actions"], group_id=None, bootstrap=broker.bootstrap)
    try:
        got = _xid_on_n002(bus, broker, service, actions)
        assert got, "no action within 30 s"
        event = orjson.loads(got[0].value)
        assert event["specversion"] == "1.0" and event["subject"] == "j9"
        action = schema.decode("actions", got[0].value)
        assert action.type == "evict_nodes" and action.nodes == ["n002"] and action.dry_run
    finally:
        actions.close()
        service.stop()


class _OpensAFile:
    """A pickle whose loading would run code (opens a file): what a writer of diag-changelog could send."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_poisoned_changelog_starts_jobs_afresh_and_the_next_xid_still_acts(bus, broker, tmp_path):
    """The recorded case: a null ~mark on diag-changelog crash-looped online diagnosis (3 of 3 restarts
    exited 1), then Xid 79 gave no action. Here: null, garbage and pickled values for the marker and
    for the job's own key, in every partition; the service reads past them and acts."""
    import pickle
    import zlib

    from faultlens.stream.topics import REPARTITION_PARTITIONS

    target = tmp_path / "pwned"
    evil = zlib.compress(pickle.dumps({"format": 1, "engine": _OpensAFile(str(target))}))
    config = Config(bus=bus, diagnosis=DiagnosisConfig(group_id=f"{bus.topic_prefix}-diag"))
    ensure_topics(bus, broker.bootstrap)
    with Producer(bus, broker.bootstrap) as producer:
        for p in range(REPARTITION_PARTITIONS):
            for key, value in (("~mark", b'{"next_offset": 0, "stream_time": 1.0}'), ("~mark", None),
                               ("~mark", b"\x80\x04garbage"), ("j9", evil), ("j8", b"not a checkpoint"),
                               ("j7", None)):
                producer.send_raw("diag-changelog", key, value, partition=p)
        producer.flush(5)
    service = DiagnosisService(config, bootstrap=broker.bootstrap, from_beginning=True).start()
    actions = Consumer(bus, ["actions"], group_id=None, bootstrap=broker.bootstrap)
    try:
        assert service.ready.wait(60), "the service never took its partitions"
        got = _xid_on_n002(bus, broker, service, actions)
        assert got, "no action within 30 s after a poisoned changelog"
        assert schema.decode("actions", got[0].value).nodes == ["n002"]
        # per partition: two markers and two checkpoints that do not read (the null one is a tombstone);
        # a job's checkpoint is decoded at its first record or between rounds, so the count comes in soon
        deadline = time.monotonic() + 10
        while service.unreadable_checkpoints < 4 * REPARTITION_PARTITIONS and time.monotonic() < deadline:
            time.sleep(0.05)
        assert service.unreadable_checkpoints == 4 * REPARTITION_PARTITIONS
        assert not target.exists(), "a pickle from the changelog was loaded"
    finally:
        actions.close()
        service.stop()

