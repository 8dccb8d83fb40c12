"""Explorer query latency and report time over a week of a 1,024-GPU job.

Target (issue 8): every explorer query < 1 s p95 over 7 days of a 1,024-GPU job
sampled at 1 Hz (~620 M GPU samples), and the week's report in < 30 s.

What is generated (seeded), and what is not: the 620 M raw GPU samples are NOT
generated — the explorer never reads them; it reads the per-minute rollups the
stream processor writes. Generated, in the lake layout and schemas of stream/:
  * gpu_1m rollup partials: 1,024 GPUs x every minute of the range (7 days:
    10.3 M rows), one file per hour, with a few ECC/NVLink/PCIe incidents;
  * steps_1m rollup partials: 1,024 ranks x every minute with progress (gaps
    where incidents stopped the job);
  * raw slices: the last hour of 1 Hz GPU samples of all 1,024 GPUs (3.7 M rows),
    per-rank step timings (every 2 s, all ranks) around the benchmarked
    incidents, kernel lines (Xids plus routine noise), watchdog lines, one
    stack dump per rank for a hang, the topology, incidents (two versions
    each), actions and runner statuses.
Usage: python benchmarks/ui_queries.py [--quick] [--days N] [--data DIR] [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from faultlens import schema
from faultlens.stream.catalog import rollup_schema
from faultlens.stream.lake import LakeWriter, hour_path, write_parquet_atomic
from faultlens.stream.topology import Topology
from faultlens.ui import report, views

START = 1_740_787_200.0  # 2025-03-01 00:00 UTC
JOB = "bench-1024"
NODES, GPUS = 128, 8
KINDS = [("gpu_lost", "gpu_hardware", 79, 25), ("ecc_uncorrectable", "gpu_memory", 48, 20),
         ("nvlink_error", "nvlink", 74, 15), ("ib_link_persistent", "network", None, 12),
         ("hang_stuck_rank", "user_software", None, 30), ("thermal_throttle", "thermal_power", None, 0),
         ("host_oom", "host", None, 8), ("row_remap_failure", "gpu_memory", 64, 20)]


def node_name(i: int) -> str:
    return f"n{i + 1:04d}"


def make_incidents(days: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    n = max(3, 2 * days)
    minutes = np.sort(rng.choice(np.arange(120, days * 1440 - 120), size=n, replace=False))
    out = []
    for i, m in enumerate(minutes):
        kind, cat, xid, gap_min = KINDS[i % len(KINDS)]
        node = int(rng.integers(NODES))
        out.append({"id": f"inc-{i:04d}", "minute": int(m), "kind": kind, "category": cat, "xid": xid,
                    "gap_min": gap_min, "node": node, "gpu": int(rng.integers(GPUS))})
    return out


def write_rollups(lake: Path, days: int, incidents: list[dict[str, Any]], rng: np.random.Generator) -> int:
    gpu_schema, steps_schema = rollup_schema("gpu_1m"), rollup_schema("steps_1m")
    down = np.zeros(days * 1440, dtype=bool)
    for inc in incidents:
        down[inc["minute"]: inc["minute"] + inc["gap_min"]] = True
    steps_per_min = np.where(down, 0, 30)
    cum_steps = np.concatenate([[0], np.cumsum(steps_per_min)])
    node_ids = np.repeat(np.arange(NODES), GPUS)
    gpu_ids = np.tile(np.arange(GPUS), NODES)
    node_names = np.array([node_name(i) for i in range(NODES)], dtype=object)
    dbe_at = {(inc["node"], inc["gpu"]): inc["minute"] for inc in incidents if inc["kind"] == "ecc_uncorrectable"}
    rows = 0
    for hour in range(days * 24):
        mins = np.arange(hour * 60, hour * 60 + 60)
        # gpu_1m: sorted by node, gpu, minute so a one-node query skips most row groups
        k = len(mins)
        node_col = np.repeat(node_ids, k)
        gpu_col = np.repeat(gpu_ids, k)
        minute_col = START + np.tile(mins, NODES * GPUS) * 60.0
        m_idx = np.tile(mins, NODES * GPUS)
        n = len(node_col)
        temp = rng.normal(62, 3, n)
        clock = np.full(n, 1980.0)
        dbe = np.zeros(n, dtype=np.int64)
        for (nd, g), m in dbe_at.items():
            sel = (node_col == nd) & (gpu_col == g)
            dbe[sel & (m_idx >= m)] = 1
            dbe[sel & (m_idx >= m + 90)] = 2  # repeated: an RMA candidate
        zeros = np.zeros(n, dtype=np.int64)
        cols = {
            "job": pa.array(np.full(n, JOB, dtype=object), pa.string()),
            "node": pa.array(node_names[node_col], pa.string()), "gpu": gpu_col, "minute": minute_col,
            "n": np.full(n, 60), "temp_c_sum": temp * 60, "temp_c_max": temp + rng.uniform(0, 3, n),
            "power_w_sum": rng.normal(600, 30, n) * 60, "power_w_max": np.full(n, 700.0),
            "util_sum": np.full(n, 95.0 * 60), "util_max": np.full(n, 100.0),
            "sm_clock_mhz_sum": clock * 60, "sm_clock_mhz_max": clock, "sm_clock_mhz_min": clock - rng.uniform(0, 60, n),
            "mem_used_mb_max": np.full(n, 70_000.0), "throttle_reasons_max": zeros,
            "ecc_dbe_min": dbe, "ecc_dbe_max": dbe,
        }
        for name in gpu_schema.names:
            if name not in cols:
                cols[name] = zeros
        table = pa.table({f.name: pa.array(cols[f.name], f.type) if not isinstance(cols[f.name], pa.Array)
                          else cols[f.name] for f in gpu_schema}, schema=gpu_schema)
        hour_index = int((START + hour * 3600) // 3600)
        write_parquet_atomic(lake / hour_path("gpu_1m", hour_index) / "bench.parquet", table)
        rows += table.num_rows
        # steps_1m: one row per rank and minute with progress
        live = mins[~down[mins]]
        if len(live):
            ranks = np.arange(NODES * GPUS)
            r_col = np.repeat(ranks, len(live))
            m_col = np.tile(live, len(ranks))
            n_steps = steps_per_min[m_col]
            dur = rng.normal(1.95, 0.05, len(r_col))
            st = pa.table({
                "job": pa.array(np.full(len(r_col), JOB, dtype=object), pa.string()), "rank": r_col,
                "node": pa.array(node_names[r_col // GPUS], pa.string()), "minute": START + m_col * 60.0,
                "n": n_steps, "duration_s_sum": dur * n_steps, "duration_s_max": dur + 0.1,
                "duration_s_min": dur - 0.1, "tokens_sum": n_steps * 65536,
                "step_min": cum_steps[m_col], "step_max": cum_steps[m_col + 1] - 1,
            }, schema=steps_schema)
            write_parquet_atomic(lake / hour_path("steps_1m", hour_index) / "bench.parquet", st)
    return rows


def write_raw(lake: Path, days: int, incidents: list[dict[str, Any]], rng: np.random.Generator, *,
              raw_gpu_s: int, step_incidents: int) -> dict[str, int]:
    writer = LakeWriter(lake)
    counts: dict[str, int] = {}
    topo = Topology.packed(8, 8, 16, job=JOB, node_fmt="n{:04d}")
    writer.write("jobs", [schema.JobTopology(ts=START, job=JOB, tp=8, pp=8, dp=16, ranks=topo.to_job_dict()["ranks"])])
    end = START + days * 86400
    # raw GPU samples, 1 Hz, every GPU, the last raw_gpu_s seconds
    gs = schema.lake_schema("gpu")
    t = np.arange(end - raw_gpu_s, end, 1.0)
    n = len(t) * NODES * GPUS
    ts_col = np.repeat(t, NODES * GPUS)
    node_col = np.tile(np.repeat(np.arange(NODES), GPUS), len(t))
    cols: dict[str, Any] = {"ts": ts_col, "node": np.array([node_name(i) for i in range(NODES)], dtype=object)[node_col],
                            "job": np.full(n, JOB, dtype=object), "gpu": np.tile(np.arange(GPUS), len(t) * NODES),
                            "temp_c": rng.normal(62, 3, n), "power_w": rng.normal(600, 30, n), "util": np.full(n, 95.0),
                            "sm_clock_mhz": np.full(n, 1980.0), "v": np.ones(n, dtype=np.int64)}
    def filler(f: pa.Field) -> pa.Array:
        if pa.types.is_boolean(f.type):
            return pa.array(np.zeros(n, dtype=bool))
        if pa.types.is_string(f.type):
            return pa.array(np.full(n, "", dtype=object), pa.string())
        return pa.array(np.zeros(n), f.type)

    table = pa.table({f.name: pa.array(cols[f.name], f.type) if f.name in cols else filler(f) for f in gs}, schema=gs)
    writer.write_table("gpu", table)
    counts["gpu (raw, 1 Hz)"] = n
    # kernel: the incidents' lines plus routine noise
    kernel = []
    for inc in incidents:
        ts = START + inc["minute"] * 60
        if inc["xid"]:
            kernel.append(schema.KernelEvent(ts=ts, node=node_name(inc["node"]), kind="xid", xid=inc["xid"],
                                             gpu=inc["gpu"], raw=f"NVRM: Xid (PCI:0000:{16 + inc['gpu']:02x}:00): {inc['xid']}, pid=1, name=python"))
    noise_ts = np.sort(rng.uniform(START, end, 20_000 * days // 7 + 1000))
    kernel += [schema.KernelEvent(ts=float(x), node=node_name(int(rng.integers(NODES))), kind="other",
                                  raw="EXT4-fs (nvme0n1p2): re-mounted. Quota mode: none.") for x in noise_ts]
    writer.write("kernel", kernel)
    counts["kernel"] = len(kernel)
    # incidents (two versions each), actions, statuses, watchdog lines
    incs, acts, stats, nccl = [], [], [], []
    for inc in incidents:
        ts = START + inc["minute"] * 60
        node = node_name(inc["node"])
        rank = inc["node"] * GPUS + inc["gpu"]
        ev = [{"ts": ts, "source": "kernel", "node": node, "text": f"{inc['kind']} evidence on {node}"}]
        sus = [{"node": node, "gpu": inc["gpu"], "ranks": [rank], "score": 0.95, "reason": f"{inc['kind']} on {node}"}]
        base = schema.Incident(id=inc["id"], job=JOB, opened_ts=ts + 2, updated_ts=ts + 2, status="open",
                               category=inc["category"], kind=inc["kind"], title=f"{inc['kind']} on {node}",
                               severity="critical" if inc["gap_min"] else "warning", confidence=0.95,
                               suspects=sus, evidence=ev)
        incs += [base, schema.Incident(**{**schema.to_dict(base), "updated_ts": ts + 600, "status": "resolved"})]
        acts.append(schema.Action(id=f"act-{inc['id']}", incident_id=inc["id"], job=JOB, ts=ts + 3, type="evict_nodes",
                                  nodes=[node], suspects=sus, evidence=ev, confidence=0.95))
        stats.append(schema.ActionStatus(ts=ts + 4, action_id=f"act-{inc['id']}", job=JOB, adapter="dry-run", status="dry_run"))
        nccl += [schema.NcclEvent(ts=ts + 600, node=node_name(r // GPUS), kind="watchdog_timeout", rank=r, job=JOB,
                                  raw=f"[rank{r}] Watchdog caught collective operation timeout") for r in range(0, 1024, 8)]
    for kind, recs in (("incidents", incs), ("actions", acts), ("action-status", stats), ("nccl", nccl)):
        writer.write(kind, recs)
        counts[kind] = len(recs)
    # stacks of every rank for the first incident; raw steps around the benchmarked ones
    first = incidents[0]
    ts0 = START + first["minute"] * 60
    bad = first["node"] * GPUS + first["gpu"]
    stacks = [schema.StackDump(ts=ts0 + 60, job=JOB, node=node_name(r // GPUS), rank=r, pid=1000 + r,
                               text=f"Thread {1000 + r} (active): \"MainThread\"\n    "
                               + ("synchronize (torch/cuda/__init__.py:801)" if r == bad
                                  else "all_reduce (torch/distributed/distributed_c10d.py:2050)")
                               + "\n    train (megatron/training.py:904)\n") for r in range(1024)]
    writer.write("stacks", stacks)
    counts["stacks"] = len(stacks)
    steps_rows = 0
    sschema = schema.lake_schema("steps")
    for inc in incidents[:step_incidents]:
        onset = START + inc["minute"] * 60
        t = np.arange(onset - 1800, onset, 2.0)  # the job stops at the onset
        ranks = np.arange(1024)
        n = len(t) * len(ranks)
        sum_len = rng.integers(40_000, 70_000, len(t))
        sq = sum_len.astype(np.int64) * 4096
        dur = 1.2 + sum_len * 1e-5 + sq * 1e-12
        step0 = int((onset - START) / 2)
        cols = {"ts": np.repeat(t, 1024), "job": np.full(n, JOB, dtype=object), "rank": np.tile(ranks, len(t)),
                "node": np.array([node_name(r // GPUS) for r in ranks], dtype=object)[np.tile(ranks, len(t))],
                "step": np.repeat(step0 + np.arange(len(t)), 1024),
                "duration_s": np.repeat(dur, 1024) * rng.uniform(0.98, 1.02, n),
                "n_seqs": np.repeat(rng.integers(12, 20, len(t)), 1024), "sum_len": np.repeat(sum_len, 1024),
                "sum_len_sq": np.repeat(sq, 1024), "tokens": np.repeat(sum_len, 1024)}
        cols["v"] = np.ones(n, dtype=np.int64)
        table = pa.table({f.name: pa.array(cols[f.name], f.type) if f.name in cols else pa.nulls(n, f.type)
                          for f in sschema}, schema=sschema)
        writer.write_table("steps", table)
        steps_rows += n
    counts["steps (raw, around incidents)"] = steps_rows
    return counts


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1000)
    samples.sort()
    p95 = samples[min(len(samples) - 1, int(round(0.95 * (len(samples) - 1))))]
    return statistics.median(samples), p95


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 day, fewer repeats (under a minute)")
    ap.add_argument("--smoke", action="store_true", help="1 day, one repeat (seconds): does it still run")
    ap.add_argument("--days", type=int, default=None, help="days of data (default 7, quick 1)")
    ap.add_argument("--data", default=None, help="lake directory to (re)use; generated when missing")
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args()
    args.quick = args.quick or args.smoke
    days = args.days or (1 if args.quick else 7)
    repeats = args.repeats or (1 if args.smoke else 5 if args.quick else 20)
    rng = np.random.default_rng(8)
    incidents = make_incidents(days, rng)
    tmp = None
    lake = Path(args.data) if args.data else Path(tmp := tempfile.mkdtemp(prefix="ui-bench-")) / "lake"
    generated: dict[str, int] = {}
    if not (lake / "gpu_1m").is_dir():
        t0 = time.perf_counter()
        generated["gpu_1m (rollup rows)"] = write_rollups(lake, days, incidents, rng)
        generated.update(write_raw(lake, days, incidents, rng, raw_gpu_s=600 if args.quick else 3600,
                                   step_incidents=1 if args.quick else 3))
        print(f"generated {days} day(s) in {time.perf_counter() - t0:.0f} s under {lake}", file=sys.stderr)
    con = views.connect(lake)
    gpu_1m_rows = con.sql("SELECT count(*) FROM gpu_1m_parts").fetchall()[0][0]
    inc = views.incident(con, incidents[0]["id"])
    node = node_name(incidents[0]["node"])
    week = (START, START + days * 86400)
    cases: list[tuple[str, Callable[[], Any]]] = [
        ("connect (views; UI caches it 60 s)", lambda: views.connect(lake).close()),
        ("overview: jobs", lambda: views.jobs(con)),
        ("overview: incidents", lambda: views.incidents(con)),
        ("overview: open by severity", lambda: views.open_incidents_by_severity(con)),
        ("overview: actions", lambda: views.actions(con)),
        ("overview: actions summary", lambda: views.actions_summary(con)),
        ("overview: fleet health (last hour)", lambda: views.fleet_health(con, lake_path=lake)),
        ("overview: ETTR per job", lambda: views.ettr(con)),
        ("incident: incident", lambda: views.incident(con, inc["id"])),
        ("incident: evidence timeline", lambda: views.evidence_timeline(con, inc)),
        ("incident: topology grid", lambda: views.topology_grid(con, inc)),
        ("incident: stack groups", lambda: views.stack_groups(con, inc)),
        ("incident: step time vs predicted", lambda: views.step_prediction(con, JOB, onset_ts=float(inc["opened_ts"]))),
        ("incident: actions", lambda: views.actions(con, incident_id=inc["id"])),
        ("machine: machines", lambda: views.machines(con)),
        *[(f"machine: heatmap {m}", (lambda m=m: views.gpu_heatmap(con, node, m))) for m in
          ("temp_c_max", "sm_clock_mhz_min", "power_w_avg", "ecc_dbe_delta", "nvlink_errors_delta", "pcie_replay_delta")],
        ("machine: kernel events", lambda: views.kernel_events(con, node)),
        ("machine: incident history", lambda: views.node_incidents(con, node)),
        ("labels: incident choices", lambda: views.incident_choices(con)),
        ("labels: labels", lambda: views.labels(con)),
    ]
    results = []
    for name, fn in cases:
        fn()  # warm: first touch of the files
        p50, p95 = timed(fn, repeats)
        results.append((name, p50, p95))
    t0 = time.perf_counter()
    html = report.render_report(lake, JOB, *week)
    report_s = time.perf_counter() - t0
    con.close()

    print(f"ui_queries: {days} day(s) of a {NODES * GPUS}-GPU job; {repeats} repeats per query")
    print("generated (rows):" if generated else f"reused data under {lake}")
    for k, v in generated.items():
        print(f"  {k:<34} {v:>12,}")
    print(f"{'query':<40} {'p50 ms':>9} {'p95 ms':>9}")
    for name, p50, p95 in results:
        print(f"{name:<40} {p50:>9.1f} {p95:>9.1f}{'   OVER 1 s' if p95 > 1000 else ''}")
    print(f"{'report (HTML, whole range)':<40} {report_s * 1000:>9.0f}   ({len(html) // 1024} KiB)")
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    worst = max(results, key=lambda r: r[2])
    print(json.dumps({"bench": "ui_queries", "days": days, "gpus": NODES * GPUS,
                      "gpu_1m_rows": gpu_1m_rows, "p95_ms_max": round(worst[2], 1),
                      "p95_worst_query": worst[0], "report_s": round(report_s, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
