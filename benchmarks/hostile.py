"""Benchmark: hostile input, measured (issue 20 item 6): nothing crashes, every bad unit is counted with its reason.

1. stream: ``--messages`` messages (default 1M) into the stream processor's telemetry topics
   (gpu, kernel, nccl, steps, stacks, jobs) on the embedded broker. They are the records of a
   simulated job (faultlens.datasets.scenario, seeded), encoded as producers send them (JSON;
   the agent's columnar MessagePack for some gpu samples), and about ``--bad`` of them damaged
   (tests/fuzzgen.py ``mutate_bytes`` and JSON-level damage: a cut, a flipped bit, bytes that are
   not UTF-8, NULs, a field of the wrong type, a huge or non-finite number, 5,000-deep nesting,
   an empty message, a missing field, text instead of JSON). A child process builds and
   produces them and asks the decoder (faultlens/decode.py) about each, so the expected dead
   letters are known; then the stream processor drains every topic into a Parquet lake and
   its dead-letter, quarantine and row counters are compared with that.
2. batch: a batch directory (a simulated 4-node job) given a 100 MB single-line kernel log, a
   100 MB single-line steps file, a binary kernel log, a kernel log of mutated lines cut
   mid-line, symlink loops, an unreadable (chmod 000) log, a FIFO and a directory where logs
   should be, a truncated gpu.jsonl with junk, a binary stack dump, a truncated job.json.
   ``faultlens diagnose DIR`` (in a child, so its peak RSS is its own) must finish and list
   every bad file/line with its reason; ``faultlens explain --json`` on the 100 MB line too.

Each part runs in its own process: the peak RSS printed is that part's alone.

    python benchmarks/hostile.py              # 1M messages (several minutes on 2 cores)
    python benchmarks/hostile.py --quick      # 50k messages, 20 MB lines (about a minute)
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TELEMETRY = ("gpu", "kernel", "nccl", "steps", "stacks", "jobs")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --------------------------------------------------------------------------- 1. stream


def _base_records(seed: int) -> dict[str, list]:
    """Records of a simulated job by kind (what producers would send)."""
    from faultlens.collectors.batch import read_batch_dir
    from faultlens.datasets.scenario import scenario_for
    from faultlens.datasets.scenario_files import write_batch_dir

    with tempfile.TemporaryDirectory() as tmp:
        d = write_batch_dir(scenario_for("gpu_lost", nodes=4, duration_s=300.0, seed=seed), Path(tmp) / "run")
        data = read_batch_dir(d)
    return {"gpu": data.gpu, "kernel": data.kernel, "nccl": data.nccl, "steps": data.steps,
            "stacks": data.stacks, "jobs": [data.job] if data.job else []}


def _damage(value: bytes, r: random.Random) -> bytes:
    """One hostile change to an encoded message."""
    from tests.fuzzgen import mutate_bytes

    how = r.randrange(12)
    if how == 0:
        return value[: r.randrange(len(value))]  # cut
    if how == 1:
        return b""
    if how == 2:
        return b"[" * 5000 + value
    if how == 3 and value[:1] == b"{":
        return value.replace(b'"ts":', b'"ts":"yesterday","x":', 1)  # a field of the wrong type
    if how == 4 and value[:1] == b"{":
        return value.replace(b":", b":1e999999,", 1) if r.random() < 0.5 else value.replace(b'"node":', b'"node":[[[[', 1)
    if how == 5:
        return b'{"v": 1, "ts": 1.0}'  # required fields missing
    if how == 6:
        return b"NVRM: Xid (PCI:0000:05:00): 79, pid=1, GPU has fallen off the bus."  # text, not a record
    if how == 7:
        return value + b"\xff\xfe\x00"
    if how == 8 and value[:1] == b"{":
        return value.replace(b"0", b"9" * 40, 1)  # a number beyond 64 bits
    if how == 9:
        return bytes(r.randrange(256) for _ in range(r.randint(1, 300)))
    return mutate_bytes(value, r)


def produce_hostile(bootstrap: str, prefix: str, n: int, bad: float, seed: int) -> dict:
    """Build and send ``n`` messages, ``bad`` of them damaged; returns what was sent and what the decoder says of it."""
    from faultlens import decode, schema
    from faultlens.config import BusConfig
    from faultlens.errors import SchemaError
    from faultlens.stream.bus import Producer

    base = _base_records(seed)
    encoded = {k: [(getattr(rec, "node", "") or getattr(rec, "job", "") or "k",
                    decode.encode_wire(rec) if k == "gpu" and i % 2 else schema.encode(rec)) for i, rec in enumerate(recs)]
               for k, recs in base.items() if recs}
    kinds = list(encoded)
    r = random.Random(seed)
    sent: Counter[str] = Counter()
    damaged = 0
    expect_dead: Counter[str] = Counter()
    failed: Counter[str] = Counter()  # sends the broker refused, by error
    t = time.perf_counter()
    bus = BusConfig(bootstrap_servers=bootstrap, topic_prefix=prefix)
    with Producer(bus, linger_ms=50, batch_size=1 << 20, compression_type="lz4") as producer:
        for i in range(n):
            kind = kinds[i % len(kinds)]
            key, value = r.choice(encoded[kind])
            if r.random() < bad:
                value = _damage(value, r)
                damaged += 1
            try:
                decode.decode(kind, value, issues=[])
            except SchemaError as exc:
                expect_dead[exc.reason] += 1
            producer.send_raw(kind, key, value).add_errback(lambda exc: failed.update([type(exc).__name__]))
            sent[kind] += 1
        producer.flush()
    return {"sent": dict(sent), "damaged": damaged, "expect_dead": dict(expect_dead), "send_failed": dict(failed),
            "produce_s": time.perf_counter() - t, "producer_peak_rss_mb": peak_rss_mb()}


def _end_offsets(bootstrap: str, prefix: str) -> dict[str, int]:
    """Messages the broker holds per telemetry topic (sum of the partitions' end offsets)."""
    from kafka import KafkaConsumer, TopicPartition

    from faultlens.stream import topics

    c = KafkaConsumer(bootstrap_servers=bootstrap)
    out = {}
    for kind in TELEMETRY:
        name = topics.topic(kind, prefix)
        parts = [TopicPartition(name, p) for p in sorted(c.partitions_for_topic(name) or ())]
        out[kind] = sum(c.end_offsets(parts).values()) if parts else 0
    c.close()
    return out


def stream_part(n: int, bad: float, seed: int, work: Path) -> dict:
    from faultlens.config import BusConfig, Config, LakeConfig
    from faultlens.stream.bus import ensure_topics
    from faultlens.stream.bus.embedded_broker import EmbeddedBroker
    from faultlens.stream.catalog import lake_row_counts
    from faultlens.stream.processor import StreamProcessor

    logging.basicConfig(level=logging.ERROR)
    with EmbeddedBroker() as broker:
        bus = BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix="hostile")
        ensure_topics(bus)
        sent = _in_child(produce_hostile, broker.bootstrap, "hostile", n, bad, seed)
        on_broker = _end_offsets(broker.bootstrap, "hostile")
        config = Config(bus=bus, lake=LakeConfig(path=str(work / "lake"), catalog_path=str(work / "catalog.duckdb")))
        proc = StreamProcessor(config, kinds=TELEMETRY, group_id="hostile")
        t = time.perf_counter()
        crashed = None
        try:
            # until every message sent is consumed (idle 120 s or an hour: give up, and the gap is printed)
            stats = proc.run(exit_when_idle_s=120.0, max_runtime_s=3600.0,
                             on_progress=lambda st: proc.stop() if sum(st.messages.values()) >= n else None)
        except Exception as exc:  # noqa: BLE001 - the figure is whether this happens
            crashed = f"{type(exc).__name__}: {exc}"
            stats = proc.stats
        took = time.perf_counter() - t
        rows = lake_row_counts(work / "lake")
    consumed = sum(stats.messages.values())
    dead = dict(stats.dead_letters)
    quarantined = Counter()
    for (kind, field, reason), c in stats.quarantined.items():
        quarantined[f"{kind}.{field}: {reason}"] += c
    return {"messages": n, "sent": sent["sent"], "damaged": sent["damaged"], "produce_s": round(sent["produce_s"], 1),
            "send_failed": sent["send_failed"], "on_broker": on_broker,
            "consumed": consumed, "unaccounted": n - consumed, "dead_letters": sum(dead.values()),
            "dead_by_reason": dead, "decoder_expected_dead": sum(sent["expect_dead"].values()),
            "decoder_expected_by_reason": sent["expect_dead"], "quarantined_fields": sum(quarantined.values()),
            "quarantined_top": dict(quarantined.most_common(8)), "lake_rows": rows, "processor_s": round(took, 1),
            "msgs_per_s": round(consumed / took) if took else 0, "crash": crashed, "peak_rss_mb": round(peak_rss_mb())}


