"""The runner end to end through the real embedded broker, with a stand-in scontrol."""

from __future__ import annotations

import threading
import time

import orjson
import pytest

from faultlens import schema
from faultlens.config import Config, RunnerConfig
from faultlens.diagnosis.runner.runner import ActionRunner
from faultlens.stream.bus import Consumer, Producer, ensure_topics
from faultlens.stream.signing import write_key
from tests.runner_standins import (
    TEST_KEY,
    env_with,
    keys_config,
    recorded,
    signing_keyring,
    write_standin,
)

pytestmark = pytest.mark.broker


def _action(id_: str, *, dry_run: bool = False, nodes=("n001",)) -> schema.Action:
    return schema.Action(id=id_, incident_id="inc-1", job="4242", ts=time.time(), type="evict_nodes",
                         nodes=list(nodes), confidence=0.99, dry_run=dry_run, reason="Xid 79",
                         suspects=[{"node": n, "score": 0.99, "reason": "Xid 79"} for n in nodes])


class RunnerThread:
    def __init__(self, runner: ActionRunner):
        self.runner, self.stop = runner, threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        try:
            self.runner.run(self.stop, max_seconds=90, poll_ms=200)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def __enter__(self) -> RunnerThread:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive() and self.error is None, self.error


def _collect(consumer: Consumer, want: int, timeout_s: float = 45) -> list:
    got = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        got += consumer.poll(200)
    return got


def test_actions_flow_from_the_topic_through_an_adapter_to_action_status(bus, tmp_path) -> None:
    ensure_topics(bus, names=("actions", "action-status", "deadletter"))
    rec = tmp_path / "calls.jsonl"
    write_standin(tmp_path / "bin", "kubectl", rec)
    ledger = tmp_path / "ledger.jsonl"
    cfg = Config(bus=bus, runner=RunnerConfig(adapter="kubernetes", execute=True, group_id="runner-a",
                                              state_path=str(ledger)), keys=keys_config(tmp_path))
    statuses = Consumer(bus, ["action-status", "deadletter"], group_id=None)
    try:
        with Producer(bus, keyring=signing_keyring()) as producer:
            producer.send(_action("act-1"))
            producer.send(_action("act-1"))  # the same action delivered twice
            producer.send(_action("act-2", dry_run=True, nodes=("n002",)))
            producer.send(_action("act-3", nodes=("n003; reboot",)))
            producer.send_raw("actions", "4242", b'{"specversion": "1.0", "broken": ')
            producer.flush()
            with RunnerThread(ActionRunner(cfg, env=env_with(tmp_path / "bin"))):
                got = _collect(statuses, 4)
        by_kind = {}
        for m in got:
            by_kind.setdefault(m.kind, []).append(m)
        results = {s.action_id: s for s in (schema.decode("action-status", m.value) for m in by_kind["action-status"])}
        assert set(results) == {"act-1", "act-2", "act-3"}
        assert results["act-1"].status == "done" and results["act-1"].commands == [
            ["kubectl", "cordon", "--", "n001"],
            ["kubectl", "taint", "nodes", "--overwrite", "--", "n001", RunnerConfig().k8s_taint],
        ]
        assert results["act-2"].status == "dry_run" and results["act-3"].status == "refused"
        assert all(m.key == "4242" for m in by_kind["action-status"])
        (dead,) = by_kind["deadletter"]
        assert schema.decode("deadletter", dead.value).reason == "malformed_json"
        assert recorded(rec) == results["act-1"].commands  # executed once, dry-run and refused ones not at all

        # A restarted runner with a new group re-reads the whole topic: nothing runs again.
        cfg_b = Config(bus=bus, runner=RunnerConfig(adapter="kubernetes", execute=True, group_id="runner-b",
                                                    state_path=str(ledger)), keys=keys_config(tmp_path))
        runner_b = ActionRunner(cfg_b, env=env_with(tmp_path / "bin"))
        with Producer(bus, keyring=signing_keyring()) as producer:
            producer.send(_action("act-4", nodes=("n004",)))
            producer.flush()
            with RunnerThread(runner_b):
                more = [schema.decode("action-status", m.value) for m in _collect(statuses, 1)
                        if m.kind == "action-status"]
                time.sleep(1.0)  # a duplicate status would arrive right behind act-4's
                more += [schema.decode("action-status", m.value) for m in statuses.poll(500)
                         if m.kind == "action-status"]
        assert [s.action_id for s in more] == ["act-4"] and more[0].status == "done"
        assert [c[3] for c in recorded(rec) if c[1] == "cordon"] == ["n001", "n004"]
        assert runner_b.metrics.actions.labels(type="evict_nodes", status="duplicate")._value.get() == 4  # act-1 twice, act-2, act-3
    finally:
        statuses.close()


def test_an_action_event_on_the_topic_is_the_cloudevent(bus) -> None:
    ensure_topics(bus, names=("actions",))
    with Producer(bus, keyring=signing_keyring()) as producer:
        producer.send(_action("act-9"))
        producer.flush()
    consumer = Consumer(bus, ["actions"], group_id=None)
    try:
        (m,) = _collect(consumer, 1)
    finally:
        consumer.close()
    event = orjson.loads(m.value)
    assert event["specversion"] == "1.0" and event["id"] == "act-9" and event["subject"] == "4242"


def test_the_runner_command_executes_and_serves_metrics(bus, tmp_path) -> None:
    import subprocess
    import sys
    import urllib.request

    from faultlens.stream.bus.embedded_broker import free_port

    ensure_topics(bus, names=("actions", "action-status", "deadletter"))
    rec = tmp_path / "calls.jsonl"
    write_standin(tmp_path / "bin", "kubectl", rec)
    with Producer(bus, keyring=signing_keyring()) as producer:
        producer.send(_action("act-cli", nodes=("gpu-17",)))
        producer.flush()
    port = free_port()
    statuses = Consumer(bus, ["action-status"], group_id=None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "faultlens.cli", "runner", "--adapter", "kubernetes", "--execute",
         # Given diagnosis' private file (it verifies too), the runner works but warns at start.
         "--set", f"keys.files={write_key(TEST_KEY, tmp_path / 'diagnosis-key.toml')}",
         "--bootstrap-servers", bus.bootstrap_servers, "--set", f"bus.topic_prefix={bus.topic_prefix}",
         "--metrics-port", str(port), "--duration-s", "60"],
        env=env_with(tmp_path / "bin"), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        got = _collect(statuses, 1)
        assert len(got) == 1, proc.stdout.read1().decode() if proc.poll() is not None else "no status"
        status = schema.decode("action-status", got[0].value)
        assert status.status == "done" and status.adapter == "kubernetes"
        assert recorded(rec)[0] == ["kubectl", "cordon", "--", "gpu-17"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        assert 'faultlens_actions_total{status="done",type="evict_nodes"} 1.0' in text
    finally:
        statuses.close()
        proc.terminate()  # SIGTERM: the runner stops its loop and exits 0
        assert proc.wait(timeout=30) == 0
    out = proc.stdout.read().decode()
    assert "runner holds a signing key (test-key)" in out and "give it the .pub file" in out, out[-2000:]
