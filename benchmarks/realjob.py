"""A real PyTorch job (DDP over gloo, 4 virtual nodes x 2 ranks) through faultlens, with real faults.

Each fault gets a fresh job id (diagnosis judges each on its own) on a cluster that keeps running:
the services (embedded broker, stream processor, online diagnosis, runner with a command hook) and
one real agent per virtual node (benchmarks/torchjob/cluster.py). The job trains until its steps
flow, the fault is made for real (signals from outside, or the job's own code paths asked through
its control files: benchmarks/torchjob/train.py), and the actions topic is watched. The runner's
hook restarts the job from its last checkpoint without the evicted node; "job back" is the first
step any rank completes after that restart.

The one written line: for the lost machine (SIGKILL), an Xid 79 is appended to that virtual node's
kernel log, standing for the hardware that a real machine's kernel would report.

    python benchmarks/realjob.py --smoke   # one fault on 2 virtual nodes x 1 rank (~1 min)
    python benchmarks/realjob.py --quick   # five faults (~8 min on 2 cores)
    python benchmarks/realjob.py           # every fault (~20 min)
    python benchmarks/realjob.py --slurm --quick  # ETTR on a real Slurm cluster, 3 policies (~8 min)

Right = the action's type is one the fault calls for and it names the faulty machine (an eviction),
or names none or every machine of the job (a rollback/restart; NaN on every rank: stop-time checks on
all of them). A false eviction is any evicted machine that was healthy.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.torchjob.cluster import Cluster  # noqa: E402

EVICT = ("evict_nodes",)
RESTART = ("restart_job", "rollback_code")
ACTING = ("evict_nodes", "restart_job", "rollback_code", "adapt_parallelism", "run_diagnostics")
# NaN on every rank: stop-time checks on every machine (possible silent data corruption), or a restart; blames none
NAN_RIGHT = ("run_diagnostics", "restart_job", "rollback_code")


@dataclass
class Fault:
    name: str
    cls: str  # hang | crash | exception | nan | failslow | input
    expect: tuple[str, ...]  # action types that are right
    names_node: bool  # the right action names the faulty node (else: names none, or every node of the job)
    inject: Callable[[Cluster, int], str]  # -> what was done
    window_s: float = 120.0
    extra: tuple[str, ...] = ()  # train.py arguments for this case


def _signal(sig: int) -> Callable[[Cluster, int], str]:
    def go(c: Cluster, rank: int) -> str:
        pid = c.rank_pid(rank)
        if pid is None:
            raise RuntimeError(f"rank {rank} not found")
        os.kill(pid, sig)
        return f"{signal.Signals(sig).name} rank {rank} (pid {pid})"
    return go


def _lost_machine(c: Cluster, rank: int) -> str:
    node = c.node(c.node_of_rank(rank))
    pid = c.rank_pid(rank)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f",{int(time.time() % 1 * 1e6):06d}+00:00"
    with open(node.kernel_log, "a") as f:  # the hardware's word (see the module doc)
        f.write(f"{stamp} {node.name} kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid={pid}, GPU has fallen off the bus.\n")
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
    return f"Xid 79 in {node.name}'s kernel log + SIGKILL rank {rank} (pid {pid})"


def _ctl(name: str) -> Callable[[Cluster, int], str]:
    def go(c: Cluster, rank: int) -> str:
        path = c.ctl_dir / name.format(rank=rank)
        path.touch()
        return f"control file {path.name}"
    return go


def _worker(sig: int) -> Callable[[Cluster, int], str]:
    def go(c: Cluster, rank: int) -> str:
        pids = c.worker_pids(rank)
        if not pids:
            raise RuntimeError(f"rank {rank} has no DataLoader worker")
        os.kill(pids[0], sig)
        return f"{signal.Signals(sig).name} DataLoader worker {pids[0]} of rank {rank}"
    return go


def _remove_cgroups(job: str, wait_s: float = 10.0) -> None:
    """The CPU cap's group, once the killed rank's threads have left it (EBUSY until then)."""
    groups = [*Path("/sys/fs/cgroup").glob(f"*/faultlens-slow-{job}"), *Path("/sys/fs/cgroup").glob(f"faultlens-slow-{job}")]
    deadline = time.monotonic() + wait_s
    for g in groups:
        while True:
            try:
                g.rmdir()
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    print(f"could not remove {g}: {exc}", file=sys.stderr)
                    break
                time.sleep(0.2)


CPU_QUOTA_PCT = 5  # of one CPU: under a load of ~20 on 2 cores every process gets ~10%, so 15% capped nothing


def _cpu_contention(c: Cluster, rank: int) -> str:
    """The rank's process (every thread) into a cgroup capped at CPU_QUOTA_PCT of one CPU (cgroup v1 or v2)."""
    pid = c.rank_pid(rank)
    if pid is None:
        raise RuntimeError(f"rank {rank} not found")
    v1 = Path("/sys/fs/cgroup/cpu")
    if v1.is_dir():
        g = v1 / f"faultlens-slow-{c.job}"
        g.mkdir(exist_ok=True)
        (g / "cpu.cfs_period_us").write_text("100000")
        (g / "cpu.cfs_quota_us").write_text(str(CPU_QUOTA_PCT * 1000))
    else:
        g = Path("/sys/fs/cgroup") / f"faultlens-slow-{c.job}"
        g.mkdir(exist_ok=True)
        (g / "cpu.max").write_text(f"{CPU_QUOTA_PCT * 1000} 100000")
    for tid in os.listdir(f"/proc/{pid}/task"):
        (g / "tasks" if v1.is_dir() else g / "cgroup.threads").write_text(tid)
    return f"rank {rank} (pid {pid}) capped at {CPU_QUOTA_PCT}% of a CPU ({g})"