# --------------------------------------------------------------------------- 2. batch


def _big_line(path: Path, mb: int, head: bytes) -> None:
    chunk = b"A" * (1 << 20)
    with open(path, "wb") as f:
        f.write(head)
        for _ in range(mb):
            f.write(chunk)


def build_hostile_dir(root: Path, big_mb: int, seed: int) -> Path:
    from faultlens.datasets.scenario import scenario_for
    from faultlens.datasets.scenario_files import write_batch_dir
    from tests.fuzzgen import mutated_lines, to_bytes

    d = write_batch_dir(scenario_for("gpu_lost", nodes=4, duration_s=600.0, seed=seed), root / "run")
    n1, n2, n3, n4 = sorted((d / "nodes").iterdir())[:4]
    _big_line(n1 / "kernel.log", big_mb, b"[ 12.5] NVRM: Xid (PCI:0000:05:00): 79, ")  # one line, no newline
    (n2 / "kernel.log").write_bytes(random.Random(seed).randbytes(1 << 20))  # binary
    data = to_bytes(mutated_lines("kernel", 20_000, seed=seed))
    (n3 / "kernel.log").write_bytes(data[: len(data) - 37])  # mutated, cut mid-line
    nccl3 = n3 / "nccl"
    nccl3.mkdir(exist_ok=True)
    (nccl3 / "loop.log").symlink_to("loop.log")
    (nccl3 / "a.log").symlink_to("b.log")
    (nccl3 / "b.log").symlink_to("a.log")
    nccl4 = n4 / "nccl"
    nccl4.mkdir(exist_ok=True)
    locked = nccl4 / "locked.log"
    locked.write_text("[rank0]: NCCL WARN unreadable\n")
    locked.chmod(0)
    os.mkfifo(nccl4 / "fifo.log")
    (nccl4 / "dir.log").mkdir()
    g = n4 / "gpu.jsonl"
    g.write_bytes(g.read_bytes()[:-100] + b"\x00\xff" * 1000 + b"\n" + b"[" * 100_000 + b"\n")
    steps = d / "steps"
    steps.mkdir(exist_ok=True)
    _big_line(steps / "huge.jsonl", big_mb, b'{"v": 1, "ts": 1.0, "step": 1, "x": "')
    (d / "stacks").mkdir(exist_ok=True)
    (d / "stacks" / "0.txt").write_bytes(b"\x7fELF" + bytes(4096))
    (d / "stacks" / "rank-x.txt").write_text("Thread 1 (idle)\n")
    j = d / "job.json"
    j.write_bytes(j.read_bytes()[:-20])  # truncated
    return d


