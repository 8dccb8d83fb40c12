"""Online diagnosis scale-out on the embedded broker: throughput, failover, latency, kill -9 counts.

Every diagnosis instance and the runner are separate processes (``worker``
mode of this script), as in production; this process feeds the fleet
(tests/fleetgen: jobs of 8 nodes x 8 GPUs plus nodes outside any job) and
watches the output topics.

1. throughput: 120 s (``--quick``: 600 s) of the fleet's records (NVML samples as the agent sends
   them, MessagePack column-major, and step timings), drained by 1, 2 or 4
   instances: records/s in all and per instance, the partition balance, and
   records per busy second three ways: per wall second in the handler, per CPU
   second of the handler's thread (what a dedicated core would take) and per CPU
   second of the whole worker process (client threads too). ``--feed backlog``
   (the default): the instances join and take their partitions with their
   fetching held (a gate file the workers watch), the backlog is written, then
   the gate opens: every instance drains a backlog, as after an outage, so busy
   seconds measure what an instance can do. ``--feed in-turn``: the same
   backlog, the instances let in one at a time (each drains what it can alone
   and is held again, twice round): on a machine with fewer cores than instances this is
   how busy seconds say what a core per instance gives (together, four instances
   on two cores wait for a core inside their handlers); its records/s is no
   drain rate. ``--feed live``: the backlog is
   written while the instances run; then they keep up with this one Python
   feeder, poll ~100 records a round and the figures measure the feeder and the
   per-round work as much as the instances. The machine has 2 cores: past 2
   instances the sum cannot grow, and wall busy seconds count the waits for a core;
2. scale-out latency: a live fleet at 1 Hz, one instance, then 2, then 4; a Xid
   79 every second on a fresh node -> its action on the actions topic: p50/p99;
3. failover: one instance killed (kill -9) -> a Xid on a job it owned -> the
   action: time to diagnose its jobs again (``members``: the dead member's
   heartbeats time out, its partitions are taken and restored; ``group``: the
   session timeout, a rebalance and the restores);
4. kill test: ``--kills`` x kill -9 of a diagnosis instance while incidents are
   open (an IB link down once before the kill, the repeat after it: the eviction
   needs the restored incident), and ``--kills`` x kill -9 of the runner's
   process group while an action's hook runs. Counted: actions lost, effects
   applied twice (the hook applies an effect once per action id, as drain or
   cordon do), hook runs repeated (a resumed in-flight step), incidents kept.

    python benchmarks/scaleout.py --quick   # 256 nodes, 2 kills each (~2.5 min: group joins and restarts take seconds)
    python benchmarks/scaleout.py           # 2,048 nodes, 10 kills each (~10 min)
    python benchmarks/scaleout.py --quick --membership group     # the consumer group (eager: kafka-python)
    python benchmarks/scaleout.py --quick --membership group --consumer confluent   # cooperative (stream/bus/librdkafka_consumer.py)
    python benchmarks/scaleout.py --quick --skip live,kill --feed live   # throughput while the backlog is written
    python benchmarks/scaleout.py --quick --skip live,kill --feed in-turn   # a core per instance, on any machine

Figures on a shared 2-core machine are pessimistic. Last line: one JSON object.
One script over ~500 lines: its worker mode and the four measurements share the fleet set-up.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from faultlens import lifeline  # noqa: E402 - after the path: children die with this script

HOOK = r'''import json, os, sys, time
event = json.load(sys.stdin)
aid = event["data"]["id"]
d = os.environ["SCALEOUT_DIR"]
with open(os.path.join(d, "hook-runs.log"), "a") as f:
    f.write(aid + "\n")
open(os.path.join(d, "hook-running"), "w").write(aid)
time.sleep(float(os.environ.get("SCALEOUT_HOOK_S", "0.4")))
effects = os.path.join(d, "effects.log")
done = set(open(effects).read().split()) if os.path.exists(effects) else set()
if aid not in done:  # idempotent by action id, as drain/cordon are
    with open(effects, "a") as f:
        f.write(aid + "\n")
        f.flush(); os.fsync(f.fileno())
'''


# --------------------------------------------------------------------------- workers (child processes)

def _config(args: argparse.Namespace) -> Any:
    from faultlens.config import (
        BusConfig,
        Config,
        DiagnosisConfig,
        GuardConfig,
        KeysConfig,
        RunnerConfig,
    )

    bus = BusConfig(bootstrap_servers=args.bootstrap, topic_prefix=args.prefix, linger_ms=2)
    # The caps are not what this measures: every eviction is expected to run. The fleet cap is shared by the
    # instances (the guard log): the full kill test's 20 evictions passed its default 16 (4 "lost" as notices).
    guard = GuardConfig(dry_run=False, max_evictions_per_job_per_hour=1000, storm_nodes=100_000, max_evicted_fraction=1.0,
                        max_evictions_fleet_per_hour=1_000_000)
    hook = f"{sys.executable} {args.dir}/hook.py"
    key = Path(args.dir) / "signing-key.toml"  # made by the test that runs a runner (kill_test)
    if args.role == "runner":
        key = Path(f"{key}.pub")  # the runner verifies with the public half; diagnosis signs with the private
    keys = KeysConfig(files=(str(key),)) if key.exists() else KeysConfig()
    # The runner's own caps are not what this measures: every eviction is expected to run.
    diag = DiagnosisConfig(group_id=f"{args.prefix}-diag", catalog_path="", max_evidence_age_s=0,  # fleetgen: fixed T0
                           consumer=os.environ.get("SCALEOUT_CONSUMER", "auto"),
                           membership=os.environ.get("SCALEOUT_MEMBERSHIP", "auto"),
                           producer=os.environ.get("SCALEOUT_PRODUCER", "auto"))
    return Config(bus=bus, diagnosis=diag, guard=guard,
                  runner=RunnerConfig(adapter="command", hook_command=hook, execute=True, group_id=f"{args.prefix}-run",
                                      state_path=f"{args.dir}/ledger.jsonl", max_action_age_s=1e9,
                                      max_actions_per_window=1_000_000, max_nodes_evicted_per_hour=1_000_000),
                  keys=keys)


def worker(args: argparse.Namespace) -> None:
    import logging

    logging.basicConfig(level=os.environ.get("SCALEOUT_LOG", "WARNING"), format="%(asctime)s %(name)s %(message)s")
    config = _config(args)
    if args.role == "runner":
        from faultlens.diagnosis.runner.runner import ActionRunner

        env = dict(os.environ, SCALEOUT_DIR=args.dir)
        ActionRunner(config, env=env).run(poll_ms=100)
        return
    from faultlens.diagnosis.online import DiagnosisService

    service = DiagnosisService(config, from_beginning=True, tick_interval_s=0.5, poll_timeout_ms=50)
    gate = os.environ.get("SCALEOUT_GATE")
    if gate:
        _hold_fetching(service, Path(gate))
    stats = Path(args.stats)

    def report() -> None:
        while True:
            r = service.repartitioner
            loop = service._diag_loop
            data = {"pid": os.getpid(), "t": time.time(), "applied": service.applied, "skipped": service.skipped,
                    "busy_s": loop.stats.busy_s if loop else 0.0, "polled": loop.stats.polled if loop else 0,
                    "batches": loop.stats.batches if loop else 0,
                    "busy_cpu_s": loop.stats.busy_cpu_s if loop else 0.0, "cpu_s": time.process_time(),
                    "forwarded": r.forwarded if r else 0, "partitions": sorted(service.partitions),
                    "jobs": sorted(k for k in list(service.states) if not k.startswith("~")),
                    "restores": service.restores[-32:], "produced": service.produced}
            tmp = stats.with_suffix(".tmp")
            tmp.write_text(json.dumps(data))
            tmp.replace(stats)
            time.sleep(0.25)

    threading.Thread(target=report, daemon=True).start()
    service.serve()


def _hold_fetching(service: Any, gate: Path) -> None:
    """While ``gate`` exists the service's consumer hands over nothing; membership goes on, so every
    instance holds its partitions when the backlog is let in. ``members``: no fetch at all (heartbeats
    on their own thread, takes and releases at each poll). A group consumer assigns inside its poll:
    it polls on with every assigned partition paused, and what a poll returned before its partitions
    were paused is kept for the first poll after the gate (nothing is dropped)."""
    from faultlens.diagnosis.online.membership import MemberConsumer

    make = service._consumer

    def consumer(gid: str) -> Any:
        c = make(gid)
        fetch = c.poll
        if isinstance(c, MemberConsumer):
            def poll(timeout_ms: int = 500, max_records: int = 10_000) -> list[Any]:
                if gate.exists():
                    c.rebalance()
                    time.sleep(timeout_ms / 1000)
                    return []
                return fetch(timeout_ms, max_records)
        else:
            kept: list[Any] = []
            paused: set[Any] = set()

            def poll(timeout_ms: int = 500, max_records: int = 10_000) -> list[Any]:
                if gate.exists():
                    held = set(c.raw.assignment()) - paused
                    if held:
                        c.raw.pause(*held)
                        paused.update(held)
                    kept.extend(fetch(timeout_ms, max_records))
                    return []
                if paused:
                    c.raw.resume(*(paused & set(c.raw.assignment())))
                    paused.clear()
                if kept:
                    out = kept[:]
                    kept.clear()
                    return out
                return fetch(timeout_ms, max_records)

        c.poll = poll
        return c

    service._consumer = consumer


# --------------------------------------------------------------------------- the coordinator

class Cluster:
    """Worker processes of one run, each in its own process group (this script started them)."""

    def __init__(self, bootstrap: str, prefix: str, workdir: Path):
        self.bootstrap, self.prefix, self.dir = bootstrap, prefix, workdir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._n = 0

    def start(self, role: str = "diag", env: dict[str, str] | None = None) -> str:
        self._n += 1
        name = f"{role}{self._n}"
        cmd = [sys.executable, str(Path(__file__).resolve()), "worker", "--role", role, "--bootstrap", self.bootstrap,
               "--prefix", self.prefix, "--dir", str(self.dir), "--stats", str(self.dir / f"{name}.json")]
        log = open(self.dir / f"{name}.log", "ab")
        self.procs[name] = lifeline.spawn(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                          env={**os.environ, **(env or {})})  # dies with this script
        return name

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker and its hook children: a machine crash
        except ProcessLookupError:
            pass
        proc.wait(10)

    def stats(self, name: str) -> dict[str, Any]:
        try:
            return json.loads((self.dir / f"{name}.json").read_text())
        except (OSError, ValueError):
            return {}

    def diag(self) -> list[str]:
        return [n for n in self.procs if n.startswith("diag")]

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.kill(name)


def wait_quiet(cluster: Cluster, name: str, quiet_s: float = 0.75, timeout_s: float = 120.0) -> None:
    """Until the instance's counts have not moved for ``quiet_s`` (its stats file is rewritten every 0.25 s)."""
    t0 = time.monotonic()
    last, since = None, time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        s = cluster.stats(name)
        now = (s.get("applied"), s.get("forwarded"), s.get("busy_s"))
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.1)


