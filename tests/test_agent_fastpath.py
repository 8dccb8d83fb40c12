"""The ordinary-line fast path (feed_many) gives the same records as feeding every line.

Differential tests: recorded real/project lines, ordinary noise, continuation lines,
blank lines and relative timestamps, shuffled in runs with a fixed seed, fed line by
line (``feed``) and in random-sized batches (``feed_many``); every line must land in
the same record (or be ordinary in both), with the same fields and timestamp.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import msgspec
import pytest

from faultlens.collectors.kernel import KernelParser
from faultlens.collectors.nccl import NcclParser
from faultlens.collectors.patterns import BAD_INPUT_RE, hot_regex
from faultlens.diagnosis.classify import catalogs, classify, is_ordinary

FIXTURES = Path(__file__).resolve().parent / "fixtures"
KERNEL_NOISE = [
    "[ {t:.6f}] audit: type=1400 audit(1700000000.123:2): apparmor=\"STATUS\" operation=\"profile_replace\" name=\"snap.lxd\"",
    "[ {t:.6f}] IPv4: martian source 10.0.3.7 from 10.0.0.1, on dev eth0",
    "[ {t:.6f}] docker0: port 1(veth1a2b) entered forwarding state",
    "[ {t:.6f}] EXT4-fs (md127p3): re-mounted. Quota mode: none.",
    "[ {t:.6f}]  __schedule+0x2cb/0x750",
    "[ {t:.6f}]  ? schedule+0x4e/0xc0",
    "               continued text of the record above",
    "[ {t:.6f}] RIP: 0033:0x7f0000000000",
    "[ {t:.6f}] Code: Unable to access opcode bytes",
    "[ {t:.6f}] systemd[1]: Started Session 12 of user root.",
    "[  +0.000123] perf: interrupt took too long (2503 > 2500)",
    "Nov 21 10:00:01 gpu-n1 kernel: [ 12.000001] bridge: filtering via arp/ip/ip6tables is no longer available",
    "Nov 21 10:00:02 gpu-n1 kernel: igb 0000:05:00.0 eno1: igb: eno1 NIC Link is Up 1000 Mbps",
    "2024-11-15T12:02:03,470068+00:00 gpu-n1 kernel: nvme nvme0: 63/0/0 default/read/poll queues",
    "kern  :info  : [  5.100000] usb 1-1: new high-speed USB device number 2",
    "kern  :info  : [  +0.100000] usb 1-1: new high-speed USB device number 3",
    "[default3]:[  +1.500000] usb 1-1: reset high-speed USB device",
    "",
    "the workqueue hogged CPU for >10000us 4 times \x00",
]
NCCL_NOISE = [
    "gpu-n1:1234:1234 [3] NCCL INFO Channel 02/0 : 3[3] -> 4[4] via P2P/IPC/read",
    "gpu-n1:1234:1234 [3] NCCL INFO comm 0x55d4c0a0 rank 3 nranks 64 cudaDev 3 busId 3b000 - Init COMPLETE",
    "[rank3]:[W1121 10:00:00.000000000 ProcessGroupNCCL.cpp:4561] Warning: barrier() using device under current context",
    "[rank3]: iteration 10/100 | loss 2.3",
    "    quoted source line",
    "[2024-11-21 10:00:01] step 5 done",
    "",
    "logging.Handler: something",
    "gpu-n1:1234:1234 [3] NCCL INFO init.cc:1234 -> 2",
]


def _real_lines(source: str) -> list[str]:
    lines = []
    for scenario in ("real", "project", "families", "negative"):
        p = FIXTURES / source / scenario / "input.log"
        if p.exists():
            lines += p.read_text().splitlines()
    return lines


def _stream(source: str, seed: int, n: int = 3000) -> list[str]:
    rnd = random.Random(seed)
    real = _real_lines(source)
    noise = KERNEL_NOISE if source == "kernel" else NCCL_NOISE
    out: list[str] = []
    t = 100.0
    while len(out) < n:
        if rnd.random() < 0.15:
            start = rnd.randrange(len(real))
            out += real[start:start + rnd.randint(1, 12)]
        else:
            t += rnd.random()
            out += [rnd.choice(noise).format(t=t) for _ in range(rnd.randint(1, 40))]
    return out


def _label(rec, table) -> object:
    d = msgspec.structs.asdict(rec)
    if is_ordinary(rec):
        assert rec.kind in table.ordinary_kinds and not BAD_INPUT_RE.search(rec.raw)
        return "ordinary"
    return json.dumps(d, sort_keys=True, default=str)


def _per_line(items: list, lines: list[str], table) -> list[object]:
    """One label per input line from feed_many's mix of records and ints."""
    out: list[object] = []
    for it in items:
        if isinstance(it, int):
            out += ["ordinary"] * it
        else:
            out += [_label(it, table)] * (it.raw.count("\n") + 1)
    assert len(out) == len(lines)
    return ["empty" if not ln.strip() else lab for ln, lab in zip(lines, out, strict=True)]