def batch_part(big_mb: int, seed: int, work: Path) -> dict:
    from faultlens.cli import main

    d = build_hostile_dir(work, big_mb, seed)
    t = time.perf_counter()
    crash = None
    try:
        rc = main(["diagnose", str(d), "--out", str(work / "diag"), "--detectors", "none"])
    except BaseException as exc:  # noqa: BLE001 - the figure is whether this happens
        rc, crash = -1, f"{type(exc).__name__}: {exc}"
    took = time.perf_counter() - t
    report = (work / "diag" / "report.md").read_text() if (work / "diag" / "report.md").is_file() else ""
    from faultlens.collectors.batch import read_batch_dir

    data = read_batch_dir(d)
    return {"rc": rc, "crash": crash, "diagnose_s": round(took, 1), "unparsed": data.unparsed.count,
            "unparsed_by_reason": dict(data.unparsed.by_reason), "records": len(data),
            "report_lists_unparsed": "## Unparsed input" in report, "peak_rss_mb": round(peak_rss_mb()),
            "big_line_mb": big_mb}


def explain_big_line(big_mb: int, work: Path) -> dict:
    f = work / "big.log"
    _big_line(f, big_mb, b"[ 12.5] NVRM: Xid (PCI:0000:05:00): 79, ")
    with open(f, "ab") as fh:
        fh.write(b"\n[ 13.0] NVRM: Xid (PCI:0000:05:00): 79, pid=1, GPU has fallen off the bus.\n")
    t = time.perf_counter()
    got = subprocess.run([sys.executable, "-c", "from faultlens.cli import main; raise SystemExit(main())",
                          "explain", "--json", str(f)], capture_output=True)
    took = time.perf_counter() - t
    rows = [json.loads(x) for x in got.stdout.splitlines()]
    return {"rc": got.returncode, "lines_answered": len(rows), "first": rows[0]["meaning"][:90] if rows else None,
            "explain_s": round(took, 1), "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024),
            "traceback": b"Traceback" in got.stderr}


