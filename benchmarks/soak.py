"""Soak: the whole pipeline under a scripted fault sequence while its parts are killed -9.

Every service is the real ``faultlens`` command in its own process, as in production:
one ``faultlens agent`` per virtual node (following that node's kernel log, NCCL logs
and step file), ``faultlens stream`` (the lake writer), ``faultlens diagnose`` and
``faultlens runner`` (dry-run adapter), all on the embedded broker (Tansu). This
process plays the fault sequence (datasets.live's demo fleet: one job per fault on
machines of its own, written to the nodes' files as simulated time passes) and, on a
schedule, kills -9 and restarts an agent (in turn), the stream processor and the
broker (restarted empty on the same port: its storage is memory only), ``--kills``
times each.

At the end, with everything drained and stopped by SIGTERM, it counts:

* step records: lines written to the step files (each one record, keyed job, rank,
  step) against rows in the lake (DuckDB over the Parquet lake): lost, duplicated;
* kernel fault lines (Xid): lines written against distinct lake rows; duplicated rows
  of the kernel and NCCL tables (same node, ts, raw);
* actions: expected (one per fault whose action is known) against those the runner's
  ledger handled, duplicates (one job given the same action type twice, or one action
  run twice);
* peak RSS per service (VmHWM of each process, the largest over its restarts).

    nice python benchmarks/soak.py --quick   # 4 agents, 3 kills each, ~2-3 min
    nice python benchmarks/soak.py           # 4 agents, 10 kills each, ~6 min

The broker keeps everything in memory: a kill loses what it held. Each agent keeps what
it sent for ``agent.resend_window_s`` and sends it all again when a produce answer shows
the broker's offsets went back; the stream processor keeps each record once (natural
key: node, agent epoch, seq; stream/dedupe.py). The broker also forgets the jobs topic
(topologies) and the diagnosis changelog: each agent publishes its job's topology from
the launcher's job.json (``--job-file``) at start and again after such a loss
(``--republish-jobs``: this script publishes them as well after each broker restart, the
old launcher-hook stand-in). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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

# (fault, node index, gpu) per job, and the action each must end in.
FAULTS = (("gpu_lost", 0, 2), ("user_exception", 0, None), ("gpu_lost", 0, 5), ("user_exception", 0, None))
EXPECTED = {"gpu_lost": "evict_nodes", "user_exception": "rollback_code"}


def vm_hwm_kb(pid: int) -> int:
    """Peak resident set of a live process (kB), 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