def wait_assigned(cluster: Cluster, names: list[str], partitions: int, timeout_s: float = 90.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        owned = [cluster.stats(n).get("partitions", []) for n in names]
        if all(owned) and sum(len(o) for o in owned) == partitions:
            return time.monotonic() - t0
        time.sleep(0.2)
    return float("nan")


class ActionWatch:
    """Actions seen on the actions topic, with arrival time, in a thread."""

    def __init__(self, bus: Any):
        from faultlens.stream.bus import Consumer

        self.consumer = Consumer(bus, ["actions"], group_id=None)
        self.seen: dict[str, list[tuple[float, Any]]] = {}  # node -> [(arrival, action)]
        self.ids: dict[str, int] = {}
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from faultlens import schema

        while not self._stop.is_set():
            for m in self.consumer.poll(50):
                a = schema.decode("actions", m.value)
                now = time.time()
                self.ids[a.id] = self.ids.get(a.id, 0) + 1
                for n in a.nodes:
                    self.seen.setdefault(n, []).append((now, a))

    def first(self, node: str) -> float | None:
        hits = self.seen.get(node)
        return hits[0][0] if hits else None

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.consumer.close()


def live_feed(producer: Any, fl: Any, stop: threading.Event, rate_hz: float = 1.0) -> threading.Thread:
    """NVML samples of every node at ``rate_hz``, stamped with wall time."""
    from faultlens.schema import GpuSample

    gpus = fl.records[0].gpus

    def run() -> None:
        while not stop.is_set():
            t = time.time()
            for n in fl.nodes:
                producer.send(GpuSample(ts=time.time(), node=n, gpus=gpus))
            producer.flush(10)
            stop.wait(max(0.0, 1.0 / rate_hz - (time.time() - t)))

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def throughput(broker: Any, base: Path, nodes: int, seconds: int, counts: list[int],
               feed: str = "backlog") -> list[dict[str, Any]]:
    from faultlens.config import BusConfig
    from faultlens.decode import encode_wire
    from faultlens.stream.bus import Producer, ensure_topics
    from faultlens.stream.topics import REPARTITION_PARTITIONS
    from tests import fleetgen

    out = []
    fl = fleetgen.fleet(jobs=nodes // 8, nodes_per_job=8, unjobbed=0, duration_s=seconds, gpu_interval_s=1.0,
                        faulty_jobs=0, t0=time.time() - seconds)
    for n in counts:
        prefix = f"tp{n}"
        work = base / prefix
        work.mkdir()
        bus = BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix=prefix, linger_ms=20)
        ensure_topics(bus)
        total = len(fl.records)
        cluster = Cluster(broker.bootstrap, prefix, work)
        held = feed in ("backlog", "in-turn")
        gates = [work / f"gate{i}" for i in range(n)]
        for gate in gates if held else ():
            gate.touch()  # the instance joins and takes its partitions, fetching nothing until it goes
        names = [cluster.start(env={"SCALEOUT_GATE": str(gate)} if held else None) for gate in gates]
        # Every instance joins and takes its partitions first, then the backlog is written: a backlog
        # written before the joins was drained by the first instance alone while the others joined
        # (the rate over the drain then read 0 records/s for 2 and 4 instances).
        join_s = wait_assigned(cluster, names, REPARTITION_PARTITIONS)
        with Producer(bus) as p:
            for r in fl.topologies:
                p.send(r)
            p.flush(30)
            if held:
                values = [encode_wire(r) for r in fl.records]  # what the agent sends: MessagePack, GPU samples
                for r, v in zip(fl.records, values, strict=True):  # columnar
                    p.send(r, value=v)
                p.flush(120)
                time.sleep(0.5)  # a fresh stats file (written every 0.25 s) for the CPU baseline
                before = [cluster.stats(x) for x in names]
                t0 = time.monotonic()
                if feed == "in-turn":
                    # Each alone in turn (held again after): what it can drain of its input and of its
                    # partitions; a second turn each for what the later ones forwarded to the earlier.
                    for _ in range(2):
                        for name, gate in zip(names, gates, strict=True):
                            gate.unlink()
                            wait_quiet(cluster, name)
                            gate.touch()
                for gate in gates:
                    gate.unlink()
            else:
                time.sleep(0.5)
                before = [cluster.stats(x) for x in names]
                t0 = time.monotonic()
                for r in fl.records:
                    p.send(r, value=encode_wire(r))
                p.flush(120)
        marks: list[tuple[float, int]] = [(t0, 0)]
        while time.monotonic() - t0 < 300:
            applied = sum(cluster.stats(x).get("applied", 0) for x in names) - len(fl.topologies)
            marks.append((time.monotonic(), applied))
            if applied >= total:
                break
            time.sleep(0.1)
        per = [cluster.stats(x) for x in names]
        cluster.stop_all()
        # Rate from the gate's opening (live feed: the first record written) to the last record applied.
        end = marks[-1]
        rate = end[1] / max(1e-9, end[0] - t0)
        busy = [s.get("busy_s", 0.0) for s in per]
        capacity = [round(s.get("applied", 0) / b) if b else 0 for s, b in zip(per, busy, strict=True)]
        # CPU seconds: the handler thread's (what a dedicated core would take), and the whole worker
        # process's over the drain (its client threads and idle polls too).
        cpu_busy = [s.get("busy_cpu_s", 0.0) for s in per]
        per_cpu = [round(s.get("applied", 0) / b) if b else 0 for s, b in zip(per, cpu_busy, strict=True)]
        proc_cpu = [s.get("cpu_s", 0.0) - s0.get("cpu_s", 0.0) for s, s0 in zip(per, before, strict=True)]
        per_proc = [round(s.get("applied", 0) / c) if c > 0 else 0 for s, c in zip(per, proc_cpu, strict=True)]
        # All instances together: records applied per second in any handler (the repartitioning of a record
        # may run on another instance than its diagnosis, so one instance's own ratio is skewed by that).
        applied_all = sum(s.get("applied", 0) for s in per)
        all_busy = round(applied_all / sum(busy)) if sum(busy) else 0
        all_cpu = round(applied_all / sum(cpu_busy)) if sum(cpu_busy) else 0
        row = {"instances": n, "records": total, "drained": end[1] >= total, "join_s": round(join_s, 1),
               # a short drain: were records lost, or applied once and their repeats skipped?
               "forwarded": sum(s.get("forwarded", 0) for s in per), "skipped": sum(s.get("skipped", 0) for s in per),
               # the fleet has no fault: every incident, action or command decided while draining is a false alarm
               "outputs": sum(s.get("produced", 0) for s in per),
               "records_per_busy_s_all": all_busy, "records_per_handler_cpu_s_all": all_cpu,
               "records_per_s": round(rate), "per_instance_per_s": round(rate / n),
               "partitions": [len(s.get("partitions", [])) for s in per],
               "records_by_instance": [s.get("applied", 0) for s in per],
               "jobs_by_instance": [len(s.get("jobs", [])) for s in per],
               "busy_s": [round(b, 2) for b in busy], "records_per_busy_s": capacity,
               # small batches (an instance that keeps up with the feeder) spread each round's fixed work thin
               "records_per_batch": [round((s.get("polled", 0) - s0.get("polled", 0)) / max(1, s.get("batches", 0)
                                                                                          - s0.get("batches", 0)))
                                     for s, s0 in zip(per, before, strict=True)],
               "records_per_handler_cpu_s": per_cpu, "records_per_process_cpu_s": per_proc,
               "load_avg_1m": round(os.getloadavg()[0], 2)}
        out.append(row)
        print(f"  {n} instance(s): {rate:8.0f} records/s in all, {rate / n:7.0f} per instance; partitions "
              f"{row['partitions']}, records {row['records_by_instance']}, jobs {row['jobs_by_instance']}; "
              f"records per busy second {capacity}, per handler CPU second {per_cpu}, per process CPU second "
              f"{per_proc} (join {join_s:.1f} s, load {row['load_avg_1m']})", flush=True)
        if out[0] is not row and out[0]["records_per_busy_s_all"]:
            row["busy_scaling"] = round(all_busy / out[0]["records_per_busy_s_all"], 2)
            row["cpu_scaling"] = round(all_cpu / max(1, out[0]["records_per_handler_cpu_s_all"]), 2)
        if row["outputs"]:
            row["false_alarms"] = _incidents(bus)
            print(f"    {row['outputs']} output(s) decided on a fleet without faults (false alarms while draining): "
                  f"{row['false_alarms']}", flush=True)
        if not row["drained"]:
            print(f"    NOT DRAINED in 300 s: applied {end[1]} of {total}; forwarded by the repartitioners "
                  f"{row['forwarded']} (input {total + len(fl.topologies)}), repeats skipped {row['skipped']}",
                  flush=True)
        print(f"    all instances: {all_busy} records per busy second, {all_cpu} per handler CPU second"
              + (f" ({row['busy_scaling']} and {row['cpu_scaling']} of one instance's)" if "busy_scaling" in row
                 else ""), flush=True)
    return out


