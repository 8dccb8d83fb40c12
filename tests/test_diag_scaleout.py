"""Online diagnosis partitioned by job, through the real embedded broker.

* two instances on one input decide the same incidents and actions as one;
* state survives a restart: an IB link that went down once before the restart and
  once after is evicted (the repeat counter came back from the changelog), and a
  repeated Xid after the restart joins the same open incident without a second action.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from faultlens import schema
from faultlens.config import Config, DiagnosisConfig
from faultlens.diagnosis.online import DiagnosisService
from faultlens.stream.bus import Consumer, Producer, ensure_topics
from tests import fleetgen

pytestmark = pytest.mark.broker


def _config(bus: Any, group: str) -> Config:
    return Config(bus=bus, diagnosis=DiagnosisConfig(group_id=group, max_evidence_age_s=0))  # fleetgen: fixed T0


def _produce(bus: Any, records: list[Any]) -> None:
    with Producer(bus) as producer:
        for r in records:
            producer.send(r)
        producer.flush(10)


def _read_all(bus: Any, kind: str, settle_s: float = 1.0) -> list[Any]:
    out: list[Any] = []
    with Consumer(bus, [kind], group_id=None) as c:
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < settle_s:
            got = c.poll(200)
            if got:
                quiet_since = time.monotonic()
                out.extend(schema.decode(kind, m.value) for m in got)
    return out


def _wait_actions(bus: Any, want: int, timeout_s: float) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    actions: list[Any] = []
    with Consumer(bus, ["actions"], group_id=None) as c:
        while time.monotonic() < deadline and len({a.id for a in actions}) < want:
            actions.extend(schema.decode("actions", m.value) for m in c.poll(200))
    return actions


def _run(bus: Any, fleet: fleetgen.Fleet, instances: int, *, want: int) -> tuple[dict[str, Any], list[Any]]:
    ensure_topics(bus)
    _produce(bus, fleet.topologies)
    _produce(bus, fleet.records)
    config = _config(bus, f"{bus.topic_prefix}-diag")
    services = [DiagnosisService(config, from_beginning=True, tick_interval_s=0.2).start() for _ in range(instances)]
    try:
        _wait_actions(bus, want, timeout_s=90)
        time.sleep(2.0)  # let late incident updates out
    finally:
        for s in services:
            s.stop(timeout_s=20)
    incidents: dict[str, Any] = {}
    for inc in _read_all(bus, "incidents"):
        incidents[inc.id] = inc  # the last update of each incident
    return incidents, _read_all(bus, "actions")


def _summary(incidents: dict[str, Any], actions: list[Any]) -> tuple[Any, Any]:
    inc = {i.id: (i.job, i.kind, tuple(s["node"] for s in i.suspects[:1])) for i in incidents.values()}
    act = {(a.id, a.incident_id, a.job, a.type, tuple(a.nodes)) for a in actions}
    return inc, act


def test_two_instances_decide_what_one_does(broker) -> None:
    from faultlens.config import BusConfig

    fleet = fleetgen.fleet(jobs=6, nodes_per_job=4, unjobbed=2, duration_s=100, gpu_interval_s=5, faulty_jobs=5)
    want = len(fleet.faults)
    one = _run(BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix="so1", linger_ms=5), fleet, 1, want=want)
    two = _run(BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix="so2", linger_ms=5), fleet, 2, want=want)
    inc1, act1 = _summary(*one)
    inc2, act2 = _summary(*two)
    # Every fault got its eviction, on its node, in its job (the unjobbed node under "unknown").
    evicted = {(a[2], a[4]) for a in act1 if a[3] == "evict_nodes"}
    assert evicted == {(f["job"], (f["node"],)) for f in fleet.faults}
    assert act2 == act1
    assert inc2 == inc1
    assert len({a[0] for a in act1}) == len(act1), "an action id was emitted with different content"


def test_state_survives_a_restart(bus, broker) -> None:
    ensure_topics(bus)
    fleet = fleetgen.fleet(jobs=2, nodes_per_job=4, unjobbed=0, duration_s=40, gpu_interval_s=5, faulty_jobs=0)
    ib_node, xid_node = "j0000n02", "j0001n03"
    t0 = fleetgen.T0
    _produce(bus, [*fleet.topologies])
    _produce(bus, [*fleet.records, fleetgen.ib_down(ib_node, t0 + 30), fleetgen.xid_line(xid_node, 79, t0 + 31)])
    config = _config(bus, f"{bus.topic_prefix}-diag")
    first = DiagnosisService(config, from_beginning=True, tick_interval_s=0.2).start()
    try:
        before = _wait_actions(bus, 1, timeout_s=60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(i.kind == "ib_link" for i in first.open_incidents()):
            time.sleep(0.1)
        open_before = {i.id for i in first.open_incidents()}
    finally:
        first.stop(timeout_s=20)
    assert [(a.type, a.nodes) for a in before] == [("evict_nodes", [xid_node])]
    assert any(i.kind == "ib_link" for i in first.open_incidents()), "the first IB alert opened no incident"
    # After the restart: the same Xid again (joins the open incident, no new action) and the IB link
    # down a second time within five minutes (the repeat that evicts).
    _produce(bus, [fleetgen.ib_down(ib_node, t0 + 60), fleetgen.xid_line(xid_node, 79, t0 + 61)])
    second = DiagnosisService(config, tick_interval_s=0.2).start()
    try:
        actions = _wait_actions(bus, 2, timeout_s=60)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not open_before <= {i.id for i in second.open_incidents()}:
            time.sleep(0.1)
        open_after = {i.id for i in second.open_incidents()}
        restored = sum(r["keys"] for r in second.restores)
    finally:
        second.stop(timeout_s=20)
    assert restored >= 2, "the new instance restored no job state"
    by_type = sorted((a.type, tuple(a.nodes)) for a in {a.id: a for a in actions}.values())
    assert by_type == [("evict_nodes", (ib_node,)), ("evict_nodes", (xid_node,))]
    assert open_before <= open_after, "open incidents were forgotten across the restart"


def test_the_agents_messagepack_samples_pass_the_repartition(bus, broker) -> None:
    """The agent sends gpu samples as MessagePack (content-type header): the repartition
    forwards the bytes and the header, and the job's engine reads them."""
    from faultlens.decode import encode_wire

    ensure_topics(bus)
    fleet = fleetgen.fleet(jobs=1, nodes_per_job=2, unjobbed=0, duration_s=15, gpu_interval_s=5, faulty_jobs=0)
    _produce(bus, fleet.topologies)
    with Producer(bus) as producer:
        for r in fleet.records:
            if type(r).KIND == "gpu":
                producer.send(r, value=encode_wire(r))
        producer.flush(10)
    service = DiagnosisService(_config(bus, f"{bus.topic_prefix}-diag"), from_beginning=True).start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and service.applied < 1 + 2 * 3:
            time.sleep(0.1)
        engine = service.states["job0000"].engine
        assert service.decode_errors == 0 and service.applied == 1 + 2 * 3  # the topology and 6 samples
        assert {("j0000n01", 0), ("j0000n02", 7)} <= set(engine.counters._gpus)
    finally:
        service.stop(timeout_s=20)
