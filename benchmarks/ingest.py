"""Ingest benchmark: GPU samples from the broker into the Parquet lake.

A simulated fleet of 8-GPU nodes (GpuSample messages encoded as faultlens's
agent sends them: ``decode.encode_wire``, columnar MessagePack; ``--wire json``
for the JSON any producer may send, one message = one node's 8 GPUs) is
produced to an embedded broker. In the same run, alternated ``--rounds`` times,
we measure

* the bare kafka-python consume rate of those messages (no decoding),
* the bare confluent-kafka (librdkafka) consume rate, when it is installed,
* the stream processor's broker -> lake rate (the one decoder with its
  tolerance path on, Arrow, Parquet files, rollups, manifest commit), from its
  partition assignment to its last commit, fetching with kafka-python and, when
  confluent-kafka is installed, again fetching with confluent-kafka
  (stream/bus/lake_fetchers.py),

and print each, the ratio lake / bare kafka-python per round and its median
(for each fetcher; the headline is the processor as deployed: confluent-kafka
when installed),
the CPU time per message, and the peak RSS of this process. Messages are built
and produced (lz4) by a child process before anything is consumed, so neither
the producer's CPU nor its memory counts here.

    python benchmarks/ingest.py               # 150,000 messages (1.2 M GPU samples), 3 rounds
    python benchmarks/ingest.py --quick       # 30,000 messages, 3 rounds, about a minute
    python benchmarks/ingest.py --wire json   # JSON messages instead of the agent's MessagePack
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
import statistics
import sys
import tempfile
import time
from pathlib import Path

from faultlens import decode, schema
from faultlens.config import BusConfig, Config, LakeConfig
from faultlens.stream import topics
from faultlens.stream.bus import Producer, ensure_topics
from faultlens.stream.bus.embedded_broker import EmbeddedBroker
from faultlens.stream.catalog import lake_row_counts
from faultlens.stream.processor import StreamProcessor
from faultlens.stream.processor_runtime import CHECK_CRCS

GPUS_PER_NODE = 8


def fleet_messages(n_messages: int, n_nodes: int, seed: int = 7, wire: str = "msgpack") -> list[tuple[str, bytes]]:
    """(key, value) of ``n_messages`` samples: every node sampled once per second."""
    encode = decode.encode_wire if wire == "msgpack" else schema.encode
    rng = random.Random(seed)
    t0 = 1_760_000_000.0
    out = []
    for i in range(n_messages):
        node = f"n{i % n_nodes:05d}"
        ts = t0 + i // n_nodes
        gpus = [
            schema.GpuState(
                index=g, uuid=f"GPU-{i % n_nodes:05d}-{g}", pci_bus=f"0000:{0x18 + g * 0x10:02x}:00.0",
                # NVML's own resolution: integer percent, degree, MiB, MHz; power in mW.
                util=float(rng.randint(80, 100)), mem_util=float(rng.randint(30, 60)),
                mem_used_mb=float(rng.randint(40_000, 78_000)), temp_c=float(rng.randint(55, 80)),
                power_w=rng.randint(400_000, 690_000) / 1000, sm_clock_mhz=1980.0, mem_clock_mhz=2619.0,
                ecc_sbe=i // 1000, pcie_replay=i // 5000,
            )  # fmt: skip
            for g in range(GPUS_PER_NODE)
        ]
        out.append((node, encode(schema.GpuSample(ts=ts, node=node, gpus=gpus, job="bench-job"))))
    return out


def produce(bus: BusConfig, n_messages: int, n_nodes: int, wire: str) -> tuple[float, float]:
    """Build and send the fleet's messages; returns (seconds sending, payload MB). Run in a child process."""
    messages = fleet_messages(n_messages, n_nodes, wire=wire)
    t = time.perf_counter()
    # lz4 batches: cheap to compress and ~10x cheaper than gzip to decompress in the
    # consumer; uncompressed batches were ~3x slower to consume (more bytes to fetch).
    with Producer(bus, linger_ms=50, batch_size=1 << 20, compression_type="lz4") as producer:
        for key, value in messages:
            producer.send_raw("gpu", key, value)
        producer.flush()
    return time.perf_counter() - t, sum(len(v) for _, v in messages) / 1e6


