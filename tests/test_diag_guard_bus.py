"""The guard log on the real embedded broker: instances share the fleet count, a reset reaches them."""

from __future__ import annotations

import json
import threading

import pytest

from faultlens.cli import main
from faultlens.config import GuardConfig
from faultlens.diagnosis.guardlog import KafkaGuardLog

pytestmark = pytest.mark.broker
T0 = 1_700_000_000.0


def test_two_instances_share_the_fleet_cap_and_a_reset_reaches_both(bus, tmp_path, capsys) -> None:
    cfg = GuardConfig(max_evictions_fleet_per_hour=3, storm_nodes=10_000)
    a = KafkaGuardLog(cfg, bus, backup_path=str(tmp_path / "a.jsonl"))
    b = KafkaGuardLog(cfg, bus)
    try:
        # claims from both instances at once (threads): the broker orders them, both fold one order
        verdicts: dict[str, bool] = {}

        def claims(log: KafkaGuardLog, name: str) -> None:  # one instance's thread: its claims one by one
            for k in range(4):
                verdicts[f"{name}{k}"] = log.claim(f"{name}{k}", job=f"job{k}", nodes=[f"{name}-node{k}"],
                                                   ts=T0 + k, job_nodes=8).granted

        threads = [threading.Thread(target=claims, args=(log, name)) for log, name in ((a, "a"), (b, "b"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(verdicts) == 8 and sum(verdicts.values()) == 3, verdicts  # not 3 per instance
        a.read_to_end()  # refresh() does not wait: under load the last claim may still be on its way
        b.read_to_end()
        assert a.book.verdicts == b.book.verdicts
        assert a.book.fleet_breaker is not None and b.book.fleet_breaker is not None
        # a person's reset, through the command, on the bus
        args = ["--bootstrap-servers", bus.bootstrap_servers, "--set", f"bus.topic_prefix={bus.topic_prefix}"]
        assert main(["guard", "reset", "--fleet", "--reason", "fabric checked", "--by", "oncall", *args]) == 0
        assert main(["guard", "status", "--json", *args]) == 0
        status = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert status["fleet_breaker"] is None and status["resets"][-1]["by"] == "oncall"
        for log in (a, b):
            log.read_to_end()
            assert log.book.fleet_breaker is None
        assert b.claim("after", job="jz", nodes=["z1"], ts=T0 + 100, job_nodes=8).granted
        # the backup file holds the same events: a broker that lost the topic gets the breakers back from it
        assert (tmp_path / "a.jsonl").read_text().count('"type":"reset"') == 1
    finally:
        a.close()
        b.close()


def test_a_refresher_thread_folds_a_reset_while_the_service_thread_claims(bus) -> None:
    """Online diagnosis reads the guard log off its own thread (start_refresher): a person's reset and
    the other instances' claims arrive without the service thread polling, and its claims still work."""
    import time

    cfg = GuardConfig(max_evictions_fleet_per_hour=1, storm_nodes=10_000)
    a, b = KafkaGuardLog(cfg, bus), KafkaGuardLog(cfg, bus)
    try:
        b.start_refresher(0.05)
        assert a.claim("a0", job="j0", nodes=["n0"], ts=T0, job_nodes=8).granted
        assert not a.claim("a1", job="j1", nodes=["n1"], ts=T0 + 1, job_nodes=8).granted  # the fleet breaker
        deadline = time.monotonic() + 10
        while b.book.fleet_breaker is None and time.monotonic() < deadline:
            b.refresh()  # what the service's tick calls: nothing while the refresher runs
            time.sleep(0.02)
        assert b.book.fleet_breaker is not None and set(b.book.verdicts) == {"a0", "a1"}
        a.reset("fleet", by="oncall", reason="checked")
        deadline = time.monotonic() + 10
        while b.book.fleet_breaker is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert b.book.fleet_breaker is None
        assert b.claim("b0", job="j2", nodes=["n2"], ts=T0 + 2, job_nodes=8).granted  # claims alongside the thread
    finally:
        a.close()
        b.close()


def test_an_empty_topic_gets_the_open_breakers_back_from_the_backup(bus, tmp_path) -> None:
    from faultlens.diagnosis.guardlog import LocalGuardLog

    path = tmp_path / "backup.jsonl"
    local = LocalGuardLog(GuardConfig(max_evictions_fleet_per_hour=1, storm_nodes=10_000), path)
    local.claim("c1", job="j", nodes=["n1"], ts=T0, job_nodes=8)
    local.claim("c2", job="k", nodes=["n2"], ts=T0 + 1, job_nodes=8)
    assert local.book.fleet_breaker is not None
    # a fresh topic (the memory-only broker restarted): the instance re-opens the breaker on it
    log = KafkaGuardLog(GuardConfig(), bus, backup_path=str(path))
    try:
        other = KafkaGuardLog(GuardConfig(), bus)
        try:
            assert other.book.fleet_breaker is not None and "fleet cap" in other.book.fleet_breaker["reason"]
            assert not other.claim("c3", job="m", nodes=["n3"], ts=T0 + 2, job_nodes=8).granted
        finally:
            other.close()
    finally:
        log.close()


def test_online_diagnosis_hears_the_runner_refuse(bus) -> None:
    """An action the runner answers `refused` on action-status: its incident goes out open, with the reason."""
    import time

    from faultlens import schema
    from faultlens.config import Config, DiagnosisConfig
    from faultlens.diagnosis.online import DiagnosisService
    from faultlens.schema import ActionStatus, JobTopology, KernelEvent
    from faultlens.stream.bus import Consumer, Producer, ensure_topics
    from faultlens.stream.topology import Topology

    topo = Topology.packed(tp=8, pp=1, dp=4, gpus_per_node=8, job="jr", node_fmt="jr-n{:02d}")
    ensure_topics(bus)
    with Producer(bus) as p:
        p.send(JobTopology(ts=T0 - 10, job="jr", **{k: v for k, v in topo.to_job_dict().items() if k != "job"}))
        p.send(KernelEvent(ts=T0, node="jr-n02", kind="xid", xid=79, gpu=3,
                           raw="NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."))
        p.flush(10)
    service = DiagnosisService(Config(bus=bus, diagnosis=DiagnosisConfig(group_id=f"{bus.topic_prefix}-d", max_evidence_age_s=0)),
                               from_beginning=True, tick_interval_s=0.2).start()
    try:
        with Consumer(bus, ["actions", "incidents"], group_id=None) as c:
            deadline, action, refused = time.monotonic() + 60, None, None
            while time.monotonic() < deadline and refused is None:
                for m in c.poll(200):
                    rec = schema.decode(m.kind, m.value)
                    if m.kind == "actions" and action is None:
                        action = rec
                        with Producer(bus) as p:
                            p.send(ActionStatus(ts=time.time(), action_id=rec.id, job="jr", adapter="slurm",
                                                status="refused", detail="scontrol: not a Slurm job id"))
                            p.flush(10)
                    elif m.kind == "incidents" and rec.suppressed_counts.get("runner_refused"):
                        refused = rec
    finally:
        service.stop(timeout_s=20)
    assert action is not None and action.type == "evict_nodes"
    assert refused is not None and refused.id == action.incident_id
    assert refused.status == "open" and "not a Slurm job id" in refused.summary


def test_a_broker_that_lost_the_guard_log_gets_the_open_breaker_back() -> None:
    """Tansu is memory only: after a restart the topic is empty; the instance's breaker must not vanish."""
    import time

    from faultlens.config import BusConfig
    from faultlens.stream.bus.embedded_broker import EmbeddedBroker

    broker = EmbeddedBroker().start()
    bus = BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix="guardloss", linger_ms=0)
    cfg = GuardConfig(max_evictions_fleet_per_hour=1, storm_nodes=10_000)
    try:
        log = KafkaGuardLog(cfg, bus, claim_timeout_s=5.0)
        try:
            assert log.claim("c1", job="j", nodes=["n1"], ts=T0, job_nodes=8).granted
            assert not log.claim("c2", job="k", nodes=["n2"], ts=T0 + 1, job_nodes=8).granted
            broker.kill()
            time.sleep(0.5)
            broker.start()  # same port, empty
            verdict = log.claim("c3", job="m", nodes=["n3"], ts=T0 + 2, job_nodes=8)
            assert (verdict.granted, verdict.reason) == (False, "breaker")
            assert log.recoveries == 1
            # an instance started after the loss reads the breaker (once the re-written trip has landed: under
            # load the broker can take a few seconds to make it readable; CI at load ~4 read it too soon)
            deadline, seen = time.monotonic() + 20.0, False
            while not seen and time.monotonic() < deadline:
                fresh = KafkaGuardLog(cfg, bus)
                try:
                    seen = fresh.book.fleet_breaker is not None
                finally:
                    fresh.close()
                time.sleep(0 if seen else 0.5)
            assert seen, "the re-opened breaker never reached the new log"
        finally:
            log.close()
    finally:
        broker.stop()
