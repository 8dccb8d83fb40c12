"""Months: a 64-node fleet through 90 simulated days, every store's size per day (issue 37.2).

Time-compressed: the clocks are advanced, never slept. Each round of simulated time (an hour; twelve
with --quick), in this one process, through each store's own code:

* agents (one per node): the hour's GPU samples and step records appended to the node's spool
  (collectors/spool.py, ``Spool``), delivered, then kept in the node's sent spool for the resend
  window (``drop_older_than``: the window is far shorter than an hour);
* the stream processor: what was delivered written to the Parquet lake (``LakeWriter``), its
  natural keys taken (``SeqLedger``) and committed as ``_seq/s-<commit>.json`` under a commit id
  stamped with the simulated time; once a simulated day, retention (``apply_retention``, the
  ``[retention]`` below at the simulated ``now``) and the ``_seq`` fold (``compact_seq_files``);
* diagnosis: faults drawn at the campaign's rates (datasets/failure_mix.toml: failures per 10^6
  GPU-hours, Poisson per hour) become an eviction claimed on the guard log (``LocalGuardLog``, a
  file) and an action signed with the diagnosis key (the signing clock is the simulated one);
  one in ten is decided by a pipeline that fell behind (its evidence 45 s old, delivered 30 s
  later: past the 60 s window);
* the runner: ``ActionRunner.handle`` on each action (dry-run adapter, ledger file, the simulated
  clock), every action delivered twice (a redelivery, half of them across a runner restart); the
  action and its status written to the lake.

Every service is "restarted" along the way (its objects dropped and rebuilt from their files):
agents every 5 days (a new epoch), the processor every 3, diagnosis (the guard log reopened)
every 4, the runner at half the redeliveries. Measured: each store's bytes at the end of each
simulated day, this process's RSS (one process holds every store here: the real services' RSS
under restarts is benchmarks/soak.py's), step records lost (emitted against lake rows, day by
day before retention), actions doubled (a redelivery not recognised), stale actions executed,
handled actions missing from the lake.

What this does not cover: a broker (none here; benchmarks/soak.py kills the real one), and the
resend of diagnosis outputs after a broker loses them (issue 37.4, not built).

    nice python benchmarks/months.py --quick   # 90 days, 64 nodes, a sample an hour
    nice python benchmarks/months.py           # 90 days, 64 nodes, a sample every 5 minutes

``growth_after_window``: a store's largest size over the last 30 days against its largest over
days 8-37, minus 1 (largest, because compaction makes a saw). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import resource
import shutil
import tempfile
import time
import tomllib
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq

from faultlens import datasets, schema
from faultlens.collectors.spool import Spool
from faultlens.config import Config, GuardConfig, KeysConfig, RetentionConfig, RunnerConfig
from faultlens.diagnosis.guardlog import LocalGuardLog
from faultlens.diagnosis.runner.runner import ActionRunner
from faultlens.stream.decode_arrow import decode_batch
from faultlens.stream.dedupe import SEQ_DIR, SeqLedger, compact_seq_files
from faultlens.stream.lake import LakeWriter
from faultlens.stream.retention import apply_retention
from faultlens.stream.signing import Ed25519Key, Keyring, public_path, write_key

DAY_S = 86_400.0
T0 = 1_767_225_600.0  # 2026-01-01 00:00 UTC
NODES = 64
GPUS = 8
KEEP_DAYS = 7  # every lake table (the bench's [retention]); the goal is flat after day 7
STORES = ("lake", "seq", "ledger", "guard_log", "spools")


@dataclass
class Message:
    """A delivered record as the processor's decoder takes it (a consumer record's fields)."""

    offset: int
    key: bytes
    value: bytes
    headers: tuple[()] = ()


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def fault_rate_per_gpu_hour() -> float:
    """Every failure kind of the campaign's mix together (failures per GPU-hour): each kind takes its
    share of its category's rate (datasets/failure_mix.toml, as datasets.campaign.load_mix reads it)."""
    mix = tomllib.loads((Path(datasets.__file__).parent / "failure_mix.toml").read_text())
    cats = {name: c["rate_per_mgpuh"]["value"] for name, c in mix["category"].items()}
    return sum(cats[k["category"]] * _value(k.get("share", 1.0)) for k in mix["kind"].values()) / 1e6


