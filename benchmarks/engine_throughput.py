"""One diagnosis instance's per-record cost: records per busy second on a 1 Hz fleet (no broker).

What ``benchmarks/scaleout.py`` calls "records per busy second" without the
broker round trips: a fleet (tests/fleetgen: jobs of 8 nodes x 8 GPUs, NVML
samples at 1 Hz plus rank-0 step timings) encoded as the agent sends it
(MessagePack column-major GPU samples, MessagePack steps), handed in
repartition-topic batches to the online service's apply stage
(``DiagnosisService._apply``: header checks, de-duplication, decode, one engine
per job, ticks), with the periodic checkpoint snapshot of every changed job
included. Three figures, each the best of ``--rounds``:

* ``engine``: decoded records straight into the per-job engines (``observe``);
* ``apply``: bytes -> the service's apply stage (decode + engines + ticks);
* ``apply_checkpoint``: the same plus a snapshot of each changed job every 5 s
  of stream time (what the service writes to ``diag-changelog``).

    python benchmarks/engine_throughput.py --smoke   # 16 nodes x 5 s (seconds)
    python benchmarks/engine_throughput.py --quick   # 256 nodes x 30 s
    python benchmarks/engine_throughput.py           # 2,048 nodes x 30 s

Last line: one JSON object. A shared machine's figures are pessimistic: the load
average is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _messages(fl: Any, partitions: int) -> list[Any]:
    """The fleet as repartition-topic messages: key = job, headers as the repartitioner writes them."""
    from faultlens.decode import CONTENT_TYPE_HEADER, content_type_of, encode_wire
    from faultlens.stream.bus import Message

    node_job = {}
    for t in fl.topologies:
        for v in t.ranks.values():
            node_job[v["node"]] = t.job
    offsets = [0] * partitions
    source = {"gpu": 0, "steps": 0, "jobs": 0}
    out = []
    for kind, rec in [("jobs", t) for t in fl.topologies] + [(type(r).KIND, r) for r in fl.records]:
        job = rec.job if kind in ("jobs", "steps") else node_job[rec.node]
        value = encode_wire(rec)
        p = zlib.crc32(job.encode()) % partitions  # any stable spread of jobs over partitions
        sk = job if kind != "gpu" else rec.node
        headers = (("k", kind.encode()), ("sk", sk.encode()), ("so", str(source[kind]).encode()),
                   (CONTENT_TYPE_HEADER, content_type_of(value).encode()))
        source[kind] += 1
        out.append(Message(kind="diag-repartition", topic="diag-repartition", partition=p, offset=offsets[p], key=job,
                           value=value, timestamp_ms=int(rec.ts * 1000), content_type=None, headers=headers))
        offsets[p] += 1
    return out


def _service(partitions: int) -> Any:
    from faultlens.config import Config, DiagnosisConfig
    from faultlens.diagnosis.guardlog import LocalGuardLog
    from faultlens.diagnosis.online import DiagnosisService

    config = Config(diagnosis=DiagnosisConfig(catalog_path=""))
    svc = DiagnosisService(config, tick_interval_s=0.0, guard_log=LocalGuardLog(config.guard, None))
    svc.partitions = set(range(partitions))
    return svc


def run_apply(msgs: list[Any], partitions: int, batch: int, checkpoint_every_s: float | None) -> dict[str, Any]:
    from faultlens.diagnosis.online.state import snapshot

    svc = _service(partitions)
    snaps = 0
    next_cp = None
    t0 = time.process_time()
    for i in range(0, len(msgs), batch):
        chunk = msgs[i:i + batch]
        svc._apply(chunk)
        if checkpoint_every_s is not None:
            now = max(svc.stream_time.values(), default=0.0)
            if next_cp is None:
                next_cp = now + checkpoint_every_s
            if now >= next_cp:
                next_cp = now + checkpoint_every_s
                for st in svc.states.values():
                    if st.dirty:
                        snapshot(st)
                        st.dirty = False
                        snaps += 1
        for st in svc.states.values():
            st.outbox = []
    busy = time.process_time() - t0
    return {"records": len(msgs), "busy_s": round(busy, 3), "records_per_busy_s": round(len(msgs) / busy),
            "applied": svc.applied, "jobs": len(svc.states), "snapshots": snaps}


def run_engine(fl: Any) -> dict[str, Any]:
    from faultlens.config import Config, DiagnosisConfig
    from faultlens.diagnosis.engine import DiagnosisEngine

    config = Config(diagnosis=DiagnosisConfig(catalog_path=""))
    node_job = {v["node"]: t.job for t in fl.topologies for v in t.ranks.values()}
    engines: dict[str, Any] = {}
    for t in fl.topologies:
        engines[t.job] = DiagnosisEngine(config, batch=False)
        engines[t.job].observe(t)
    t0 = time.process_time()
    for r in fl.records:
        engines[r.job if type(r).KIND == "steps" else node_job[r.node]].observe(r)
    busy = time.process_time() - t0
    return {"records": len(fl.records), "busy_s": round(busy, 3), "records_per_busy_s": round(len(fl.records) / busy)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--nodes", type=int)
    ap.add_argument("--seconds", type=int)
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--batch", type=int, default=2000, help="records per apply call (ConsumeLoop's max_records)")
    ap.add_argument("--profile", help="write a cProfile of one apply round here")
    args = ap.parse_args()
    from faultlens.stream.topics import REPARTITION_PARTITIONS
    from tests import fleetgen

    nodes = args.nodes or (16 if args.smoke else 256 if args.quick else 2048)
    seconds = args.seconds or (5 if args.smoke else 30)
    rounds = args.rounds or (1 if args.smoke else 3)
    fl = fleetgen.fleet(jobs=nodes // 8, nodes_per_job=8, unjobbed=0, duration_s=seconds, gpu_interval_s=1.0,
                        faulty_jobs=0)
    msgs = _messages(fl, REPARTITION_PARTITIONS)
    if args.profile:
        import cProfile

        cProfile.runctx("run_apply(msgs, REPARTITION_PARTITIONS, args.batch, 5.0)", globals(),
                        {"run_apply": run_apply, "msgs": msgs, "REPARTITION_PARTITIONS": REPARTITION_PARTITIONS,
                         "args": args}, args.profile)
    result: dict[str, Any] = {"bench": "engine_throughput", "nodes": nodes, "seconds": seconds,
                              "records": len(fl.records), "load_avg_1m": round(os.getloadavg()[0], 2)}
    for name, fn in (("engine", lambda: run_engine(fl)),
                     ("apply", lambda: run_apply(msgs, REPARTITION_PARTITIONS, args.batch, None)),
                     ("apply_checkpoint", lambda: run_apply(msgs, REPARTITION_PARTITIONS, args.batch, 5.0))):
        runs = [fn() for _ in range(rounds)]
        best = max(runs, key=lambda r: r["records_per_busy_s"])
        result[name] = best
        print(f"{name:17s} {best['records_per_busy_s']:8d} records per busy second "
              f"({best['records']} records in {best['busy_s']} s, best of {rounds})", flush=True)
    result["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    print(f"load average {result['load_avg_1m']} -> {result['load_avg_1m_end']} (1 min)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
