"""The node agent killed -9 at random instants while it follows a step file: nothing lost.

The agent saves its followers' positions once every record of the lines read so far
is sent or spooled (collectors/agent.py), and its spool keeps a cursor of what was
delivered (collectors/spool.py). A restarted agent therefore starts after what its
predecessor shipped: every step line (one record, keyed job, rank, step) reaches the
lake. Delivery is at-least-once: a kill between the broker's acknowledgement of a
send and the position save that follows it makes the next agent send that batch
again (with the default 2 s send limiter that was ~90 records per kill on the shared
2-core machine; with no limiter, none). Under heavy load the next agent can be killed
in the same window before its own save, so a record may come once per such kill: the
bound is one send window (2 s of lines) per kill, never a resend from the start.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from faultlens.config import BusConfig
from faultlens.stream.bus import ensure_topics
from faultlens.stream.bus.embedded_broker import EmbeddedBroker
from faultlens.stream.catalog import open_lake
from faultlens.stream.processor import StreamProcessor
from tests.test_stream_processor import config_for

pytestmark = pytest.mark.broker
LINES = 3000


def _step_line(i: int) -> str:
    return json.dumps({"v": 1, "ts": 1_760_000_000.0 + i * 0.01, "job": "j1", "rank": i % 8, "node": "n1",
                       "step": i // 8, "duration_s": 1.0, "tokens": 4096}) + "\n"


def _distinct(lake: Path) -> int:
    if not (lake / "_manifest").exists():
        return 0
    db = open_lake(lake)
    try:
        return db.execute("SELECT count(DISTINCT (job, rank, step)) FROM steps").fetchone()[0]
    except Exception:  # noqa: BLE001 - no steps file yet
        return 0
    finally:
        db.close()


def _start_agent(bus: BusConfig, tmp_path: Path, log: Any) -> subprocess.Popen[bytes]:
    env = dict(os.environ, FAULTLENS_BOOTSTRAP=bus.bootstrap_servers, FAULTLENS_BUS_TOPIC_PREFIX=bus.topic_prefix,
               FAULTLENS_AGENT_MIN_SEND_INTERVAL_S="2.0")
    cmd = [sys.executable, "-m", "faultlens.cli", "agent", "--node", "n1", "--job", "j1", "--no-nvml",
           "--metrics-port", "0", "--kernel-log", str(tmp_path / "kernel.log"),
           "--steps-glob", str(tmp_path / "steps.jsonl"), "--spool-dir", str(tmp_path / "spool")]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


@pytest.mark.slow
def test_agent_kill_9_and_restart_loses_and_duplicates_no_record(tmp_path: Path) -> None:
    with EmbeddedBroker() as broker:  # its own: the session broker carries other tests' groups and topics
        _kill_and_count(BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix="agentkill", linger_ms=5), tmp_path)


def _kill_and_count(bus: BusConfig, tmp_path: Path) -> None:
    ensure_topics(bus)
    (tmp_path / "kernel.log").touch()
    steps = tmp_path / "steps.jsonl"
    steps.touch()
    rng = random.Random(7)

    def write() -> None:  # ~300 lines/s in small bursts, as a trainer's reporter writes them
        with open(steps, "a") as f:
            for i in range(LINES):
                f.write(_step_line(i))
                if i % 30 == 29:
                    f.flush()
                    time.sleep(0.1)

    with open(tmp_path / "agent.log", "ab") as log:
        agent = _start_agent(bus, tmp_path, log)
        time.sleep(3)  # started and following (from the end of the empty file)
        writer = threading.Thread(target=write)
        writer.start()
        kills = 0
        while writer.is_alive():
            time.sleep(rng.uniform(0.8, 2.0))
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(timeout=10)
            kills += 1
            agent = _start_agent(bus, tmp_path, log)
        writer.join()
        time.sleep(5)  # the last agent ships the tail
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 0

    proc = StreamProcessor(config_for(bus, tmp_path), flush_interval_s=0.3)
    reader = threading.Thread(target=proc.run, kwargs={"max_runtime_s": 150})
    reader.start()
    deadline = time.monotonic() + 120  # until every line is there (or the deadline: then it was lost)
    while time.monotonic() < deadline and _distinct(tmp_path / "lake") < LINES:
        time.sleep(1)
    time.sleep(2)  # a duplicate would come in the same batches
    proc.stop()
    reader.join(timeout=60)
    db = open_lake(tmp_path / "lake")
    rows, distinct = db.execute("SELECT count(*), count(DISTINCT (job, rank, step)) FROM steps").fetchone()
    most = db.execute("SELECT max(n) FROM (SELECT count(*) n FROM steps GROUP BY job, rank, step)").fetchone()[0]
    db.close()
    assert kills >= 4
    assert distinct == LINES, f"{kills} kills: {LINES - distinct} lost; " + (tmp_path / "agent.log").read_text()[-2000:]
    window = 2.0 * 300  # lines written in one 2 s send window (~300 lines/s)
    assert rows - distinct <= window * kills, f"{rows - distinct} duplicate rows after {kills} kills"
    assert most <= kills + 1, f"a record shipped {most} times after {kills} kills"
