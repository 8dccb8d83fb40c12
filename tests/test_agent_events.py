"""The event-driven agent (issue 27.1): a written line is read and sent when it is written.

No timing thresholds: ``tick_s`` is an hour, so a record that arrives at all arrived
because a file change woke the agent, not because a tick came. Input: recorded kernel
lines (tests/fixtures/kernel/families/input.log; sources in SOURCES.md there).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from faultlens import schema
from faultlens.collectors.agent import Agent
from faultlens.collectors.follow import FileFollower
from faultlens.collectors.kernel import KernelParser
from faultlens.collectors.kernel_follow import KmsgReader
from faultlens.config import AgentConfig, BusConfig, Config
from faultlens.stream.bus import Consumer, ensure_topics

FAMILIES = (Path(__file__).parent / "fixtures" / "kernel" / "families" / "input.log").read_text().splitlines()
XID_79 = FAMILIES[3]  # "NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus."
OOPS_BLOCK = FAMILIES[39:51]  # a page-fault oops with its dump lines (lines 40-51)
HOUR = 3600.0


def test_an_xid_line_is_a_whole_record_at_once_and_other_records_wait_for_their_next_line() -> None:
    """single_line kinds (kernel.toml: Xid, SXid) close on their own line; an oops head may be continued."""
    p = KernelParser("n1")
    assert [r for r in p.feed_many([XID_79]) if not isinstance(r, int)] == []  # held: the parser cannot know yet
    p.release()
    got = p.close_single_line()
    assert [r.xid for r in got] == [79] and p._pending is None
    q = KernelParser("n1")
    q.feed_many(OOPS_BLOCK[:1])
    q.release()
    assert q.close_single_line() == [] and q._pending is not None  # its dump lines may follow
    recs = [r for r in q.feed_many(OOPS_BLOCK[1:] + [XID_79]) if not isinstance(r, int)]
    assert len(recs) == 1 and recs[0].raw.count("\n") >= 5  # closed by the next record's prefix, dump included


def test_followers_offer_a_descriptor_to_block_on_and_poll_without_one(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("")
    watched = FileFollower(str(log))
    polled = FileFollower(str(log), watch=False)
    assert watched.fileno() is not None and polled.fileno() is None
    watched.poll()
    polled.poll()
    with open(log, "a") as f:
        f.write(XID_79 + "\n")
    assert watched.poll() == [XID_79] == polled.poll()
    recorded = tmp_path / "kmsg"
    recorded.write_text("")
    k = KmsgReader(str(recorded), from_end=False)
    assert k.fileno() is not None  # a recorded kmsg file is watched like any file
    for f in (watched, polled, k):
        f.close()


def _consume_kernel(bus: BusConfig, want: int, timeout_s: float) -> list[schema.KernelEvent]:
    out: list[schema.KernelEvent] = []
    deadline = time.monotonic() + timeout_s
    with Consumer(bus, ["kernel"], group_id=None) as consumer:
        while time.monotonic() < deadline and len(out) < want:
            out += [schema.decode("kernel", m.value) for m in consumer.poll(timeout_ms=300)]
    return out


@pytest.mark.broker
def test_a_fault_line_is_sent_when_written_not_at_the_next_tick(bus: BusConfig, tmp_path: Path) -> None:
    """tick_s is an hour and sends are spaced 2 s apart: the Xid line still goes out as soon as it is
    written (inotify wakes the loop, the Xid record is closed by its own line and sent without linger),
    and so does an oops block closed by the next record's prefix."""
    ensure_topics(bus)
    log = tmp_path / "kern.log"
    log.write_text("")
    config = Config(bus=bus, agent=AgentConfig(spool_dir=str(tmp_path / "spool"), health_interval_s=HOUR,
                                               tick_s=HOUR, min_send_interval_s=2.0))
    agent = Agent(config, bootstrap=bus.bootstrap_servers, node="n1", kernel_source=str(log), sources=("kernel",))
    stop = threading.Event()
    th = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    th.start()
    try:
        deadline = time.monotonic() + 30
        while agent._last_tick == 0.0 and time.monotonic() < deadline:  # the first tick (start-up) is done
            time.sleep(0.05)
        assert agent._last_tick > 0.0
        with open(log, "a") as f:
            f.write(XID_79 + "\n")
        first = _consume_kernel(bus, 1, 60)
        with open(log, "a") as f:
            f.write("\n".join([*OOPS_BLOCK, XID_79]) + "\n")
        more = _consume_kernel(bus, 3, 60)
    finally:
        stop.set()
        agent.wake()
        th.join(timeout=30)
    assert [r.xid for r in first] == [79]
    kinds = [r.kind for r in more]
    assert kinds.count("xid") == 2 and "oops" in kinds, kinds  # both Xids, and the oops before the second
