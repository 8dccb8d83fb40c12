"""Nothing lost, nothing twice when the broker dies (issue 24.9): agent resend + lake de-duplication.

The agent stamps each record with (node, epoch, seq) and sends again what a broker lost;
the stream processor keeps each natural key once, across its own kill -9 (stream/dedupe.py).
Input: real Xid lines (tests/fixtures/kernel/families/input.log, sources in SOURCES.md there).
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest

from faultlens import schema
from faultlens.collectors.agent import Agent
from faultlens.config import AgentConfig, BusConfig, Config, LakeConfig
from faultlens.decode import CONTENT_TYPE_HEADER, content_type_of, encode_wire
from faultlens.stream.bus import Producer, ensure_topics
from faultlens.stream.bus.embedded_broker import EmbeddedBroker, free_port
from faultlens.stream.catalog import open_lake
from faultlens.stream.dedupe import SEQ_HEADER, Mark, SeqLedger, compact_seq_files, parse_seq
from faultlens.stream.processor import StreamProcessor
from tests.test_stream_processor import kill_processor_repeatedly

FIXTURE = Path(__file__).parent / "fixtures" / "kernel" / "families" / "input.log"
JOB_FILE = Path(__file__).parent / "fixtures" / "jobs" / "job.json"  # sources: fixtures/jobs/SOURCES.md
XID_LINES = [ln for ln in FIXTURE.read_text().splitlines() if "NVRM: Xid" in ln]
T0 = 1_760_000_000.0


def test_a_mark_takes_each_seq_once_in_any_order() -> None:
    ledger = SeqLedger()
    key = ("n1", 1, "kernel")
    order = [1, 2, 5, 3, 5, 4, 2, 7, 6, 1]
    taken = [s for s in order if ledger.take(key, s)]
    assert taken == [1, 2, 5, 3, 4, 7, 6]
    assert ledger.marks[key].to_list() == [7]
    assert not ledger.take(("n1", 1, "kernel"), 3) and ledger.take(("n1", 2, "kernel"), 3)  # a new epoch starts over
    merged = Mark(3, {6})
    merged.merge(Mark(4, {9}))
    assert merged.to_list() == [4, 6, 9] and merged.has(9) and not merged.has(5)


def test_seq_files_fold_into_one_and_forget_a_restarted_agents_old_epochs(tmp_path: Path) -> None:
    """Issue 37.1: one _seq file per commit, folded each retention round; what is kept reads the same."""
    base_ns = time.time_ns() - 3 * 86_400 * 10**9
    ids = []
    for day in range(3):  # an agent restarted every day: epochs 1, 2, 3 of n1; n2 never restarted
        for i in range(5):
            commit_id = f"{base_ns + (day * 86_400 + i * 60) * 10**9:x}{'ab' * 4}"
            ledger = SeqLedger()
            for n in range(1, 4):
                ledger.take(("n1", day + 1, "kernel"), i * 3 + n)
                ledger.take(("n2", 1, "kernel"), day * 15 + i * 3 + n)
            ledger.write(tmp_path, commit_id, list(ledger.marks), {"faultlens.kernel": "t1"})
            ids.append(commit_id)
    crashed = f"{base_ns + 10**9:x}{'cd' * 4}"  # a file whose commit never reached the manifest
    SeqLedger().write(tmp_path, crashed, [], {"faultlens.kernel": "t0"})
    in_flight = f"{time.time_ns() + 10**9:x}{'ef' * 4}"  # newer than every committed one: left alone
    SeqLedger().write(tmp_path, in_flight, [], {"faultlens.kernel": "t2"})
    committed = set(ids[:-1])  # the last commit's manifest lost too
    before = SeqLedger.load(tmp_path, committed)
    report = compact_seq_files(tmp_path, committed, now=time.time(), keep_s=2.5 * 86_400)
    files = sorted(p.name for p in (tmp_path / "_seq").glob("s-*.json"))
    assert files == sorted([f"s-{ids[-2]}.json", f"s-{ids[-1]}.json", f"s-{in_flight}.json"])
    assert report.files_in == 14 and report.keys_dropped == 1  # n1's first epoch: 3 days old, not its newest
    after = SeqLedger.load(tmp_path, committed)
    assert set(after.marks) == set(before.marks) - {("n1", 1, "kernel")}
    assert all(after.marks[k].to_list() == before.marks[k].to_list() for k in after.marks)
    assert after.topic_ids == {"faultlens.kernel": "t1"}
    again = compact_seq_files(tmp_path, committed, now=time.time(), keep_s=2.5 * 86_400)  # idempotent
    assert again.keys_dropped == 0 and SeqLedger.load(tmp_path, committed).marks == after.marks


def test_seq_header_parses_and_bad_stamps_are_no_stamps() -> None:
    assert parse_seq([(CONTENT_TYPE_HEADER, b"x"), (SEQ_HEADER, b"17:42:gpu-node:7")]) == ("gpu-node:7", 17, 42)
    assert parse_seq([(SEQ_HEADER, b"nonsense")]) is None
    assert parse_seq(None) is None


def _kernel_records(n: int) -> list[schema.KernelEvent]:
    return [schema.KernelEvent(ts=T0 + i, node=f"n{i % 3}", kind="xid", raw=XID_LINES[i % len(XID_LINES)], xid=79)
            for i in range(n)]


def _send_stamped(bus: BusConfig, records: list[schema.KernelEvent], seqs: list[int]) -> None:
    with Producer(bus) as p:
        for rec, seq in zip(records, seqs, strict=True):
            value = encode_wire(rec)
            p.send_raw("kernel", rec.node, value, headers=[(CONTENT_TYPE_HEADER, content_type_of(value).encode()),
                                                           (SEQ_HEADER, f"5:{seq}:{rec.node}".encode())])
        p.flush()


def _lake_ts(lake: Path) -> list[float]:
    db = open_lake(lake)
    try:
        return [r[0] for r in db.execute("SELECT ts FROM kernel").fetchall()]
    finally:
        db.close()


@pytest.mark.broker
@pytest.mark.slow
def test_resent_records_land_once_across_kill_9_of_the_processor(bus: BusConfig, tmp_path: Path) -> None:
    """Every record is sent, then parts of it again (an agent's resends), while the processor is killed -9
    at random instants: the lake holds each natural key exactly once."""
    ensure_topics(bus)
    rng = random.Random(249)
    records = _kernel_records(1500)
    per_node: dict[str, int] = {}
    seqs = []
    for r in records:
        per_node[r.node] = per_node.get(r.node, 0) + 1
        seqs.append(per_node[r.node])

    def produce() -> None:
        for i in range(0, len(records), 100):
            _send_stamped(bus, records[i:i + 100], seqs[i:i + 100])
            j = rng.randrange(0, i + 100)  # a resend of something already sent (committed or not)
            _send_stamped(bus, records[j:j + 60], seqs[j:j + 60])
            time.sleep(0.3)

    producer = threading.Thread(target=produce)
    producer.start()
    log = tmp_path / "processor.log"
    kills = kill_processor_repeatedly(bus, tmp_path, log, rng, 6, (1.5, 3.5))
    producer.join(timeout=60)
    # The last run drains under a group of its own: members killed -9 hold their partitions in the old
    # group until its session times out (offsets live in the lake's manifest, not in the group).
    final = StreamProcessor(Config(bus=bus, lake=LakeConfig(path=str(tmp_path / "lake"),
                                                            catalog_path=str(tmp_path / "catalog.duckdb"))),
                            group_id=f"{bus.topic_prefix}-drain", flush_interval_s=0.2)
    final.run(exit_when_idle_s=3, max_runtime_s=120)
    got = _lake_ts(tmp_path / "lake")
    assert kills >= 4
    missing = sorted(int(r.ts - T0) for r in records if r.ts not in set(got))
    assert len(got) == len(records) and sorted(got) == [r.ts for r in records], (missing[:20], missing[-5:], len(missing))


@pytest.mark.broker
@pytest.mark.slow
def test_an_agents_records_survive_a_broker_that_restarts_empty(tmp_path: Path) -> None:
    """Agent -> memory-only broker -> processor -> lake; the broker is killed and restarted empty while
    Xid lines are written: every line is in the lake once (before: what the broker held was gone), and
    the job's topology is published again (the jobs source), so the new broker knows the job."""
    port = free_port()
    broker = EmbeddedBroker(port=port).start()
    log = tmp_path / "kern.log"
    log.write_text("")
    bus = BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix="dedupe", linger_ms=5)
    config = Config(bus=bus, agent=AgentConfig(spool_dir=str(tmp_path / "spool"), health_interval_s=3600,
                                               min_send_interval_s=0.0),
                    lake=LakeConfig(path=str(tmp_path / "lake"), catalog_path=str(tmp_path / "catalog.duckdb"),
                                    group_id="dedupe-stream", flush_interval_s=0.5))
    ensure_topics(bus)
    agent = Agent(config, node="n1", kernel_source=str(log), sources=("kernel", "jobs"), from_end=False,
                  options={"jobs": {"path": str(JOB_FILE)}})
    stop = threading.Event()
    agent_thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    # The processor starts after the broker's restart: what the broker held at its death was in no lake.
    proc = StreamProcessor(config, flush_interval_s=0.5)
    proc_thread = threading.Thread(target=proc.run, kwargs={"max_runtime_s": 180}, daemon=True)
    written = 0

    def write(n: int) -> None:
        nonlocal written
        with open(log, "a") as f:
            for _ in range(n):
                line = XID_LINES[written % len(XID_LINES)]
                f.write(f"[{1000 + written}.000000] {line[line.index('NVRM: Xid'):]}\n")
                written += 1

    try:
        agent_thread.start()
        for _ in range(10):
            write(5)
            time.sleep(0.2)
        deadline = time.monotonic() + 30
        while agent.delivery.sent < written and time.monotonic() < deadline:
            time.sleep(0.1)
        assert agent.delivery.sent >= written  # all acknowledged by the broker that now dies
        broker.kill()
        time.sleep(0.5)
        broker.start()
        ensure_topics(bus)
        proc_thread.start()
        for _ in range(10):
            write(5)
            time.sleep(0.3)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and (not (tmp_path / "lake" / "_manifest").exists()
                                               or len(set(_lake_ts(tmp_path / "lake"))) < written):
            time.sleep(0.5)
    finally:
        stop.set()
        agent.wake()
        agent_thread.join(timeout=30)
        proc.stop()
        proc_thread.join(timeout=60)
        broker.stop()
    got = _lake_ts(tmp_path / "lake")
    db = open_lake(tmp_path / "lake")
    try:
        jobs = db.execute("SELECT job, count(*) FROM jobs GROUP BY job").fetchall()
    finally:
        db.close()
    assert [j for j, _ in jobs] == ["llm-pretrain-3"] and agent._sources[1].published >= 2  # start, after the loss
    assert len(set(got)) == written, f"{written - len(set(got))} lines lost"
    assert len(got) == written, f"{len(got) - written} rows twice"
    assert agent.delivery.resends >= 1, "the agent never saw that the broker lost its log"