def _value(v: Any) -> float:
    return float(v["value"] if isinstance(v, dict) else v)


class Agent:
    """One node's spools: what is not delivered yet, and what was sent (the resend window)."""

    def __init__(self, root: Path, node: str, now: float):
        self.node, self.root = node, root
        self.epoch = int(now * 1e6)
        self.seq = 0
        self.open()

    def open(self) -> None:
        self.spool = Spool(self.root / self.node / "spool", max_bytes=64 << 20)
        self.sent = Spool(self.root / self.node / "sent", max_bytes=64 << 20)

    def restart(self, now: float) -> None:
        self.spool.close()
        self.sent.close()
        self.epoch = int(now * 1e6)  # a new process: a new epoch, seqs from 1
        self.seq = 0
        self.open()

    def emit(self, kind: str, rows: list[dict[str, Any]]) -> None:
        entries: list[Any] = []
        for row in rows:
            self.seq += 1
            entries.append((kind, self.node, orjson.dumps(row), (self.epoch, self.seq)))
        self.spool.append(entries)

    def deliver(self) -> list[tuple[str, bytes, tuple[int, int]]]:
        out = []
        while True:
            entries, cursor = self.spool.peek(10_000)
            if not entries:
                return out
            out.extend((e[0], e[2], e[3]) for e in entries)  # type: ignore[misc]
            self.sent.append(list(entries))
            self.spool.commit(cursor, len(entries))
            self.sent.drop_older_than(time.time())  # the resend window (10 min) is past by the next hour


def gpu_row(node: str, ts: float, rng: random.Random) -> dict[str, Any]:
    return {"v": 1, "ts": ts, "node": node, "gpus": [
        {"index": g, "uuid": f"GPU-{node}-{g}", "util": rng.randint(90, 100), "temp_c": rng.randint(55, 75),
         "power_w": float(rng.randint(550, 700)), "mem_used_mb": 70_000, "sm_clock_mhz": 1980,
         "ecc_sbe": 0, "ecc_dbe": 0} for g in range(GPUS)]}


def step_row(node: str, rank: int, step: int, ts: float) -> dict[str, Any]:
    return {"v": 1, "ts": ts, "job": "j-months", "rank": rank, "node": node, "step": step, "duration_s": 1.02,
            "n_seqs": 8, "sum_len": 32_768, "sum_len_sq": 134_217_728, "tokens": 32_768}


def lake_rows(lake: Path, table: str, day: float) -> int:
    date = time.strftime("%Y-%m-%d", time.gmtime(day))
    files = sorted((lake / table / f"date={date}").glob("hour=*/*.parquet"))
    return sum(pq.ParquetFile(f).metadata.num_rows for f in files)


