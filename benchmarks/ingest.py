"""Ingest benchmark: GPU samples from the broker into the Parquet lake.

A simulated fleet of 8-GPU nodes (GpuSample messages built with
faultlens.stream.schema, one message = one node's 8 GPUs) is produced to an
embedded broker. In the same run we measure

* the bare kafka-python consume rate of those messages (no decoding), and
* the stream processor's broker -> lake rate (decode to Arrow, Parquet files,
  rollups, manifest commit), from its partition assignment to its last commit,

and print both, their ratio, and the peak RSS of this process.

    python benchmarks/ingest.py            # 150,000 messages (1.2 M GPU samples)
    python benchmarks/ingest.py --quick    # 40,000 messages, well under a minute
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import resource
import shutil
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


def produce(bus: BusConfig, messages: list[tuple[str, bytes]]) -> float:
    t = time.perf_counter()
    # gzip batches: the only codec kafka-python has without extra packages; it
    # cuts the bytes that the (pure-Python without `crc32c`) CRC code must walk.
    with Producer(bus, linger_ms=50, batch_size=1 << 20, compression_type="gzip") as producer:
        for key, value in messages:
            producer.send_raw("gpu", key, value)
        producer.flush()
    return time.perf_counter() - t


def bare_consume(bus: BusConfig, n: int) -> float:
    """Seconds for plain kafka-python to fetch ``n`` messages of the gpu topic (no decode)."""
    from kafka import KafkaConsumer, TopicPartition

    name = topics.topic("gpu", bus.topic_prefix)
    consumer = KafkaConsumer(
        bootstrap_servers=bus.bootstrap_servers, group_id=None, enable_auto_commit=False, check_crcs=CHECK_CRCS,
        fetch_max_bytes=64 << 20, max_partition_fetch_bytes=16 << 20, fetch_min_bytes=1 << 20, fetch_max_wait_ms=100,
    )  # fmt: skip
    parts = [TopicPartition(name, p) for p in sorted(consumer.partitions_for_topic(name) or ())]
    consumer.assign(parts)
    consumer.seek_to_beginning()
    got, t = 0, time.perf_counter()
    while got < n:
        for records in consumer.poll(timeout_ms=500, max_records=50_000).values():
            got += len(records)
        if time.perf_counter() - t > 300:
            raise SystemExit(f"bare consume stalled at {got}/{n}")
    elapsed = time.perf_counter() - t
    consumer.close()
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smaller run, under a minute")
    ap.add_argument("--messages", type=int, help="GPU messages to produce (default 150000, quick 40000)")
    ap.add_argument("--nodes", type=int, default=2_000, help="simulated 8-GPU nodes")
    ap.add_argument("--keep", metavar="DIR", help="keep the lake in DIR")
    args = ap.parse_args()
    n = args.messages or (40_000 if args.quick else 150_000)
    logging.basicConfig(level=logging.WARNING)

    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="faultlens-bench-ingest-"))
    msgs = fleet_messages(n, args.nodes)
    payload_mb = sum(len(v) for _, v in msgs) / 1e6
    with EmbeddedBroker() as broker:
        bus = BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix="bench")
        ensure_topics(bus)
        produce_s = produce(bus, msgs)
        del msgs
        bare_s = bare_consume(bus, n)
        config = Config(bus=bus, lake=LakeConfig(path=str(work / "lake"), catalog_path=str(work / "catalog.duckdb")))
        proc = StreamProcessor(config, kinds=["gpu"], group_id="bench-ingest", flush_interval_s=5.0, flush_rows=400_000)
        proc.run(exit_when_idle_s=1.5)
        stats = proc.stats
        lake_s = stats.last_commit_at - stats.assigned_at
    rows = lake_row_counts(work / "lake")["gpu"]
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    bare_rate, lake_rate = n / bare_s, n / lake_s
    ratio = lake_rate / bare_rate

    print(f"{'messages (8 GPUs each)':<34}{n:>14,}")
    print(f"{'payload':<34}{payload_mb:>11,.1f} MB")
    print(f"{'produce':<34}{n / produce_s:>12,.0f} msg/s")
    print(f"{'bare kafka-python consume':<34}{bare_rate:>12,.0f} msg/s")
    print(f"{'processor broker -> lake':<34}{lake_rate:>12,.0f} msg/s")
    print(f"{'  = GPU samples into the lake':<34}{lake_rate * GPUS_PER_NODE:>12,.0f} /s")
    print(f"{'ratio lake / bare consume':<34}{ratio:>14.2f}")
    print(f"{'rows in the lake (gpu)':<34}{rows:>14,}  (expected {n * GPUS_PER_NODE:,})")
    print(f"{'commits':<34}{stats.commits:>14,}")
    print(f"{'peak RSS':<34}{peak_rss_mb:>11,.0f} MB")
    if rows != n * GPUS_PER_NODE:
        print("ERROR: the lake does not hold exactly one row per GPU sample", file=sys.stderr)
    print(json.dumps({
        "bench": "ingest",
        "gpu_samples_per_s": round(lake_rate * GPUS_PER_NODE),
        "msgs_per_s": round(lake_rate),
        "bare_consume_msgs_per_s": round(bare_rate),
        "ratio_vs_bare_consume": round(ratio, 3),
        "peak_rss_mb": round(peak_rss_mb),
        "messages": n,
        "lake_rows_ok": rows == n * GPUS_PER_NODE,
    }))  # fmt: skip
    return 0 if rows == n * GPUS_PER_NODE else 1


if __name__ == "__main__":
    sys.exit(main())