FAULTS = [
    Fault("lost-machine", "crash", EVICT, True, _lost_machine),
    Fault("rank-frozen", "hang", EVICT, True, _signal(signal.SIGSTOP)),
    Fault("exception", "exception", RESTART, False, _ctl("raise-{rank}")),
    Fault("nan-every-rank", "nan", NAN_RIGHT, False, _ctl("lr-1e30")),
    Fault("storage-read-blocked", "hang", EVICT, True, _ctl("fifo-{rank}")),
    Fault("dataloader-worker-killed", "exception", RESTART, False, _worker(signal.SIGKILL)),
    Fault("dataloader-worker-hung", "hang", EVICT, True, _worker(signal.SIGSTOP)),
    Fault("cpu-contention", "failslow", EVICT + ("adapt_parallelism",), True, _cpu_contention, window_s=150),
    Fault("slow-input-pipeline", "input", (), False, _ctl("slowdata-{rank}"), window_s=90),
    Fault("collective-timeout", "hang", EVICT, True, _signal(signal.SIGSTOP), extra=("--timeout-s", "20")),
]
SMOKE = ["lost-machine"]
QUICK = ["lost-machine", "rank-frozen", "exception", "nan-every-rank", "cpu-contention"]


def run_case(c: Cluster, consumer, fault: Fault, idx: int, nodes: list[str]) -> dict:
    job = f"rj{idx}-{fault.name}"
    rank = (idx * 3 + 2) % (len(nodes) * c.ranks_per_node)
    c.start_job(job, nodes, extra=list(fault.extra))
    t_start = time.time()
    warm = None
    while time.time() - t_start < 120:  # steps flowing: at least 12 steps past a checkpoint
        got = c.last_step()
        if got and got[0] >= c.ckpt_every + 2:
            warm = got
            break
        time.sleep(0.5)
    if warm is None:
        c.stop_job()
        return {"fault": fault.name, "cls": fault.cls, "error": "the job did not start", "job": job}
    time.sleep(2.0)
    node = c.node_of_rank(rank)
    try:
        what = fault.inject(c, rank)
    except Exception as exc:  # noqa: BLE001 - recorded as the case's failure
        c.stop_job()
        return {"fault": fault.name, "cls": fault.cls, "error": f"injection failed: {exc}", "job": job}
    t_inj = time.time()
    actions: list[dict] = []
    incidents: dict[str, dict] = {}
    restarted_at = back_at = None
    done = ""
    deadline = t_inj + fault.window_s
    while time.time() < deadline:
        for m in consumer.poll(500):
            try:
                env = json.loads(m.value)
            except ValueError:
                continue
            data = env.get("data", env) if isinstance(env, dict) else {}
            if not isinstance(data, dict) or data.get("job") != job:
                continue
            if m.kind == "incidents":
                incidents[str(data.get("id"))] = data
            else:
                data["_seen_s"] = time.time() - t_inj
                actions.append(data)
        for a in c.hook_actions():
            if restarted_at is None and (out := c.apply(a)):
                restarted_at, done = time.time(), out
        if restarted_at is not None:
            got = c.last_step(since=restarted_at)
            if got:
                back_at = got[1]
                break
        if fault.cls == "input" and actions:
            break
    c.stop_job()
    _remove_cgroups(job)
    acting = [a for a in actions if a.get("type") in ACTING]
    evicted = sorted({n for a in actions if a.get("type") == "evict_nodes" for n in a.get("nodes") or []})
    first = acting[0] if acting else None
    if not fault.expect:
        right = not acting
    elif first is None:
        right = False
    else:
        named = list(first.get("nodes") or [])
        right = first.get("type") in fault.expect and (named == [node] if fault.names_node
                                                        else not named or sorted(named) == sorted(nodes))
    return {
        "fault": fault.name, "cls": fault.cls, "job": job, "node": node, "rank": rank, "injected": what,
        "action": f"{first.get('type')} {','.join(first.get('nodes') or [])}".strip() if first else "none",
        "all_actions": [f"{a.get('type')} {','.join(a.get('nodes') or [])}".strip() for a in actions],
        "incidents": [f"{i.get('status')} {i.get('category')}/{i.get('kind')} "
                      f"[{','.join(str(x.get('node')) for x in i.get('suspects') or [])}]: {str(i.get('title'))[:100]}"
                      f" | {str(i.get('summary'))[:160]}" for i in incidents.values()],
        "right": right, "false_evictions": [n for n in evicted if n != node or not fault.names_node],
        "to_action_s": round(first["_seen_s"], 1) if first else None,
        "job_back_s": round(back_at - t_inj, 1) if back_at else None, "restart": done,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="examples: python benchmarks/realjob.py --quick --workdir /tmp/realjob; "
                                        "python benchmarks/realjob.py --slurm --quick (ETTR on a real Slurm)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--smoke", action="store_true", help="one fault, 2 virtual nodes x 1 rank")
    g.add_argument("--quick", action="store_true", help="five faults")
    ap.add_argument("--faults", help="comma-separated fault names (default: by mode)")
    ap.add_argument("--workdir", default="realjob-run")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (default: removed when all went right)")
    slurm = ap.add_argument_group("--slurm: ETTR on a real Slurm cluster (benchmarks/torchjob/slurm_ettr.py)")
    slurm.add_argument("--slurm", action="store_true", help="the job under LocalSlurm: ETTR of faultlens, "
                       "restart-only and none on one seeded schedule of lost machines")
    slurm.add_argument("--wall-s", type=float, default=0, help="wall time per policy from the first step "
                       "(default 420; --quick 120, --smoke 60)")
    slurm.add_argument("--k-faults", type=int, default=0, help="lost machines per run (default 3; --quick 1)")
    slurm.add_argument("--seed", type=int, default=1)
    slurm.add_argument("--human-scale", type=float, default=0, help="multiplies the on-call delay (1,470 s) "
                       "in a short run (default 1/15; --quick 1/60, --smoke 1/120)")
    slurm.add_argument("--repair-s", type=float, default=None, help="a broken machine is swapped this long "
                       "after the person came (default: the scaled on-call delay)")
    slurm.add_argument("--policies", help="comma-separated subset of faultlens,restart-only,none")
    slurm.add_argument("--ckpt-every", type=int, default=100, help="steps between checkpoints")
    slurm.add_argument("--slurm-detectors", default="none", help="online diagnosis' --detectors (default none: "
                       "the nodes share one host's CPUs, a starved rank is not a slow machine; 'auto' turns them on)")
    args = ap.parse_args()
    if args.slurm:
        from benchmarks.torchjob.slurm_ettr import run

        return run(args)
    names = (args.faults.split(",") if args.faults else SMOKE if args.smoke else QUICK if args.quick
             else [f.name for f in FAULTS])
    faults = [f for f in FAULTS if f.name in names]
    import logging

    logging.getLogger("kafka").setLevel(logging.ERROR)
    from faultlens.config import load_config
    from faultlens.stream.bus import Consumer

    # --smoke: 2 virtual nodes x 1 rank (every part runs, in about a minute); else 4 x 2 = 8 ranks
    c = (Cluster(Path(args.workdir).resolve(), nodes=2, ranks_per_node=1, ckpt_every=5) if args.smoke
         else Cluster(Path(args.workdir).resolve()))
    t0 = time.time()
    rows = []
    try:
        c.start()
        consumer = Consumer(load_config(None).bus, ["incidents", "actions"], group_id=None, bootstrap=c.bootstrap)
        nodes = [n.name for n in c.vnodes]
        for i, f in enumerate(faults):
            try:
                row = run_case(c, consumer, f, i, nodes)
            except Exception as exc:  # noqa: BLE001 - one case's failure is its row, the others still run
                c.stop_job()
                row = {"fault": f.name, "cls": f.cls, "error": f"the case failed: {exc!r}"[:300]}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        consumer.close()
    finally:
        c.stop()
    print(f"{'fault':26} {'machine':8} {'action':24} {'right':5} {'to action s':>11} {'job back s':>10}")
    for r in rows:
        print(f"{r['fault']:26} {r.get('node', '-'):8} {r.get('action', r.get('error', '-'))[:24]:24} "
              f"{'yes' if r.get('right') else 'NO':5} {r.get('to_action_s') or '-':>11} {r.get('job_back_s') or '-':>10}")
    per_cls: dict[str, list[float]] = {}
    for r in rows:
        if r.get("to_action_s") is not None:
            per_cls.setdefault(r["cls"], []).append(r["to_action_s"])

    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return round(xs[min(len(xs) - 1, int(q * len(xs)))], 1)

    backs = [r["job_back_s"] for r in rows if r.get("job_back_s") is not None]
    import torch

    headline = {
        "bench": "realjob", "torch": torch.__version__, "backend": "gloo", "nodes": c.nodes,
        "ranks": c.nodes * c.ranks_per_node, "faults_right": sum(1 for r in rows if r.get("right")),
        "faults_total": len(rows), "false_evictions": sum(len(r.get("false_evictions", [])) for r in rows),
        "time_to_action_s": {k: {"p50": pct(v, 0.5), "p95": pct(v, 0.95)} for k, v in per_cls.items()},
        "job_back_s": {"p50": pct(backs, 0.5), "max": max(backs)} if backs else None,
        "wrong": [f"{r['fault']}: {r.get('action', r.get('error'))}" for r in rows if not r.get("right")],
        "wall_s": round(time.time() - t0),
    }
    print(json.dumps(headline))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
