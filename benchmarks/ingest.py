"""Ingest benchmark: GPU samples from the broker into the Parquet lake.

A simulated fleet of 8-GPU nodes (GpuSample messages built with
faultlens.stream.schema, one message = one node's 8 GPUs) is produced to an
embedded broker. In the same run we measure

* the bare kafka-python consume rate of those messages (no decoding), and
* the stream processor's broker -> lake rate (decode to Arrow, Parquet files,
  rollups, manifest commit), from its partition assignment to its last commit,

and print both, their ratio, the CPU time per message of each, and the peak
RSS of this process. Messages are built and produced (lz4) by a child process
before anything is consumed, so neither the producer's CPU nor its memory
counts here.

    python benchmarks/ingest.py               # 150,000 messages (1.2 M GPU samples)
    python benchmarks/ingest.py --quick       # 40,000 messages, well under a minute
    python benchmarks/ingest.py --rounds 3    # bare/processor alternated 3 times: best and median
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from faultlens.config import BusConfig, Config, LakeConfig
from faultlens.stream import schema, topics
from faultlens.stream.broker import EmbeddedBroker
from faultlens.stream.bus import Producer, ensure_topics
from faultlens.stream.processor import CHECK_CRCS, StreamProcessor, lake_row_counts

GPUS_PER_NODE = 8


def fleet_messages(n_messages: int, n_nodes: int, seed: int = 7) -> list[tuple[str, bytes]]:
    """(key, JSON value) of ``n_messages`` samples: every node sampled once per second."""
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
        out.append((node, schema.encode(schema.GpuSample(ts=ts, node=node, gpus=gpus, job="bench-job"))))
    return out


def produce(bus: BusConfig, n_messages: int, n_nodes: int) -> tuple[float, float]:
    """Build and send the fleet's messages; returns (seconds sending, payload MB). Run in a child process."""
    messages = fleet_messages(n_messages, n_nodes)
    t = time.perf_counter()
    # lz4 batches: cheap to compress and ~10x cheaper than gzip to decompress in the
    # consumer; uncompressed batches were ~3x slower to consume (more bytes to fetch).
    with Producer(bus, linger_ms=50, batch_size=1 << 20, compression_type="lz4") as producer:
        for key, value in messages:
            producer.send_raw("gpu", key, value)
        producer.flush()
    return time.perf_counter() - t, sum(len(v) for _, v in messages) / 1e6


def _produce_in_child(bus: BusConfig, n_messages: int, n_nodes: int) -> tuple[float, float]:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(produce, (bus, n_messages, n_nodes))


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


def run_processor(bus: BusConfig, work: Path, group: str) -> tuple[float, float, float, int, int]:
    """(seconds from partition assignment to the last commit, process CPU s, poll-thread CPU s, commits, gpu rows)."""
    config = Config(bus=bus, lake=LakeConfig(path=str(work / "lake"), catalog_path=str(work / "catalog.duckdb")))
    proc = StreamProcessor(config, kinds=["gpu"], group_id=group, flush_interval_s=5.0, flush_rows=400_000)
    cpu = time.process_time()
    stats = proc.run(exit_when_idle_s=1.5)
    cpu = time.process_time() - cpu
    rows = lake_row_counts(work / "lake")["gpu"]
    return stats.last_commit_at - stats.assigned_at, cpu, stats.poll_thread_cpu_s, stats.commits, rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smaller run, under a minute")
    ap.add_argument("--messages", type=int, help="GPU messages to produce (default 150000, quick 40000)")
    ap.add_argument("--nodes", type=int, default=2_000, help="simulated 8-GPU nodes")
    ap.add_argument("--rounds", type=int, default=1, help="alternate bare consume and processor this many times")
    ap.add_argument("--keep", metavar="DIR", help="keep the lake (of the last round) in DIR")
    args = ap.parse_args()
    n = args.messages or (40_000 if args.quick else 150_000)
    logging.basicConfig(level=logging.WARNING)

    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="faultlens-bench-ingest-"))
    bare_rates, lake_rates, ratios, rows_ok = [], [], [], True
    with EmbeddedBroker() as broker:
        bus = BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix="bench")
        ensure_topics(bus)
        produce_s, payload_mb = _produce_in_child(bus, n, args.nodes)
        for r in range(args.rounds):
            bare_s, bare_cpu = bare_consume(bus, n)
            shutil.rmtree(work, ignore_errors=True)
            lake_s, lake_cpu, poll_cpu, commits, rows = run_processor(bus, work, f"bench-ingest-{r}")
            rows_ok &= rows == n * GPUS_PER_NODE
            bare_rates.append(n / bare_s)
            lake_rates.append(n / lake_s)
            ratios.append(lake_rates[-1] / bare_rates[-1])
            if args.rounds > 1:
                print(f"round {r + 1}: bare {bare_rates[-1]:,.0f} msg/s, lake {lake_rates[-1]:,.0f} msg/s, ratio {ratios[-1]:.2f}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    best = max(range(len(lake_rates)), key=lambda i: lake_rates[i])
    bare_rate, lake_rate, ratio = bare_rates[best], lake_rates[best], ratios[best]
    us = 1e6 / n  # seconds per run -> microseconds per message
    # With the poll thread on one core and the rest of the work spread over both:
    bound_2core = n / max(poll_cpu, lake_cpu / 2)

    print(f"{'messages (8 GPUs each)':<38}{n:>14,}")
    print(f"{'payload (JSON, before lz4)':<38}{payload_mb:>11,.1f} MB")
    print(f"{'produce (child process)':<38}{n / produce_s:>12,.0f} msg/s")
    print(f"{'bare kafka-python consume':<38}{bare_rate:>12,.0f} msg/s   CPU {bare_cpu * us:5.1f} us/msg")
    print(f"{'processor broker -> lake':<38}{lake_rate:>12,.0f} msg/s   CPU {lake_cpu * us:5.1f} us/msg "
          f"(poll thread {poll_cpu * us:.1f})")
    print(f"{'  = GPU samples into the lake':<38}{lake_rate * GPUS_PER_NODE:>12,.0f} /s")
    print(f"{'ratio lake / bare consume':<38}{ratio:>14.2f}")
    if args.rounds > 1:
        print(f"{'  median of rounds (lake, ratio)':<38}{statistics.median(lake_rates):>12,.0f} msg/s  {statistics.median(ratios):.2f}")
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