def _produce_in_child(bus: BusConfig, n_messages: int, n_nodes: int, wire: str) -> tuple[float, float]:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(produce, (bus, n_messages, n_nodes, wire))


def bare_consume(bus: BusConfig, n: int) -> tuple[float, float]:
    """(seconds, CPU seconds) for plain kafka-python to fetch ``n`` messages of the gpu topic (no decode)."""
    from kafka import KafkaConsumer, TopicPartition

    name = topics.topic("gpu", bus.topic_prefix)
    consumer = KafkaConsumer(
        bootstrap_servers=bus.bootstrap_servers, group_id=None, enable_auto_commit=False, check_crcs=CHECK_CRCS,
        fetch_max_bytes=64 << 20, max_partition_fetch_bytes=16 << 20, fetch_min_bytes=1 << 20, fetch_max_wait_ms=100,
    )  # fmt: skip
    parts = [TopicPartition(name, p) for p in sorted(consumer.partitions_for_topic(name) or ())]
    consumer.assign(parts)
    consumer.seek_to_beginning()
    got, t, cpu = 0, time.perf_counter(), time.process_time()
    while got < n:
        for records in consumer.poll(timeout_ms=500, max_records=50_000).values():
            got += len(records)
        if time.perf_counter() - t > 300:
            raise SystemExit(f"bare consume stalled at {got}/{n}")
    elapsed, cpu = time.perf_counter() - t, time.process_time() - cpu
    consumer.close()
    return elapsed, cpu


def bare_confluent(bus: BusConfig, n: int) -> tuple[float, float] | None:
    """(seconds, CPU seconds) for confluent-kafka to fetch ``n`` messages (no decode); None when not installed."""
    try:
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
    except ImportError:
        return None
    name = topics.topic("gpu", bus.topic_prefix)
    consumer = Consumer({"bootstrap.servers": bus.bootstrap_servers, "group.id": "bench-bare-confluent",
                         "enable.auto.commit": False, "fetch.wait.max.ms": 100, "fetch.min.bytes": 1 << 20,
                         "check.crcs": CHECK_CRCS, "log_level": 3})
    meta = consumer.list_topics(name, timeout=10)
    consumer.assign([TopicPartition(name, p, OFFSET_BEGINNING) for p in sorted(meta.topics[name].partitions)])
    got, t, cpu = 0, time.perf_counter(), time.process_time()
    while got < n:
        got += sum(1 for m in consumer.consume(num_messages=10_000, timeout=0.5) if m.error() is None)
        if time.perf_counter() - t > 120:
            consumer.close()
            return None
    elapsed, cpu = time.perf_counter() - t, time.process_time() - cpu
    consumer.close()
    return elapsed, cpu


