"""ETTR of the real job on a real Slurm cluster, three failure policies on one seeded fault schedule.

``benchmarks/realjob.py --slurm`` calls ``run``. For each policy a fresh SlurmJobCluster
(slurmjob.py: LocalSlurm, the services, one agent per Slurm node, ``sbatch --requeue -N 3``) runs
the job for ``wall_s`` from its first step; K lost machines (Xid 79 + SIGKILL, the node stays
broken until repaired) are made at the same seeded offsets, each on the job's node at the seeded
index. Productive time = (highest step at the end - step at the start) x clean step time, where the
clean step time is the run's own mean wall time from one step to the next within an attempt (all
attempts, so the host's load is in it); ETTR = productive / wall.

- faultlens: the runner (``--adapter slurm --execute``) drains the node and requeues the job.
- restart-only: a failed job is requeued on the same nodes at once, the bad one kept (it fails again
  at start there) until a person comes.
- none: the job stays failed until a person comes.

The person (every policy: they also repair the machine) comes ``human_delay_s`` after the machine
broke: datasets/campaign_costs.toml [policy.none] crash_detect_s + page_s + the mean of
localise_min_s..localise_max_s (60 + 900 + 510 = 1,470 s), multiplied by ``human_scale`` in a short
run, and repairs it (swaps it for a good one) ``repair_s`` later.

A fault whose time comes while the job is not running waits until it runs again (so a slow policy
may see fewer faults in the wall time: the table says how many each saw).
"""

from __future__ import annotations

import itertools
import json
import random
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from benchmarks.torchjob.slurmjob import POLICIES, REPO, Person, SlurmJobCluster

COSTS = REPO / "datasets" / "campaign_costs.toml"


def human_delay_s() -> tuple[float, str]:
    """The on-call person's delay to act on a crashed job, and where the figure comes from."""
    none = tomllib.loads(COSTS.read_text())["policy"]["none"]
    parts = (none["crash_detect_s"]["value"], none["page_s"]["value"],
             (none["localise_min_s"]["value"] + none["localise_max_s"]["value"]) / 2)
    return float(sum(parts)), ("datasets/campaign_costs.toml [policy.none]: crash_detect_s + page_s + "
                               "mean(localise_min_s, localise_max_s) = " + " + ".join(f"{p:g}" for p in parts))


def schedule(seed: int, k: int, wall_s: float, job_nodes: int) -> list[tuple[float, int]]:
    """K (offset s, node index) pairs: one offset per equal slice of [0.15, 0.85] x wall."""
    rng = random.Random(seed)
    span = 0.7 * wall_s / k
    return [(round(0.15 * wall_s + i * span + rng.uniform(0.1, 0.6) * span, 1), rng.randrange(job_nodes))
            for i in range(k)]


def run_policy(policy: str, faults: list[tuple[float, int]], *, workdir: Path, wall_s: float, human_s: float,
               repair_s: float, ckpt_every: int, detectors: str = "none") -> dict[str, Any]:
    c = SlurmJobCluster(workdir / policy, policy=policy, ckpt_every=ckpt_every, detectors=detectors)
    c.start()
    person = Person(c, human_delay_s=human_s, repair_s=repair_s)
    made: list[dict[str, Any]] = []
    false_drains: dict[str, str] = {}
    try:
        c.submit()
        first = c.wait_training(since=0, min_step=1, timeout_s=240)
        if first is None:
            return {"policy": policy, "error": "the job did not start"}
        t0 = time.time()
        todo = list(faults)
        while time.time() < t0 + wall_s:
            if todo and time.time() >= t0 + todo[0][0]:
                nodes = c.running_nodes()
                if nodes and c.rank_pids(nodes[0]):  # the job runs: the machine is lost now
                    offset, idx = todo.pop(0)
                    victim = nodes[idx % len(nodes)]
                    step = (c.last_step() or (0, 0.0))[0]
                    made.append({"at_s": round(time.time() - t0, 1), "planned_s": offset, "node": victim,
                                 "step": step, "t": time.time(), "what": c.lose_machine(victim)})
                    person.broke(victim)
            person.tick()
            try:
                drains = c.drained()
            except (RuntimeError, subprocess.TimeoutExpired):
                drains = {}
            for node, reason in drains.items():  # faultlens drained a machine that was not broken
                if reason.startswith("faultlens ") and node not in {f["node"] for f in made}:
                    false_drains.setdefault(node, reason)
            time.sleep(0.5)
        end = t0 + wall_s
        recs = [r for r in c.step_records() if r.get("ts", 0) <= end]
        try:
            drained = c.drained()
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            drained = {"?": str(exc)[:200]}
    finally:
        c.stop()
    start_step = max((r["step"] for r in recs if r["ts"] <= t0), default=0)
    final_step = max((r["step"] for r in recs), default=start_step)
    # The clean step time: the mean wall time from one step to the next of the same attempt, over the whole run
    # (every attempt, whichever nodes; a restart's gap is no such pair), so the host's load at the time is in it.
    gaps = [b["ts"] - a["ts"] for a, b in itertools.pairwise(recs) if b["step"] == a["step"] + 1 and b["ts"] - a["ts"] < 5]
    clean_step_s = statistics.fmean(gaps) if gaps else float("nan")
    for f in made:  # back: the first step of a later attempt (it starts at or below the step it died at)
        back = next((r for r in recs if r["ts"] > f["t"] + 1 and r["step"] <= f["step"] + 1), None)
        f["down_s"] = round(back["ts"] - f["t"], 1) if back else None
        f["lost_steps"] = f["step"] - back["step"] + 1 if back else None
        del f["t"]
    progress = final_step - start_step
    return {"policy": policy, "wall_s": wall_s, "faults": made, "steps": progress,
            "clean_step_s": round(clean_step_s, 4), "productive_s": round(progress * clean_step_s, 1),
            "ettr": round(progress * clean_step_s / wall_s, 3), "restarts": person.restarts,
            "false_evictions": false_drains,
            "drained": drained, "log": c.log}