def _incidents(bus: Any) -> dict[str, int]:
    """The incidents on the bus, counted by kind and title (what a fleet without faults should not have)."""
    from faultlens import schema
    from faultlens.stream.bus import Consumer

    seen: dict[str, str] = {}
    with Consumer(bus, ["incidents"], group_id=None, from_beginning=True) as c:
        quiet = time.monotonic()
        while time.monotonic() - quiet < 2.0:
            got = c.poll(200)
            if got:
                quiet = time.monotonic()
            for m in got:
                i = schema.decode("incidents", m.value)
                seen[i.id] = f"{i.kind}: {i.title}"
    counts: dict[str, int] = {}
    for what in seen.values():
        counts[what] = counts.get(what, 0) + 1
    return counts


def live(broker: Any, base: Path, nodes: int, phase_s: float, failovers: int) -> dict[str, Any]:
    """Scale-out latency (1 -> 2 -> 4 instances under a live fleet) and failover time."""
    from faultlens.config import BusConfig
    from faultlens.stream.bus import Producer, ensure_topics
    from tests import fleetgen

    prefix = "live"
    work = base / prefix
    work.mkdir()
    bus = BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix=prefix, linger_ms=2)
    ensure_topics(bus)
    fl = fleetgen.fleet(jobs=nodes // 8, nodes_per_job=8, unjobbed=0, duration_s=1, gpu_interval_s=1.0, faulty_jobs=0)
    producer = Producer(bus, linger_ms=2)
    for r in fl.topologies:
        producer.send(r)
    producer.flush(30)
    stop = threading.Event()
    feeder = live_feed(producer, fl, stop)
    watch = ActionWatch(bus)
    cluster = Cluster(broker.bootstrap, prefix, work)
    lat: list[float] = []
    by_phase: dict[int, list[float]] = {}
    missing = 0
    used: set[str] = set()
    rng = random.Random(7)

    def xid_on(job_nodes: list[str]) -> tuple[str, float]:
        node = rng.choice([n for n in job_nodes if n not in used])
        used.add(node)
        t = time.time()
        producer.send(fleetgen.xid_line(node, 79, t))
        producer.flush(5)
        return node, t

    try:
        cluster.start()
        wait_assigned(cluster, cluster.diag(), 16)
        pending: list[tuple[str, float]] = []
        phase_of: dict[str, int] = {}  # node -> the instance count its Xid was sent under
        for target in (1, 2, 4):
            while len(cluster.diag()) < target:
                cluster.start()
            t_phase = time.monotonic()
            while time.monotonic() - t_phase < phase_s:
                fresh = [t for t in fl.topologies if any(n not in used for n in _nodes(t))]
                if not fresh:  # a small --nodes: every node has had its Xid
                    break
                topo = rng.choice(fresh)
                pending.append(xid_on(_nodes(topo)))
                phase_of[pending[-1][0]] = target
                time.sleep(1.0)
        deadline = time.time() + 60  # a loaded machine lags: wait for the last ones before counting
        while time.time() < deadline and any(watch.first(n) is None for n, _ in pending):
            time.sleep(0.2)
        for node, t in pending:
            got = watch.first(node)
            if got is None:
                missing += 1
            else:
                lat.append(got - t)
                by_phase.setdefault(phase_of[node], []).append(round(got - t, 2))
        # Failover: kill one instance, then a Xid on a job it owned.
        fo: list[float] = []
        restore_s: list[float] = []
        for _ in range(failovers):
            victim = cluster.diag()[0]
            jobs = cluster.stats(victim).get("jobs", [])
            cluster.kill(victim)
            t_kill = time.time()
            job = rng.choice(jobs) if jobs else fl.topologies[0].job
            topo = next(t for t in fl.topologies if t.job == job)
            node, _ = xid_on(_nodes(topo))
            deadline = time.time() + 120
            while watch.first(node) is None and time.time() < deadline:
                time.sleep(0.05)
            got = watch.first(node)
            fo.append((got - t_kill) if got else float("nan"))
            for name in cluster.diag():
                for r in cluster.stats(name).get("restores", []):
                    if r.get("wall", 0) > t_kill:
                        restore_s.append(r["seconds"])
            cluster.start()
            wait_assigned(cluster, cluster.diag(), 16)
    finally:
        stop.set()
        feeder.join(10)
        cluster.stop_all()
        watch.close()
        producer.close()
    return {"xid_to_action_p50_s": round(statistics.median(lat), 3) if lat else None,
            "xid_to_action_p99_s": round(pct(lat, 99), 3) if lat else None,
            "xid_to_action_max_s": round(max(lat), 3) if lat else None, "xids": len(pending), "missing": missing,
            "failover_s": [round(x, 2) for x in fo], "restore_s_max": round(max(restore_s), 3) if restore_s else None,
            "xid_to_action_s_by_instances": by_phase}


def _nodes(topo: Any) -> list[str]:
    return sorted({v["node"] for v in topo.ranks.values()})


def kill_test(broker: Any, base: Path, nodes: int, kills: int) -> dict[str, Any]:
    """kill -9 of diagnosis instances during open incidents, and of the runner mid-action."""
    from faultlens.commands.demo import demo_key
    from faultlens.config import BusConfig
    from faultlens.stream.bus import Producer, ensure_topics
    from tests import fleetgen

    prefix = "kill"
    work = base / prefix
    work.mkdir()
    (work / "hook.py").write_text(HOOK)
    demo_key(work)  # diagnosis signs the evictions, the runner verifies them
    bus = BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix=prefix, linger_ms=2)
    ensure_topics(bus)
    fl = fleetgen.fleet(jobs=nodes // 8, nodes_per_job=8, unjobbed=0, duration_s=1, gpu_interval_s=1.0, faulty_jobs=0)
    producer = Producer(bus, linger_ms=2)
    for r in fl.topologies:
        producer.send(r)
    producer.flush(30)
    stop = threading.Event()
    feeder = live_feed(producer, fl, stop)
    watch = ActionWatch(bus)
    cluster = Cluster(broker.bootstrap, prefix, work)
    rng = random.Random(11)
    expected: list[str] = []  # nodes that must be evicted, once
    try:
        cluster.start()
        cluster.start()
        runner = cluster.start("runner")
        wait_assigned(cluster, cluster.diag(), 16)
        # --- diagnosis instances: first IB alert, kill -9 the owner of that job, the repeat after the kill
        for _ in range(kills):
            topo = rng.choice(fl.topologies)
            node = rng.choice([n for n in _nodes(topo) if n not in expected])
            expected.append(node)
            producer.send(fleetgen.ib_down(node, time.time()))
            producer.flush(5)
            time.sleep(1.5)  # the incident is open and checkpointed
            owner = next((n for n in cluster.diag() if topo.job in cluster.stats(n).get("jobs", [])), cluster.diag()[0])
            cluster.kill(owner)
            producer.send(fleetgen.ib_down(node, time.time()))
            producer.flush(5)
            cluster.start()
            deadline = time.time() + 120
            while watch.first(node) is None and time.time() < deadline:
                time.sleep(0.1)
        # --- the runner: kill its process group while an action's hook runs, then restart it
        for _ in range(kills):
            topo = rng.choice(fl.topologies)
            node = rng.choice([n for n in _nodes(topo) if n not in expected])
            expected.append(node)
            marker = work / "hook-running"
            marker.unlink(missing_ok=True)
            producer.send(fleetgen.xid_line(node, 79, time.time()))
            producer.flush(5)
            deadline = time.time() + 120
            while not marker.exists() and time.time() < deadline:
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 0.35))  # somewhere inside the hook's 0.4 s
            cluster.kill(runner)
            runner = cluster.start("runner")
        time.sleep(3)
        # let the last actions through the runner
        deadline = time.time() + 90
        while time.time() < deadline:
            done = set(_effects(work))
            if all({a.id for _, a in watch.seen.get(n, [])} & done for n in expected):
                break
            time.sleep(0.5)
    finally:
        stop.set()
        feeder.join(10)
        cluster.stop_all()
        watch.close()
        producer.close()
    effects = _effects(work)
    runs = _lines(work / "hook-runs.log")
    action_of = {n: {a.id for _, a in watch.seen.get(n, []) if a.type == "evict_nodes"} for n in expected}
    lost_nodes = [n for n in expected if not (action_of[n] & set(effects))]
    lost = len(lost_nodes)
    twice = sum(1 for aid in set(effects) if effects.count(aid) > 1)
    repeated_runs = sum(1 for aid in set(runs) if runs.count(aid) > 1)
    diag_nodes = expected[:kills]
    kept = sum(1 for n in diag_nodes if action_of[n])  # the eviction needs the incident opened before the kill
    emitted_twice = sum(1 for c in watch.ids.values() if c > 1)
    return {"kills_diagnosis": kills, "kills_runner": kills, "actions_expected": len(expected), "actions_lost": lost,
            "effects_twice": twice, "hook_runs_repeated": repeated_runs, "open_incidents_kept": kept,
            "open_incidents_total": len(diag_nodes), "action_ids_emitted_more_than_once": emitted_twice,
            "multiple_ids_per_fault": sum(1 for n in expected if len(action_of[n]) > 1),
            "lost_after_diagnosis_kill": sum(1 for n in lost_nodes if n in diag_nodes),
            "lost_without_action": sum(1 for n in lost_nodes if not action_of[n]), "work": str(work)}