class Services:
    """The faultlens processes of the soak: start, kill -9, restart, SIGTERM; peak RSS per role."""

    def __init__(self, work: Path, env: dict[str, str]):
        self.work = work
        self.env = dict(os.environ, **env, PYTHONUNBUFFERED="1")
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.argv: dict[str, list[str]] = {}
        self.peak_kb: dict[str, int] = {}
        self.restarts: dict[str, int] = {}
        (work / "logs").mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    @staticmethod
    def role(name: str) -> str:
        return name.split(":")[0]

    def start(self, name: str, *args: str) -> None:
        self.argv[name] = [sys.executable, "-m", "faultlens.cli", *args]
        self._spawn(name)

    def _spawn(self, name: str) -> None:
        log = open(self.work / "logs" / f"{name.replace(':', '-')}.log", "ab")  # noqa: SIM115 - the child's
        # called from the chaos thread too: lifeline.spawn keeps the parent-death signal on a lasting thread
        self.procs[name] = lifeline.spawn(self.argv[name], signum=signal.SIGTERM, env=self.env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def sample(self) -> None:
        with self._lock:
            for name, p in self.procs.items():
                kb = vm_hwm_kb(p.pid)
                r = self.role(name)
                self.peak_kb[r] = max(self.peak_kb.get(r, 0), kb)

    def kill9_restart(self, name: str, pause_s: float = 0.5) -> None:
        self.sample()
        p = self.procs[name]
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=10)
        time.sleep(pause_s)
        with self._lock:
            self._spawn(name)
        self.restarts[name] = self.restarts.get(name, 0) + 1

    def restart(self, name: str) -> None:
        with self._lock:
            self._spawn(name)

    def crashed(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def stop(self, names: list[str], timeout_s: float = 60.0) -> dict[str, int | None]:
        """SIGTERM (services drain, then exit); SIGKILL after ``timeout_s``. Returns exit codes."""
        self.sample()
        for n in names:
            try:
                os.killpg(self.procs[n].pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        codes: dict[str, int | None] = {}
        deadline = time.monotonic() + timeout_s
        for n in names:
            try:
                codes[n] = self.procs[n].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(self.procs[n].pid, signal.SIGKILL)
                codes[n] = None
        return codes

    def tail(self, name: str, n: int = 2000) -> str:
        return (self.work / "logs" / f"{name.replace(':', '-')}.log").read_text(errors="replace")[-n:]


def publish_topologies(config: Any, bootstrap: str, scenarios: list[Any]) -> None:
    from faultlens.schema import JobTopology
    from faultlens.stream.bus import Producer

    with Producer(config.bus, bootstrap) as producer:
        for sc in scenarios:
            jd = sc.job_dict()
            producer.send(JobTopology(ts=sc.start_ts, job=sc.cluster.job, tp=jd["tp"], pp=jd["pp"], dp=jd["dp"],
                                      cp=jd.get("cp", 1), order=jd.get("order", "tp-cp-dp-pp"), ranks=jd["ranks"],
                                      num_layers=jd.get("num_layers"), micro_batches=jd.get("micro_batches")))
        producer.flush(10)


def count_lines(paths: list[Path], needle: str | None = None) -> int:
    n = 0
    for p in paths:
        if p.exists():
            with open(p, errors="replace") as f:
                n += sum(1 for line in f if line.strip() and (needle is None or needle in line))
    return n


def lake_figures(lake: Path) -> dict[str, Any]:
    from faultlens.stream.catalog import open_lake

    if not (lake / "_manifest").exists():
        return {}
    db = open_lake(lake)
    out: dict[str, Any] = {}
    try:
        for table, key in (("steps", "job, rank, step"), ("kernel", "node, ts, raw"), ("nccl", "node, ts, raw")):
            try:
                rows, distinct = db.execute(f"SELECT count(*), count(DISTINCT ({key})) FROM {table}").fetchone()
            except Exception:  # noqa: BLE001 - a table with no file yet
                rows = distinct = 0
            out[table] = {"rows": rows, "distinct": distinct}
        try:
            out["xid_distinct"] = db.execute(
                "SELECT count(DISTINCT (node, ts, raw)) FROM kernel WHERE xid IS NOT NULL").fetchone()[0]
        except Exception:  # noqa: BLE001
            out["xid_distinct"] = 0
        try:
            out["actions"] = [dict(zip(("id", "job", "type"), r, strict=True))
                              for r in db.execute("SELECT DISTINCT id, job, type FROM actions").fetchall()]
        except Exception:  # noqa: BLE001
            out["actions"] = []
    finally:
        db.close()
    return out


def ledger_figures(path: Path) -> dict[str, Any]:
    runs: dict[str, list[str]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if "status" in e:
                runs.setdefault(e["action_id"], []).append(e["status"])
    finals = {a: [s for s in st if s not in ("started", "in_doubt")] for a, st in runs.items()}  # outcomes
    return {"handled": sorted(a for a, st in finals.items() if st),
            "run_twice": sorted(a for a, st in finals.items() if len(st) > 1)}


def runner_log_actions(path: Path) -> dict[str, tuple[str, str]]:
    """action id -> (job, type) from the dry-run runner's log lines ("action act-X: would evict_nodes ... for job J")."""
    import re

    pat = re.compile(r"action (act-[0-9a-f]+): would (\w+) .*?for job (\S+)")
    out: dict[str, tuple[str, str]] = {}
    if path.exists():
        for m in pat.finditer(path.read_text(errors="replace")):
            out[m.group(1)] = (m.group(3), m.group(2))
    return out


def main() -> None:  # noqa: PLR0915 - one script, read top to bottom
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 kills each, shorter sequence (~2-3 min)")
    ap.add_argument("--smoke", action="store_true",
                    help="no kills, 40 s segments at 20x (seconds): does the pipeline still run end to end")
    ap.add_argument("--kills", type=int, default=None, help="kill -9s of each of agent, processor, broker (default 10)")
    ap.add_argument("--nodes", type=int, default=5, help="virtual nodes = agents (4 jobs of 1 plus a spare by default)")
    ap.add_argument("--speed", type=float, default=8.0, help="simulated seconds per real second")
    ap.add_argument("--segment", type=float, default=None, help="simulated seconds per job's fault segment")
    ap.add_argument("--republish-jobs", action="store_true",
                    help="this script publishes the jobs' topologies too, at start and after each broker restart "
                         "(by default only the agents do: --job-file)")
    ap.add_argument("--workdir", default=None, help="keep everything here (default: a temporary directory)")
    args = ap.parse_args()
    kills = args.kills if args.kills is not None else (0 if args.smoke else 3 if args.quick else 10)
    segment = args.segment or (40.0 if args.smoke else 240.0 if args.quick else 600.0)
    if args.smoke:
        args.speed = 20.0

    import logging

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from faultlens.commands.demo import demo_key, service_env
    from faultlens.config import load_config
    from faultlens.datasets.live import demo_segments
    from faultlens.datasets.scenario_files import LiveWriter
    from faultlens.stream.bus import ensure_topics
    from faultlens.stream.bus.embedded_broker import EmbeddedBroker

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    console = Console(stderr=True)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="faultlens-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    broker = EmbeddedBroker().start()
    env = {**service_env(work, broker.bootstrap), "FAULTLENS_GUARD_MAX_EVICTED_FRACTION": "1.0",
           "FAULTLENS_LAKE_FLUSH_INTERVAL_S": "1", "FAULTLENS_LOG_LEVEL": "WARNING"}
    os.environ.update(env)
    config = load_config()
    ensure_topics(config.bus, broker.bootstrap)

    scenarios = demo_segments(args.nodes, segment_s=segment, onset_s=segment * 0.4, seed=11, faults=FAULTS)
    t0 = min(sc.start_ts for sc in scenarios)
    sim_end = max(sc.start_ts + sc.spec.duration_s for sc in scenarios)
    duration_s = (sim_end - t0) / args.speed
    writers = [LiveWriter(sc, work / "cluster" / sc.spec.name) for sc in scenarios]  # creates the empty files
    nodes: list[tuple[str, str, Path]] = [(n, sc.cluster.job, work / "cluster" / sc.spec.name)
                                          for sc in scenarios for n in sc.cluster.node_names]

    svc = Services(work, env)
    svc.start("stream", "stream")
    svc.start("diagnose", "diagnose", "--set", f"keys.files={demo_key(work)}")  # signs; the rest get .pub
    svc.start("runner", "runner")
    agents = []
    for node, job, seg in nodes:
        name = f"agent:{node}"
        agents.append(name)
        svc.start(name, "agent", "--node", node, "--job", job, "--no-nvml", "--metrics-port", "0",
                  "--kernel-log", str(seg / "nodes" / node / "kernel.log"),
                  "--nccl-glob", str(seg / "nodes" / node / "nccl" / "*.log"),
                  "--steps-glob", str(seg / "steps" / f"{node}.jsonl"),
                  "--job-file", str(seg / "job.json"),
                  "--spool-dir", str(work / "spool" / node))
    if args.republish_jobs:
        publish_topologies(config, broker.bootstrap, scenarios)
    time.sleep(3 if args.smoke else 8)  # group joins: the services read from the start, but let the agents settle on their files

    # Kill schedule: agent, processor, broker in turn, evenly over the sequence (not in its last tenth).
    roles = ["agent", "stream", "broker"]
    events = [(duration_s * 0.9 * (i + 0.5) / (3 * kills), roles[i % 3]) for i in range(3 * kills)]
    broker_peak = 0
    stop = threading.Event()

    def sampler() -> None:
        nonlocal broker_peak
        while not stop.wait(0.5):
            svc.sample()
            if broker.proc is not None:
                broker_peak = max(broker_peak, vm_hwm_kb(broker.proc.pid))

    threading.Thread(target=sampler, daemon=True).start()
    start = time.monotonic()
    done_kills = {"agent": 0, "stream": 0, "broker": 0}
    crashes: dict[str, int] = {}
    with Progress(TextColumn("[bold]soak[/]"), BarColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        task = progress.add_task("", total=duration_s)
        ev = 0
        while True:
            now = time.monotonic() - start
            sim_now = t0 + now * args.speed
            for w in writers:
                w.advance(sim_now)
            while ev < len(events) and events[ev][0] <= now:
                role = events[ev][1]
                if role == "agent":
                    svc.kill9_restart(agents[done_kills["agent"] % len(agents)])
                elif role == "stream":
                    svc.kill9_restart("stream")
                else:
                    broker_peak = max(broker_peak, vm_hwm_kb(broker.proc.pid) if broker.proc else 0)
                    broker.kill()
                    time.sleep(0.5)
                    broker.start()
                    ensure_topics(config.bus, broker.bootstrap)  # a real Kafka keeps its topics
                    if args.republish_jobs:  # the jobs topic went with the broker's memory; the agents republish
                        publish_topologies(config, broker.bootstrap, scenarios)
                done_kills[role] += 1
                ev += 1
            for name in svc.crashed():  # a service that exited on its own: restarted, as systemd would
                tail = svc.tail(name, 400).strip().splitlines()
                console.print(f"[red]{name} exited ({svc.procs[name].returncode})[/]: {tail[-1] if tail else ''}")
                crashes[name] = crashes.get(name, 0) + 1
                svc.restart(name)
            progress.update(task, completed=min(now, duration_s),
                            description=f"kills agent {done_kills['agent']} stream {done_kills['stream']} "
                                        f"broker {done_kills['broker']}")
            if now >= duration_s and all(w.finished for w in writers):
                break
            time.sleep(0.1)

    # Drain: wait until the lake stops growing, then stop everything with SIGTERM (agents first).
    console.print("sequence played; draining")
    lake = work / "lake"
    last, still_since, deadline = None, time.monotonic(), time.monotonic() + 120
    while time.monotonic() < deadline:
        fig = lake_figures(lake)
        cur = (fig.get("steps", {}).get("rows"), fig.get("kernel", {}).get("rows"), len(fig.get("actions", [])))
        if cur != last:
            last, still_since = cur, time.monotonic()
        elif time.monotonic() - still_since > 15:
            break
        time.sleep(2)
    codes = svc.stop(agents)
    time.sleep(3)
    codes.update(svc.stop(["runner", "diagnose"]))
    codes.update(svc.stop(["stream"]))
    stop.set()
    broker.stop()

    step_files = [seg / "steps" / f"{node}.jsonl" for node, _, seg in nodes]
    kernel_files = [seg / "nodes" / node / "kernel.log" for node, _, seg in nodes]
    steps_sent = count_lines(step_files)
    xid_sent = count_lines(kernel_files, "Xid")
    fig = lake_figures(lake)
    ledger = ledger_figures(work / "runner-ledger.jsonl")
    by_job: dict[tuple[str, str], list[str]] = {}
    for a in fig.get("actions", []):
        ids = by_job.setdefault((a["job"], a["type"]), [])
        if a["id"] not in ids:
            ids.append(a["id"])
    expected = {(sc.cluster.job, EXPECTED[sc.spec.faults[0].kind]) for sc in scenarios if sc.spec.faults[0].kind in EXPECTED}
    handled = set(ledger["handled"])
    # An action the runner handled whose record the lake lacks (the broker died before the stream
    # processor read it, and diagnosis did not send it again: diagnosis/online/resend.py): its job
    # and type as the runner logged them, and counted apart.
    in_lake = {a["id"] for a in fig.get("actions", [])}
    said = runner_log_actions(work / "logs" / "runner.log")
    not_in_lake = sorted(handled - in_lake)
    for aid in not_in_lake:
        if aid in said:
            by_job.setdefault(said[aid], []).append(aid)
    taken = {k for k, ids in by_job.items() if handled & set(ids)}
    st, kt, nt = fig.get("steps", {}), fig.get("kernel", {}), fig.get("nccl", {})
    result = {
        "bench": "soak", "quick": args.quick, "agents": len(agents), "kills": done_kills,
        "sequence_s": round(duration_s, 1), "speed": args.speed, "republish_jobs": args.republish_jobs, "wall_s": round(time.monotonic() - start, 1),
        "steps": {"sent": steps_sent, "lake_rows": st.get("rows", 0), "lake_distinct": st.get("distinct", 0),
                  "lost": steps_sent - st.get("distinct", 0), "duplicated": st.get("rows", 0) - st.get("distinct", 0)},
        "xid_lines": {"sent": xid_sent, "lake_distinct": fig.get("xid_distinct", 0),
                      "lost": xid_sent - fig.get("xid_distinct", 0)},
        "kernel_duplicated": kt.get("rows", 0) - kt.get("distinct", 0),
        "nccl_duplicated": nt.get("rows", 0) - nt.get("distinct", 0),
        "actions": {"expected": len(expected), "taken": len(taken & expected), "missing": sorted(map(list, expected - taken)),
                    "unexpected": sorted(map(list, set(by_job) - expected)),
                    "duplicate": sum(len(ids) - 1 for ids in by_job.values()), "run_twice": len(ledger["run_twice"]),
                    "ledger_handled": len(handled), "handled_not_in_lake": not_in_lake},
        "peak_rss_mb": {**{r: round(kb / 1024, 1) for r, kb in sorted(svc.peak_kb.items())},
                        "broker": round(broker_peak / 1024, 1)},
        "crashes": crashes,  # exits on their own during the sequence (each restarted)
        "exit_codes": {k: v for k, v in codes.items()},  # after SIGTERM: 0 is a drained, clean stop
        "workdir": str(work),
    }
    s, x, a = result["steps"], result["xid_lines"], result["actions"]
    console = Console()  # the table goes to stdout (progress went to stderr)
    console.print(f"step records: sent {s['sent']}, in the lake {s['lake_distinct']}: lost {s['lost']}, "
                  f"duplicated {s['duplicated']}")
    console.print(f"Xid lines: sent {x['sent']}, in the lake {x['lake_distinct']}: lost {x['lost']}; "
                  f"duplicated rows kernel {result['kernel_duplicated']}, nccl {result['nccl_duplicated']}")
    console.print(f"actions: expected {a['expected']}, taken {a['taken']}, duplicate {a['duplicate']}, "
                  f"run twice {a['run_twice']}, missing {a['missing']}, unexpected {a['unexpected']}; "
                  f"handled but not in the lake {a['handled_not_in_lake'] or 'none'}")
    console.print(f"crashes (restarted): {crashes or 'none'}; exit codes after SIGTERM: {codes}")
    console.print("peak RSS (MB): " + ", ".join(f"{k} {v}" for k, v in result["peak_rss_mb"].items()))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
