"""Diagnosis outputs survive a broker that lost them (issue 37 item 4): the real embedded broker restarts
empty, the online service notices and sends its open incident and unsettled action again, the lake ends
with every action the runner handled, and the runner's ledger runs each action once."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from faultlens.config import BusConfig, Config, DiagnosisConfig, RunnerConfig
from faultlens.diagnosis.online import DiagnosisService
from faultlens.diagnosis.online.resend import OutputResend
from faultlens.diagnosis.runner.runner import ActionRunner
from faultlens.schema import Action, ActionStatus, GpuSample, Incident, JobTopology, KernelEvent
from faultlens.stream.bus import Consumer, Producer, ensure_topics
from faultlens.stream.bus.embedded_broker import EmbeddedBroker
from faultlens.stream.topology import Topology

pytestmark = pytest.mark.broker

XID_79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."


def _send(bus, records) -> None:
    with Producer(bus) as producer:
        for r in records:
            producer.send(r)
        producer.flush(10)


def _actions(bus, want: int, timeout_s: float = 40) -> list:
    """The actions topic's messages from its start, until ``want`` distinct ids (or the timeout)."""
    got: list = []
    with Consumer(bus, ["actions"], group_id=None, from_beginning=True) as consumer:
        deadline = time.monotonic() + timeout_s
        while len({_id(m.value) for m in got}) < want and time.monotonic() < deadline:
            got += consumer.poll(200)
    return got


def _id(value: bytes) -> str:
    from faultlens import schema

    return schema.decode("actions", value).id


def _keepalive(topo: Topology, n: int = 3) -> list:
    """GPU samples of the job's nodes: agents keep sending, so the service's rounds keep producing."""
    return [GpuSample(ts=time.time(), node=node, gpus=[]) for node in list(topo.nodes)[:n]]


@pytest.mark.slow
def test_outputs_lost_by_a_broker_restart_are_resent_and_run_once(tmp_path: Path) -> None:
    from faultlens.stream.processor import StreamProcessor
    from tests.test_stream_processor import config_for

    broker = EmbeddedBroker().start()
    service = None
    try:
        cfg = config_for(BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix="resend", linger_ms=5), tmp_path)
        bus = cfg.bus
        ensure_topics(bus)
        config = Config(bus=bus, diagnosis=DiagnosisConfig(group_id="resend-diag"))
        service = DiagnosisService(config, bootstrap=broker.bootstrap, from_beginning=True,
                                   checkpoint_interval_s=0.5).start()
        runner = ActionRunner(Config(bus=bus, runner=RunnerConfig(state_path=str(tmp_path / "ledger.jsonl"))))
        topo = Topology.packed(tp=8, pp=1, dp=4, gpus_per_node=8, job="j9")
        _send(bus, [JobTopology(ts=time.time(), job="j9",
                                **{k: v for k, v in topo.to_job_dict().items() if k != "job"})])
        deadline = time.monotonic() + 30
        while service.engine.job_of_node("n002") != "j9" and time.monotonic() < deadline:
            time.sleep(0.05)
        _send(bus, [KernelEvent(ts=time.time(), node="n002", kind="xid", xid=79, raw=XID_79)])
        first = _actions(bus, 1)
        assert first, "no action within 30 s"
        ran = [runner.handle(m.value) for m in first]
        assert sum(o.status is not None for o in ran) == 1
        lost_id = _id(first[0].value)

        broker.kill()  # memory only: every topic, the changelog and the groups are gone
        broker.start()
        ensure_topics(bus)
        deadline = time.monotonic() + 40
        while service.resend.losses == 0 and time.monotonic() < deadline:
            _send(bus, _keepalive(topo))  # the agents' samples keep flowing
            time.sleep(0.5)
        assert service.resend.losses >= 1, "the service did not notice the broker lost its outputs"
        _send(bus, [KernelEvent(ts=time.time(), node="n003", kind="xid", xid=79, raw=XID_79.replace("3b", "5e"))])
        again = _actions(bus, 2)
        ids = {_id(m.value) for m in again}
        assert lost_id in ids, "the action the broker lost was not sent again"
        assert len(ids) == 2, ids
        ran_again = [runner.handle(m.value) for m in again]
        executed = [o.status.action_id for o in ran_again if o.status is not None]
        assert executed == sorted(ids - {lost_id}), "the runner's ledger ran an action twice, or not at all"

        service.stop()
        proc = StreamProcessor(cfg, flush_interval_s=0.3)
        assert proc.run(exit_when_idle_s=3, max_runtime_s=60) is not None
        from faultlens.stream.catalog import open_lake

        db = open_lake(tmp_path / "lake")
        try:
            in_lake = {r[0] for r in db.execute("SELECT DISTINCT id FROM actions").fetchall()}
        finally:
            db.close()
        assert ids <= in_lake, f"handled actions missing from the lake: {ids - in_lake}"
    finally:
        if service is not None:
            service.stop()
        broker.stop()


def test_what_is_kept_for_a_resend_is_bounded_by_relevance() -> None:
    """Past the window: an open incident and an unsettled action stay, a closed incident and a settled action go."""
    r = OutputResend(retain_s=0.0)
    now = time.time()
    inc = dict(job="j", opened_ts=now, updated_ts=now, status="open", category="hardware", kind="gpu_lost", title="t")
    act = dict(incident_id="i1", job="j", ts=now, type="evict_nodes", nodes=["n1"], confidence=0.9, reason="x")
    for rec in (Incident(id="i1", **inc), Incident(id="i2", **inc), Action(id="a1", **act), Action(id="a2", **act)):
        r.sent(rec)
    r.status(ActionStatus(ts=now, action_id="a2", job="j", status="dry_run", adapter="dryrun", detail=""))
    kept = r.due({"i1"})
    assert sorted((type(k).KIND, k.id) for k in kept) == [("actions", "a1"), ("incidents", "i1")]


def test_a_consumer_that_found_its_offsets_went_back_is_a_loss_once() -> None:
    r = OutputResend()
    assert not r.lost(None, input_resets=0)
    assert r.lost(None, input_resets=3)  # the service's consumer read a recreated log from its start
    assert not r.lost(None, input_resets=3)  # the same loss: resent once
    r.suspect()  # the changelog could not be written
    assert r.lost(None)


def test_a_restored_jobs_open_incidents_are_kept_for_a_resend() -> None:
    from faultlens.diagnosis.incidents import OpenIncident

    r = OutputResend(retain_s=0.0)
    now = time.time()
    r.restored([OpenIncident(id="i9", job="j", kind="gpu_lost", node="n1", opened_ts=now, updated_ts=now, role="cause")])
    assert [(type(k).KIND, k.id, k.status) for k in r.due({"i9"})] == [("incidents", "i9", "open")]
    assert r.due(set()) == []  # closed since: past the window it is forgotten