def run_processor(bus: BusConfig, work: Path, group: str, fetcher: str = "kafka") -> tuple[float, float, float, int, int]:
    """(seconds from partition assignment to the last commit, process CPU s, poll-thread CPU s, commits, gpu rows)."""
    config = Config(bus=bus, lake=LakeConfig(path=str(work / "lake"), catalog_path=str(work / "catalog.duckdb")))
    # The deployed defaults (LakeConfig); only the Kafka client differs.
    proc = StreamProcessor(config, kinds=["gpu"], group_id=group, fetcher=fetcher)
    cpu = time.process_time()
    # Idle 1.5 s ends the run. Longer would not change the rate (timed to the last commit)
    # but would add idle polling to the CPU figures (5 s added ~10 us per message here).
    stats = proc.run(exit_when_idle_s=1.5)
    cpu = time.process_time() - cpu
    rows = lake_row_counts(work / "lake")["gpu"]
    return stats.last_commit_at - stats.assigned_at, cpu, stats.poll_thread_cpu_s, stats.commits, rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smaller run, about a minute")
    ap.add_argument("--smoke", action="store_true", help="2,000 messages, one round (seconds): does it still run")
    ap.add_argument("--messages", type=int, help="GPU messages to produce (default 150000, quick 30000)")
    ap.add_argument("--nodes", type=int, default=2_000, help="simulated 8-GPU nodes")
    ap.add_argument("--rounds", type=int, default=3, help="alternate bare consume and processor this many times")
    ap.add_argument("--wire", choices=("msgpack", "json"), default="msgpack",
                    help="the agent's MessagePack (default) or JSON messages")
    ap.add_argument("--keep", metavar="DIR", help="keep the lake (of the last round) in DIR")
    args = ap.parse_args()
    n = args.messages or (2_000 if args.smoke else 30_000 if args.quick else 150_000)
    if args.smoke:
        args.rounds, args.nodes = 1, 50
    logging.basicConfig(level=logging.WARNING)

    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="faultlens-bench-ingest-"))
    bare_rates, lake_rates, ratios, confluent_rates, rows_ok = [], [], [], [], True
    lake_kp_rates: list[float] = []  # the processor fetching with kafka-python
    lake_ck_rates: list[float] = []  # ... with confluent-kafka (when installed)
    loads: list[float] = []
    with EmbeddedBroker() as broker:
        bus = BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix="bench")
        ensure_topics(bus)
        produce_s, payload_mb = _produce_in_child(bus, n, args.nodes, args.wire)
        for r in range(args.rounds):
            loads.append(os.getloadavg()[0])
            bare_s, bare_cpu = bare_consume(bus, n)
            conf = bare_confluent(bus, n)
            if conf is not None:
                confluent_rates.append(n / conf[0])
            shutil.rmtree(work, ignore_errors=True)
            lake_s, lake_cpu, poll_cpu, commits, rows = run_processor(bus, work, f"bench-ingest-{r}")
            wrong = [] if rows == n * GPUS_PER_NODE else [f"kafka-python fetch: {rows:,} rows"]
            lake_kp_rates.append(n / lake_s)
            if conf is not None:
                shutil.rmtree(work, ignore_errors=True)
                ck_s, ck_cpu, ck_poll, ck_commits, ck_rows = run_processor(bus, work, f"bench-ingest-ck-{r}", "confluent")
                if ck_rows != n * GPUS_PER_NODE:
                    wrong.append(f"confluent fetch: {ck_rows:,} rows")
                lake_ck_rates.append(n / ck_s)
                # The headline is the processor as deployed: confluent-kafka where it is installed.
                lake_s, lake_cpu, poll_cpu, commits, rows = ck_s, ck_cpu, ck_poll, ck_commits, ck_rows
            bare_rates.append(n / bare_s)
            lake_rates.append(n / lake_s)
            ratios.append(lake_rates[-1] / bare_rates[-1])
            conf_txt = f", confluent-kafka {confluent_rates[-1]:,.0f} msg/s" if conf is not None else ""
            ck_txt = f", lake (confluent) {lake_ck_rates[-1]:,.0f} msg/s" if conf is not None else ""
            print(f"round {r + 1} (load {loads[-1]:.1f}): bare kafka-python {bare_rates[-1]:,.0f} msg/s{conf_txt}, "
                  f"lake (kafka-python) {lake_kp_rates[-1]:,.0f} msg/s{ck_txt}; "
                  f"ratio {ratios[-1]:.2f}", flush=True)
            if wrong:
                rows_ok = False
                print(f"  ERROR round {r + 1}: expected {n * GPUS_PER_NODE:,} rows; {'; '.join(wrong)}", flush=True)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # The median round (by ratio): bare and processor measured back to back on a shared machine.
    mid = sorted(range(len(ratios)), key=lambda i: ratios[i])[len(ratios) // 2]
    bare_rate, lake_rate, ratio = bare_rates[mid], lake_rates[mid], ratios[mid]
    us = 1e6 / n  # seconds per run -> microseconds per message
    # With the poll thread on one core and the rest of the work spread over both:
    bound_2core = n / max(poll_cpu, lake_cpu / 2)

    print(f"{'messages (8 GPUs each)':<38}{n:>14,}")
    print(f"{'payload (' + args.wire + ', before lz4)':<38}{payload_mb:>11,.1f} MB")
    print(f"{'produce (child process)':<38}{n / produce_s:>12,.0f} msg/s")
    print(f"{'bare kafka-python consume':<38}{bare_rate:>12,.0f} msg/s   CPU {bare_cpu * us:5.1f} us/msg")
    if confluent_rates:
        print(f"{'bare confluent-kafka consume (median)':<38}{statistics.median(confluent_rates):>12,.0f} msg/s")
    kp_ratios = [k / b for k, b in zip(lake_kp_rates, bare_rates, strict=True)]
    print(f"{'processor, kafka-python fetch (median)':<38}{statistics.median(lake_kp_rates):>12,.0f} msg/s   "
          f"ratio {statistics.median(kp_ratios):.2f}")
    if lake_ck_rates:
        ck_ratios = [k / b for k, b in zip(lake_ck_rates, confluent_rates, strict=True)]
        print(f"{'processor, confluent fetch (median)':<38}{statistics.median(lake_ck_rates):>12,.0f} msg/s   "
              f"ratio to bare confluent {statistics.median(ck_ratios):.2f}")
    fetch = "confluent-kafka" if lake_ck_rates else "kafka-python"
    print(f"{'processor broker -> lake (' + fetch + ')':<38}{lake_rate:>12,.0f} msg/s   CPU {lake_cpu * us:5.1f} us/msg "
          f"(poll thread {poll_cpu * us:.1f})")
    print(f"{'  = GPU samples into the lake':<38}{lake_rate * GPUS_PER_NODE:>12,.0f} /s")
    print(f"{'ratio lake / bare kafka-python (median)':<38}{ratio:>14.2f}   rounds: {', '.join(f'{x:.2f}' for x in ratios)}")
    print(f"{'load average (1 min) at each round':<38}{'':>8}{', '.join(f'{x:.1f}' for x in loads)}  ({os.cpu_count()} CPUs)")
    print(f"{'  2-core bound from CPU time':<38}{bound_2core:>12,.0f} msg/s   (an idle machine; ratio {bound_2core / (1e6 / (bare_cpu * us)):.2f})")
    print(f"{'rows in the lake (gpu)':<38}{rows:>14,}  (expected {n * GPUS_PER_NODE:,})")
    print(f"{'commits':<38}{commits:>14,}")
    print(f"{'peak RSS (consumers + processor)':<38}{peak_rss_mb:>11,.0f} MB")
    if not rows_ok:
        print("ERROR: the lake does not hold exactly one row per GPU sample", file=sys.stderr)
    print(json.dumps({
        "bench": "ingest",
        "gpu_samples_per_s": round(lake_rate * GPUS_PER_NODE),
        "msgs_per_s": round(lake_rate),
        "bare_consume_msgs_per_s": round(bare_rate),
        "ratio_vs_bare_consume": round(ratio, 3),
        "median_gpu_samples_per_s": round(statistics.median(lake_rates) * GPUS_PER_NODE),
        "median_ratio_vs_bare_consume": round(statistics.median(ratios), 3),
        "best_ratio_vs_bare_consume": round(max(ratios), 3),
        "confluent_consume_msgs_per_s": round(statistics.median(confluent_rates)) if confluent_rates else None,
        "processor_fetch": fetch,
        "lake_kafka_python_msgs_per_s": round(statistics.median(lake_kp_rates)),
        "ratio_kafka_python_fetch": round(statistics.median(kp_ratios), 3),
        "lake_confluent_msgs_per_s": round(statistics.median(lake_ck_rates)) if lake_ck_rates else None,
        "load_avg_1m": [round(x, 2) for x in loads],
        "wire": args.wire,
        "cpu_us_per_msg": round(lake_cpu * us, 1),
        "bare_cpu_us_per_msg": round(bare_cpu * us, 1),
        "peak_rss_mb": round(peak_rss_mb),
        "messages": n,
        "rounds": args.rounds,
        "lake_rows_ok": rows_ok,
    }))  # fmt: skip
    return 0 if rows_ok else 1


if __name__ == "__main__":
    sys.exit(main())