def _in_child(fn, *args):
    """``fn(*args)`` in a fresh process (its peak RSS is its own; it may start processes itself)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="50k messages, 20 MB lines")
    ap.add_argument("--smoke", action="store_true", help="2,000 messages, 1 MB lines (seconds): does it still run")
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--bad", type=float, default=0.5, help="share of messages damaged")
    ap.add_argument("--big-mb", type=int, default=100, help="size of the single-line files")
    ap.add_argument("--seed", type=int, default=20)
    ap.add_argument("--skip-stream", action="store_true")
    ap.add_argument("--skip-batch", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.messages, args.big_mb = 50_000, 20
    if args.smoke:
        args.messages, args.big_mb = 2_000, 1
    work = Path(tempfile.mkdtemp(prefix="faultlens-hostile-"))
    try:
        b = None if args.skip_batch else _in_child(batch_part, args.big_mb, args.seed, work / "batch")
        e = None if args.skip_batch else _in_child(explain_big_line, args.big_mb, work / "batch")
        s = None if args.skip_stream else _in_child(stream_part, args.messages, args.bad, args.seed, work / "stream")
    finally:
        for p in (work / "batch").rglob("locked.log"):
            p.chmod(0o600)
        shutil.rmtree(work, ignore_errors=True)
    if b is not None and e is not None:
        _print_batch(b, e, args.big_mb)
    if s is not None:
        _print_stream(s)
    ok = ((b is None or (b["rc"] == 0 and not b["crash"])) and (e is None or (e["rc"] == 0 and not e["traceback"]))
          and (s is None or (not s["crash"] and s["unaccounted"] == 0)))
    print(json.dumps({"bench": "hostile", "ok": ok, "batch": b, "explain_big_line": e, "stream": s, "quick": args.quick}))
    return 0 if ok else 1


def _print_batch(b: dict, e: dict, big_mb: int) -> None:
    print("batch directory (faultlens diagnose DIR):")
    print(f"  rc {b['rc']}, crash {b['crash']}, {b['records']:,} records read, {b['diagnose_s']} s, "
          f"peak RSS {b['peak_rss_mb']} MB (two {b['big_line_mb']} MB single-line files)")
    print(f"  unparsed {b['unparsed']:,}, listed in report.md: {b['report_lists_unparsed']}")
    for reason, c in sorted(b["unparsed_by_reason"].items(), key=lambda x: -x[1]):
        print(f"    {c:>7,}  {reason}")
    print(f"explain --json on a {big_mb} MB single line: rc {e['rc']}, {e['lines_answered']} lines answered, "
          f"{e['explain_s']} s, peak RSS {e['peak_rss_mb']} MB, traceback {e['traceback']}")
    print(f"  first line: {e['first']}")


def _print_stream(s: dict) -> None:
    print(f"stream processor ({s['messages']:,} messages, {s['damaged']:,} damaged):")
    print(f"  sent {sum(s['sent'].values()):,} (refused by the broker: {s['send_failed'] or 0}); "
          f"end offsets right after the flush {sum(s['on_broker'].values()):,}")
    print(f"  crash {s['crash']}; consumed {s['consumed']:,} (sent, not consumed: {s['unaccounted']:,}); "
          f"{s['msgs_per_s']:,} msg/s; peak RSS {s['peak_rss_mb']} MB")
    print(f"  dead letters {s['dead_letters']:,} (the decoder alone says {s['decoder_expected_dead']:,}); "
          f"fields quarantined {s['quarantined_fields']:,}")
    for reason, c in sorted(s["dead_by_reason"].items(), key=lambda x: -x[1]):
        print(f"    {c:>9,}  dead letter: {reason}   (decoder: {s['decoder_expected_by_reason'].get(reason, 0):,})")
    for reason, c in s["quarantined_top"].items():
        print(f"    {c:>9,}  quarantined: {reason}")
    print(f"  lake rows: {s['lake_rows']}")


if __name__ == "__main__":
    raise SystemExit(main())