def run(args: Any) -> int:
    """``realjob.py --slurm``: the table, then the JSON line."""
    import logging

    logging.getLogger("kafka").setLevel(logging.ERROR)
    wall_s = args.wall_s or (60.0 if args.smoke else 120.0 if args.quick else 420.0)
    k = args.k_faults or (1 if args.smoke or args.quick else 3)
    scale = args.human_scale or (1 / 120 if args.smoke else 1 / 60 if args.quick else 1 / 15)
    full_human, source = human_delay_s()
    human_s = full_human * scale
    repair_s = args.repair_s if args.repair_s is not None else human_s
    faults = schedule(args.seed, k, wall_s, 3)
    policies = args.policies.split(",") if args.policies else list(POLICIES)
    print(f"# fault schedule (seed {args.seed}): " + ", ".join(f"+{o:g} s node #{i}" for o, i in faults), flush=True)
    print(f"# a person acts {human_s:.0f} s after a machine breaks: {source} = {full_human:g} s, "
          f"scaled x{scale:.4g} for this short run; repair {repair_s:.0f} s later", flush=True)
    rows = []
    t_all = time.time()
    for policy in policies:
        row = run_policy(policy, faults, workdir=Path(args.workdir).resolve() / "slurm", wall_s=wall_s,
                         human_s=human_s, repair_s=repair_s, ckpt_every=args.ckpt_every,
                         detectors=args.slurm_detectors)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(f"{'policy':13} {'faults':>6} {'steps':>6} {'clean step s':>12} {'productive s':>12} {'wall s':>6} "
          f"{'ETTR':>6} {'down s per fault':>18} {'false evictions':>15}")
    for r in rows:
        downs = ", ".join("-" if f["down_s"] is None else f"{f['down_s']:g}" for f in r.get("faults", []))
        print(f"{r['policy']:13} {len(r.get('faults', [])):>6} {r.get('steps', '-'):>6} {r.get('clean_step_s', '-'):>12} "
              f"{r.get('productive_s', '-'):>12} {wall_s:>6g} {r.get('ettr', '-'):>6} {downs or '-':>18} "
              f"{len(r.get('false_evictions', {})):>15}")
    import torch

    downs = [f["down_s"] for r in rows if r["policy"] == "faultlens" for f in r.get("faults", []) if f["down_s"]]
    print(json.dumps({
        "bench": "realjob-slurm", "torch": torch.__version__, "backend": "gloo", "slurm_nodes": 4, "job_nodes": 3,
        "seed": args.seed, "k_faults": k, "wall_s": wall_s, "human_delay_s": round(human_s, 1),
        "human_scale": round(scale, 4), "repair_s": round(repair_s, 1),
        "ettr": {r["policy"]: r.get("ettr") for r in rows},
        "faults_seen": {r["policy"]: len(r.get("faults", [])) for r in rows},
        "false_evictions": {r["policy"]: len(r.get("false_evictions", {})) for r in rows},
        "faultlens_down_s": {"median": statistics.median(downs), "max": max(downs)} if downs else None,
        "detectors": args.slurm_detectors, "load_1m": round(__import__("os").getloadavg()[0], 1), "total_s": round(time.time() - t_all),
    }))
    return 0
