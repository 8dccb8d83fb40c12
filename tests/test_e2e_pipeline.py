"""End to end: the demo's pipeline, headless, on a short fault sequence.

Real processes (``faultlens stream``, ``diagnose``, ``runner`` and ``simulate live``
with one real agent per virtual node) talk through the embedded broker; the test
asserts that exactly the expected actions reach the actions topic and the lake.
"""

from __future__ import annotations

import http.server
import socket
import threading
import time
import urllib.request
from pathlib import Path

import orjson
import pytest

from faultlens.commands.demo import service_env, start_pipeline
from faultlens.config import BusConfig
from faultlens.stream.bus import Consumer, ensure_topics
from faultlens.stream.bus.embedded_broker import EmbeddedBroker
from faultlens.supervise import Supervisor

# (fault kind, expected action type or None, culprit node for evictions). The live
# command runs one job per fault on machines of its own (9 nodes: 4 jobs of 2, one
# spare; job i on n<i>01, n<i>02) and places the i-th fault on the job's machine
# (i*5+3) mod 2 (n102, n201, n302, n401). A hang evicts the demarcated parallel group,
# which holds the culprit.
NODES = 9
SEQUENCE = [
    ("gpu_lost", "evict_nodes", "n102"),
    ("user_exception", "rollback_code", None),
    ("ib_flap_transient", None, None),
    ("hang_stuck_rank", "evict_nodes", "n401"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Receiver(http.server.BaseHTTPRequestHandler):
    """An Alertmanager-webhook receiver that keeps what it was sent."""

    posts: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        _Receiver.posts.append(orjson.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


@pytest.mark.slow
def test_fault_sequence_yields_exactly_the_expected_actions(tmp_path: Path) -> None:
    receiver = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    stream_port, diag_port = _free_port(), _free_port()
    with EmbeddedBroker() as broker:
        bus = BusConfig(bootstrap_servers=broker.bootstrap)
        ensure_topics(bus)
        # 2-node jobs: let an eviction take half of one (the default 25% blast radius
        # would rightly turn a 1-of-2-machine eviction into a notify).
        sup = Supervisor(tmp_path, {**service_env(tmp_path, broker.bootstrap),
                                    "FAULTLENS_GUARD_MAX_EVICTED_FRACTION": "0.5",
                                    "FAULTLENS_LAKE_METRICS_PORT": str(stream_port),
                                    "FAULTLENS_DIAGNOSIS_METRICS_PORT": str(diag_port),
                                    "FAULTLENS_DIAGNOSIS_WEBHOOK_URL":
                                        f"http://127.0.0.1:{receiver.server_address[1]}/alerts"})
        consumer = Consumer(bus, ["actions", "action-status"], group_id=None)
        actions: dict[str, dict] = {}
        statuses: dict[str, str] = {}
        try:
            start_pipeline(sup, nodes=NODES, speed=25.0, segment=420.0, workdir=tmp_path,
                           faults=[k for k, _, _ in SEQUENCE])
            cluster = sup.children[-1]
            deadline = time.monotonic() + 180
            quiet_until = None
            while time.monotonic() < deadline:
                for m in consumer.poll(500):
                    body = orjson.loads(m.value)
                    if m.kind == "actions":
                        actions[body["data"]["id"]] = body["data"]
                    else:
                        statuses[body["action_id"]] = body["status"]
                crashed = [c.name for c in sup.check() if c.name != "cluster"]
                assert not crashed, f"{crashed} exited: {sup.tail(crashed[0])}"
                if not cluster.alive():
                    assert cluster.proc.returncode == 0, sup.tail("cluster")
                    quiet_until = quiet_until or time.monotonic() + 10
                    if time.monotonic() > quiet_until and set(statuses) >= set(actions):
                        break
            stream_metrics, diag_metrics = _scrape(stream_port), _scrape(diag_port)
        finally:
            consumer.close()
            sup.stop()

    by_job = {a["job"]: a for a in actions.values()}
    hang_job = f"llm-pretrain-{len(SEQUENCE)}"
    hang = [a for a in actions.values() if a["job"] == hang_job]
    assert len(hang) == 1 and hang[0]["type"] == "evict_nodes" and "n401" in hang[0]["nodes"], [
        (a["type"], a["nodes"], a["reason"]) for a in hang]
    assert hang[0]["plan"]["outliers"], "the eviction names the outlier ranks it demarcated"
    got = sorted((a["job"], a["type"], tuple(a["nodes"])) for a in actions.values() if a["job"] != hang_job)
    reasons = [(a["job"], a["type"], a["reason"][:160]) for a in actions.values()]
    want = sorted((f"llm-pretrain-{i + 1}", t, (n,) if n else ())
                  for i, (k, t, n) in enumerate(SEQUENCE) if t and k != "hang_stuck_rank")
    assert got == want, f"actions {got}, expected {want}; reasons {reasons}"
    assert "llm-pretrain-3" not in by_job  # a single flap is tolerated
    assert all(a["dry_run"] for a in actions.values())
    assert statuses and set(statuses) == set(actions) and set(statuses.values()) == {"dry_run"}

    from faultlens.stream.catalog import open_lake

    con = open_lake(tmp_path / "lake")
    lake_actions = sorted(
        (job, typ, tuple(orjson.loads(nodes))) for job, typ, nodes in con.execute("select job, type, nodes from actions").fetchall()
    )
    assert lake_actions == sorted([*want, (hang_job, "evict_nodes", tuple(hang[0]["nodes"]))])
    # Operations: /metrics on the processor and diagnosis, incidents on the webhook.
    assert 'faultlens_lake_rows_written_total{table="gpu"}' in stream_metrics
    assert 'faultlens_actions_total{status="emitted",type="rollback_code"} 1.0' in diag_metrics
    assert "faultlens_incidents_open{" in diag_metrics
    receiver.shutdown()
    alerts = [a for post in _Receiver.posts for a in post["alerts"]]
    assert any(a["labels"].get("node") == "n102" for a in alerts), alerts[:3]
    # every action names machines of its own job only (jobs run on disjoint machines)
    for a in actions.values():
        job_rack = a["job"].rsplit("-", 1)[1]
        assert all(n.startswith(f"n{job_rack}") for n in a["nodes"]), (a["job"], a["nodes"])
    n_incidents = con.execute("select count(distinct id) from incidents").fetchone()[0]
    assert n_incidents >= 2
    assert con.execute("select count(*) from gpu").fetchone()[0] > 0