def _full_per_line(parser, lines: list[str], table) -> list[object]:
    out: list[object] = []
    pending = 0
    for ln in lines:
        pending += 1
        for rec in parser.feed(ln):
            k = rec.raw.count("\n") + 1
            out += [_label(rec, table)] * k
            pending -= k
        if not ln.strip():
            out.append("empty")
            pending -= 1
    for rec in parser.flush():
        out += [_label(rec, table)] * (rec.raw.count("\n") + 1)
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("source", ["kernel", "nccl"])
def test_feed_many_equals_feed(source: str, seed: int) -> None:
    lines = _stream(source, seed)
    make = (lambda: KernelParser("n", year=2024, boot_time=1.7e9)) if source == "kernel" else (lambda: NcclParser("n", year=2024))
    full, fast = make(), make()
    table = full.kinds
    want = _full_per_line(full, lines, table)
    rnd = random.Random(seed)
    items: list = []
    i = 0
    while i < len(lines):
        k = rnd.choice([1, 3, 50, 700])
        items += fast.feed_many(lines[i:i + k])
        if rnd.random() < 0.5:
            items += fast.release()
        i += k
    items += fast.finish()
    got = _per_line(items, lines, table)
    assert len(got) == len(want)
    diffs = [(n, lines[n], w, g) for n, (w, g) in enumerate(zip(want, got, strict=True)) if w != g]
    assert not diffs, diffs[:3]
    assert fast.ordinary_lines > len(lines) // 4  # the fast path did its job
    shipped = [x for x in set(want) if x not in ("ordinary", "empty")]
    assert shipped  # the stream has real records


def test_noteworthy_words_cover_the_rules_for_other() -> None:
    """Every line a kind-`other` rule files as an error holds one of the fast path's words,
    so the agent never settles such a line as ordinary without classifying it."""
    from faultlens.schema import KernelEvent, NcclEvent

    cats = catalogs()
    texts = ("I/O Error here", "task failed", "page fault", "timed out", "Time out", "kernel BUG", "Call Trace:",
             "critical", "Aborting", "killed", "Exception", "FAILURE", "abort()")
    for parser, rules, cls in ((KernelParser(), cats.kernel, KernelEvent), (NcclParser(), cats.nccl, NcclEvent)):
        table = parser.kinds
        hot = hot_regex(table.noteworthy_any)
        other = [r for r in rules if "other" in r.kinds and r.match is not None]
        assert other, table.file
        for text in texts:
            rec = cls(ts=0.0, node="n", kind="other", raw=text, message=text)
            if not classify(rec).benign:
                assert hot.search(text.lower()), (table.file, text)
                assert not is_ordinary(rec)


def test_hot_filter_finds_the_same_lines_in_a_chunk_as_line_by_line() -> None:
    """The one-scan chunk path and the per-line check agree, odd characters included."""
    rng = random.Random(3)
    pieces = ["NVRM: Xid (PCI:0000:3b:00): 79", "plain text", "İstanbul", "ß", "tab\there", "bad \ufffd byte",
              "ctl \x07", "a.B", "exit", "sysexit", "x  y", " lead", "[  +0.5] rel", "[ 12.5] abs", "UserWarning: x",
              "1 -> 2", "a -> b", "", "   ", "Traceback (most recent call last):", "NCCL WARN net"]  # fmt: skip
    filters = [KernelParser()._hot, NcclParser()._hot]
    for _ in range(300):
        chunk = [" ".join(rng.choice(pieces) for _ in range(rng.randint(0, 3))) for _ in range(rng.randint(1, 30))]
        for hot in filters:
            assert hot.hot_indexes(chunk) == [i for i, line in enumerate(chunk) if hot._line_hot(line)], chunk
    assert filters[0].hot_indexes(["ok", "a\nb", "fine"]) == [1]  # a line break inside a line makes it hot


def test_agent_counts_ordinary_lines_and_ships_the_rest(bus, tmp_path: Path) -> None:
    """Default agent: ordinary lines are counted (health, metric), recognised and bad lines are shipped."""
    import threading
    import time
    import urllib.request

    from faultlens import schema
    from faultlens.collectors.agent import Agent
    from faultlens.config import AgentConfig, Config
    from faultlens.stream.bus import Consumer, ensure_topics
    from faultlens.stream.bus.embedded_broker import free_port

    ensure_topics(bus)
    kern = tmp_path / "kern.log"
    kern.write_text("")
    port = free_port()
    cfg = Config(bus=bus, agent=AgentConfig(spool_dir=str(tmp_path / "spool"), health_interval_s=3600, metrics_port=port))
    agent = Agent(cfg, bootstrap=bus.bootstrap_servers, node="n1", kernel_source=str(kern), sources=("kernel",), tick_s=0.05)
    stop = threading.Event()
    th = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    th.start()
    noise = [f"[ {100 + i}.000000] docker0: port 1(veth{i}) entered forwarding state" for i in range(300)]
    signals = ["[ 500.000000] NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python, GPU has fallen off the bus.",
               "[ 501.000000] mlx5_core 0000:ab:00.0 mlx5_5: Port: 1 Link DOWN",
               "[ 502.000000] some driver: operation failed with error -5",  # unrecognised, but an error word
               "[ 503.000000] \x00 binary junk"]
    try:
        deadline = time.monotonic() + 30
        while agent.health["kernel"].state != "ok":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with open(kern, "a") as f:
            f.write("\n".join(noise[:150] + signals[:2] + noise[150:] + signals[2:]) + "\n")
        got: list = []
        with Consumer(bus, ["kernel"], group_id=None) as c:
            while len(got) < 4 and time.monotonic() < deadline:
                got += [schema.decode("kernel", m.value) for m in c.poll(timeout_ms=200)]
        while agent.health["kernel"].ordinary_lines < 300 and time.monotonic() < deadline:
            time.sleep(0.05)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        stop.set()
        th.join(timeout=30)
    assert [e.raw for e in got] == signals
    assert [e.kind for e in got[:2]] == ["xid", "ib_link_down"]
    assert agent.health_report()["sources"]["kernel"]["ordinary_lines"] == 300
    assert 'faultlens_agent_ordinary_lines_total{source="kernel"} 300.0' in body