def _lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def _effects(work: Path) -> list[str]:
    return _lines(work / "effects.log")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode")
    w = sub.add_parser("worker")
    w.add_argument("--role", choices=("diag", "runner"), default="diag")
    for a in ("--bootstrap", "--prefix", "--dir", "--stats"):
        w.add_argument(a, required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true",
                    help="16 nodes, 2 s drained by one instance, no live or kill phase (seconds): does it still run")
    ap.add_argument("--nodes", type=int)
    ap.add_argument("--kills", type=int)
    ap.add_argument("--workdir", help="keep worker logs, ledgers and hook logs here (default: a temporary folder)")
    ap.add_argument("--consumer", default="auto", help="the diagnosis group consumer: auto, kafka (eager) or "
                    "confluent (cooperative)")
    ap.add_argument("--producer", default="auto", help="the diagnosis producer: auto, kafka or confluent")
    ap.add_argument("--membership", default="auto", help="who holds which partition: auto, members (heartbeats "
                    "on diag-members, no group join) or group (the Kafka consumer group, --consumer)")
    ap.add_argument("--skip", default="", help="comma-separated phases to skip: throughput,live,kill")
    ap.add_argument("--feed", choices=("backlog", "in-turn", "live"), default="backlog",
                    help="throughput: drain a backlog written while the instances' fetching is held (their "
                    "capacity); in-turn: the same, but the instances are let in one after another, each draining "
                    "what it can alone (a core each, even on two cores: the records/s are then no drain rate); "
                    "live: the backlog is written while they run (they keep up with this one feeder)")
    args = ap.parse_args()
    if args.mode == "worker":
        worker(args)
        return
    from faultlens.stream.bus.embedded_broker import EmbeddedBroker

    os.environ["SCALEOUT_CONSUMER"], os.environ["SCALEOUT_PRODUCER"] = args.consumer, args.producer  # workers inherit
    os.environ["SCALEOUT_MEMBERSHIP"] = args.membership
    nodes = args.nodes or (16 if args.smoke else 256 if args.quick else 2048)
    kills = args.kills or (2 if args.quick else 10)
    # Of 1 Hz samples: a backlog the drain rate can be read from (5 s drained in a blink; --quick's 256 nodes
    # take 600 s, so each row drains for seconds and is not all start-up: first samples, engines, checkpoints;
    # 120 s of --quick's nodes drained in 0.4 busy seconds)
    seconds = 2 if args.smoke else 600 if args.quick else 120
    skip = set(filter(None, args.skip.split(","))) | ({"live", "kill"} if args.smoke else set())
    result: dict[str, Any] = {"bench": "scaleout", "nodes": nodes, "gpus": nodes * 8, "cores": os.cpu_count(), "quick": args.quick,
                              "consumer": args.consumer, "producer": args.producer, "membership": args.membership}
    with tempfile.TemporaryDirectory(prefix="faultlens-scaleout-") as tmp, EmbeddedBroker() as broker:
        base = Path(args.workdir) if args.workdir else Path(tmp)
        base.mkdir(parents=True, exist_ok=True)
        if "throughput" not in skip:
            print(f"throughput: {nodes} nodes x {seconds} s of 1 Hz samples + step timings, drained by 1, 2, 4 instances "
                  f"(--feed {args.feed})")
            result["feed"] = args.feed
            result["throughput"] = throughput(broker, base, nodes, seconds, [1] if args.smoke else [1, 2, 4],
                                              args.feed)
        if "live" not in skip:
            phase = 5 if args.quick else 20
            print(f"live: {nodes} nodes at 1 Hz; a Xid every second while going 1 -> 2 -> 4 instances ({phase} s each)")
            result["live"] = live(broker, base, nodes, phase, failovers=1 if args.quick else 3)
            lv = result["live"]
            print(f"  Xid -> action p50 {lv['xid_to_action_p50_s']} s, p99 {lv['xid_to_action_p99_s']} s, max "
                  f"{lv['xid_to_action_max_s']} s over {lv['xids']} Xids ({lv['missing']} missing); failover "
                  f"(kill -9 -> its job diagnosed again) {lv['failover_s']} s, restore max {lv['restore_s_max']} s")
        if "kill" not in skip:
            print(f"kill test: {kills} x kill -9 of a diagnosis instance (open incidents), {kills} x of the runner")
            result["kill"] = k = kill_test(broker, base, min(nodes, 256), kills)
            print(f"  actions lost {k['actions_lost']}, effects applied twice {k['effects_twice']}, open incidents kept "
                  f"{k['open_incidents_kept']}/{k['open_incidents_total']} (hook runs repeated for an in-flight step: "
                  f"{k['hook_runs_repeated']}; action ids on the topic more than once: "
                  f"{k['action_ids_emitted_more_than_once']})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