def main() -> None:  # noqa: PLR0915 - one script, read top to bottom
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a sample every simulated hour")
    ap.add_argument("--smoke", action="store_true", help="seconds: 8 nodes, 10 days, --quick's sampling, faults x50 (tests)")
    ap.add_argument("--days", type=int, default=90)
    ap.add_argument("--nodes", type=int, default=NODES)
    ap.add_argument("--fault-scale", type=float, default=1.0, help="multiply the campaign's fault rates")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--dir", default="", help="work directory (default: a temporary one, removed)")
    args = ap.parse_args()
    if args.smoke:
        args.quick, args.days, args.nodes, args.fault_scale = True, 10, 8, 50.0  # faults: ~17 in 10 days
    logging.getLogger("faultlens").setLevel(logging.ERROR)  # the runner's refusals are counted below
    every_s = 3600.0 if args.quick else 300.0
    round_h = 12 if args.quick else 1  # the agents deliver and the processor commits once a round
    span_s = round_h * 3600.0
    rng = random.Random(args.seed)
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="faultlens-months-"))
    work.mkdir(parents=True, exist_ok=True)
    lake = work / "lake"
    clock = Clock(T0)
    started, cpu0 = time.monotonic(), time.process_time()

    key = Ed25519Key.from_seed("months", bytes(range(32)))
    pub = write_key(key.public_half(), public_path(work / "months.toml"), force=True)
    signer = Keyring([key], clock=clock)
    config = Config(runner=RunnerConfig(adapter="dry-run", state_path=str(work / "ledger.jsonl")),
                    keys=KeysConfig(files=(str(pub),)),
                    guard=GuardConfig(state_path=str(work / "guard.jsonl")),
                    retention=RetentionConfig(max_age_days=KEEP_DAYS, lock_wait_s=1.0,
                                              seq_keep_s=DAY_S))
    nodes = [f"n{i:03d}" for i in range(args.nodes)]
    agents = {n: Agent(work / "agents", n, clock.t) for n in nodes}
    writer = LakeWriter(lake)
    marks = SeqLedger()
    committed: set[str] = set()
    guard = LocalGuardLog(config.guard, config.guard.state_path)
    runner = ActionRunner(config, clock=clock)
    rate_per_hour = fault_rate_per_gpu_hour() * len(nodes) * GPUS * args.fault_scale
    counts = dict(steps_emitted=0, steps_in_lake=0, faults=0, actions=0, redelivered=0, actions_doubled=0,
                  stale_sent=0, stale_actions_executed=0, handled=0, runner_restarts=0, agent_restarts=0,
                  processor_restarts=0, diagnosis_restarts=0, handled_missing_from_lake=0)
    handled_ids: list[str] = []
    emitted_by_day: dict[int, int] = {}
    sizes: dict[str, list[int]] = {s: [] for s in STORES}
    rss: list[float] = []
    step = 0

    print(f"months: {len(nodes)} nodes x {GPUS} GPUs, {args.days} simulated days, a sample every {every_s:g} s, "
          f"faults {rate_per_hour * 24:.3f}/day (campaign mix x {args.fault_scale:g}), lake kept {KEEP_DAYS} days")
    print(f"{'day':>4} {'lake MB':>8} {'_seq kB':>8} {'ledger kB':>9} {'guard kB':>8} {'spools kB':>9} "
          f"{'RSS MB':>7} {'faults':>6}")
    for day in range(args.days):
        day_start = T0 + day * DAY_S
        for r in range(24 // round_h):
            h0 = day_start + r * span_s
            # agents: the round's samples and steps, spooled, delivered
            ticks = [h0 + k * every_s for k in range(int(span_s // every_s))]
            for rank, n in enumerate(nodes):
                a = agents[n]
                a.emit("gpu", [gpu_row(n, t, rng) for t in ticks])
                a.emit("steps", [step_row(n, rank, step + k, t) for k, t in enumerate(ticks)])
            step += len(ticks)
            clock.t = h0 + span_s - 1.0
            by_kind: dict[str, list[Message]] = {"gpu": [], "steps": []}
            touched = set()
            for n in nodes:
                for kind, value, (epoch, seq) in agents[n].deliver():
                    key_ = (n, epoch, kind)
                    if marks.take(key_, seq):  # the processor keeps each natural key once
                        by_kind[kind].append(Message(len(by_kind[kind]), n.encode(), value))
                        touched.add(key_)
            counts["steps_emitted"] += len(ticks) * len(nodes)
            emitted_by_day[day] = emitted_by_day.get(day, 0) + len(ticks) * len(nodes)
            for kind, msgs in by_kind.items():  # the processor's decoder (stream/decode_arrow.py)
                decoded = decode_batch(kind, f"faultlens.{kind}", 0, msgs)
                assert not decoded.dead, decoded.dead[:1]
                for table, rows in decoded.tables.items():
                    writer.write_table(table, rows)
            commit_id = f"{int(clock.t * 1e9):x}{uuid.uuid4().hex[:8]}"
            marks.write(lake, commit_id, touched, {"faultlens.gpu": "t", "faultlens.steps": "t"})
            committed.add(commit_id)
            # diagnosis and the runner: faults at the campaign's rates
            for _ in range(_poisson(rng, rate_per_hour * round_h)):
                counts["faults"] += 1
                node = rng.choice(nodes)
                ts = h0 + rng.uniform(0, span_s)
                clock.t = max(clock.t, ts)
                inc = f"inc-{counts['faults']}"
                verdict = guard.claim(f"act-{inc}", job="j-months", nodes=[node], ts=ts, job_nodes=len(nodes))
                behind = rng.random() < 0.1
                action = schema.Action(
                    id=f"act-{inc}", incident_id=inc, job="j-months", ts=clock.t,
                    type="evict_nodes" if verdict.granted else "notify", nodes=[node], confidence=0.99,
                    dry_run=True, reason="Xid 79 (months)", evidence_age_s=45.0 if behind else 2.0,
                    consumer_lag_s=45.0 if behind else 1.0, evidence_window_s=60.0)
                value = orjson.dumps(signer.sign(schema.cloudevent(action)))
                clock.t += 30.0 if behind else 1.0  # on the bus
                out = runner.handle(value)
                counts["actions"] += 1
                status = out.status
                if status is not None:
                    counts["handled"] += 1
                    handled_ids.append(action.id)
                    writer.write("actions", [action])
                    writer.write("action-status", [status])
                    if behind and action.type != "notify":
                        counts["stale_sent"] += 1
                        counts["stale_actions_executed"] += status.status != "refused"
                if rng.random() < 0.5:
                    runner = ActionRunner(config, clock=clock)
                    counts["runner_restarts"] += 1
                again = runner.handle(value)  # a redelivery (a rebalance, a commit lost to a crash)
                counts["redelivered"] += 1
                counts["actions_doubled"] += not again.duplicate
            if guard.book.fleet_breaker is not None or guard.book.job_breakers:
                guard.reset("fleet", by="months", reason="simulated person")
                for job in list(guard.book.job_breakers):
                    guard.reset("job", job=job, by="months", reason="simulated person")
        # end of the simulated day: check yesterday's steps in the lake, then retention
        clock.t = day_start + DAY_S
        counts["steps_in_lake"] += lake_rows(lake, "steps", day_start)
        missing = [a for a in handled_ids if a not in _lake_action_ids(lake)]
        counts["handled_missing_from_lake"] += len(missing)
        handled_ids = []
        apply_retention(lake, config.retention, now=clock.t)
        compact_seq_files(lake, committed, now=clock.t, keep_s=config.retention.seq_keep_s)
        committed = {p.stem[2:] for p in (lake / SEQ_DIR).glob("s-*.json")}
        # restarts along the way
        if day % 5 == 4:
            for a in agents.values():
                a.restart(clock.t)
            counts["agent_restarts"] += 1
        if day % 3 == 2:
            writer = LakeWriter(lake)
            marks = SeqLedger.load(lake, committed)
            counts["processor_restarts"] += 1
        if day % 4 == 3:
            guard = LocalGuardLog(config.guard, config.guard.state_path)
            counts["diagnosis_restarts"] += 1
        store_bytes = {
            "lake": dir_bytes(lake) - dir_bytes(lake / SEQ_DIR),
            "seq": dir_bytes(lake / SEQ_DIR),
            "ledger": (work / "ledger.jsonl").stat().st_size if (work / "ledger.jsonl").exists() else 0,
            "guard_log": (work / "guard.jsonl").stat().st_size if (work / "guard.jsonl").exists() else 0,
            "spools": dir_bytes(work / "agents"),
        }
        for s in STORES:
            sizes[s].append(store_bytes[s])
        rss.append(rss_mb())
        if day < 10 or day % 10 == 9 or day == args.days - 1:
            print(f"{day + 1:>4} {store_bytes['lake'] / 1e6:>8.1f} {store_bytes['seq'] / 1e3:>8.1f} "
                  f"{store_bytes['ledger'] / 1e3:>9.1f} {store_bytes['guard_log'] / 1e3:>8.1f} "
                  f"{store_bytes['spools'] / 1e3:>9.1f} {rss[-1]:>7.0f} {counts['faults']:>6}")

    wall_s, cpu_s = time.monotonic() - started, time.process_time() - cpu0
    counts["steps_lost"] = counts["steps_emitted"] - counts["steps_in_lake"]
    growth = {s: _growth(v) for s, v in sizes.items()}
    growth["rss"] = _growth([int(r * 1e6) for r in rss])
    # steady: the largest size over the last 30 days, per node; the lake's also per day it keeps
    per_node = {s: round(max(v[-30:]) / len(nodes), 1) for s, v in sizes.items()}
    lake_per_node_day = round(per_node["lake"] / KEEP_DAYS, 1)
    print()
    print(f"{'store':<10} {'growth after window':>20} {'largest (kB)':>13} {'steady bytes per node':>22}")
    for s in STORES:
        print(f"{s:<10} {growth[s]:>20.3f} {max(sizes[s]) / 1e3:>13.1f} {per_node[s]:>22.1f}")
    print(f"lake: {lake_per_node_day:.0f} bytes per node-day at this sampling ({GPUS} GPUs, a sample and a step "
          f"record every {every_s:g} s), kept {KEEP_DAYS} days")
    print(f"{'rss':<10} {growth['rss']:>20.3f} {max(rss):>13.0f} MB")
    print(f"steps emitted {counts['steps_emitted']}, in the lake {counts['steps_in_lake']}; faults {counts['faults']}, "
          f"actions {counts['actions']} (redelivered {counts['redelivered']}, doubled {counts['actions_doubled']}); "
          f"stale sent {counts['stale_sent']}, executed {counts['stale_actions_executed']}; restarts: agents "
          f"{counts['agent_restarts']}, processor {counts['processor_restarts']}, diagnosis "
          f"{counts['diagnosis_restarts']}, runner {counts['runner_restarts']}; {wall_s:.0f} s wall, {cpu_s:.0f} s CPU")
    result = {"bench": "months", "quick": args.quick, "smoke": args.smoke, "nodes": len(nodes), "days": args.days,
              "growth_after_window": {s: round(g, 4) for s, g in growth.items()},
              "flat": all(growth[s] <= 0.05 for s in STORES),
              "steady_bytes_per_node": per_node, "lake_bytes_per_node_day": lake_per_node_day,
              "steps_lost": counts["steps_lost"], "actions_doubled": counts["actions_doubled"],
              "stale_actions_executed": counts["stale_actions_executed"],
              "handled_actions_missing_from_lake": counts["handled_missing_from_lake"],
              "faults": counts["faults"], "actions": counts["actions"], "stale_sent": counts["stale_sent"],
              "peak_rss_mb": round(max(rss), 1), "wall_s": round(wall_s, 1), "cpu_s": round(cpu_s, 1)}
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))


def _poisson(rng: random.Random, lam: float) -> int:
    n, p, limit = 0, 1.0, math.exp(-lam)
    while True:
        p *= rng.random()
        if p <= limit:
            return n
        n += 1


def _growth(values: list[int], floor: int = 4096) -> float:
    """The largest size over the last 30 days against the largest over days 8-37, minus 1; a store
    smaller than ``floor`` bytes (a file system block) is judged against the floor, so that one more
    action in a ledger of three is not read as growth."""
    if len(values) < 45:
        late, early = values[-7:], values[7:14] or values
    else:
        late, early = values[-30:], values[7:37]
    return (max(late) - max(early)) / max(max(early), floor)


def _lake_action_ids(lake: Path) -> set[str]:
    files = list((lake / "action_status").rglob("*.parquet"))
    if not files:
        return set()
    return set(pq.ParquetDataset([str(f) for f in files]).read(columns=["action_id"]).column("action_id").to_pylist())


if __name__ == "__main__":
    main()
