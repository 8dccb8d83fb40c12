"""Hangs: is the stuck rank's machine the one evicted, and only it? (issue 23)

Cases: simulator hangs (datasets/, ``hang_stuck_rank`` stuck in a DataLoader, a CUDA
synchronize or a dataset read, on varied tp/pp/dp/cp layouts of 4-32 nodes) and the
hand-written directories of tests/hangcases.py (Megatron, DeepSpeed, DDP, FSDP/Lightning
stacks with different torch install paths and thread names; CUDA sync, event sync, a
native ``.item()`` copy, dataloader queues, dataset and shard reads, a dataloader worker
subprocess stuck in a read, checkpoint save, an async DCP writer in fsync, a busy Python
loop, one NCCL kernel that never returns on one GPU, p2p chains through 4-8 stage
pipelines, two stuck ranks on one node, a node that does not answer the dump, missing
stack files, Flight Recorder dumps in pickle and JSON of versions 1.5-2.7 with and
without stacks; 4-64 nodes). Each is written as a batch directory and run through
`faultlens diagnose`'s code path (collectors.batch.read_batch_dir +
diagnosis.batch.diagnose_records).

Figures: ``culprit_precision`` = culprit machines among the machines the decisive
action names (evict_nodes, else run_diagnostics), ``culprit_recall`` = culprit machines
named / culprit machines, ``evict_recall`` the same for evictions only,
``machines_evicted_per_hang``, ``jobs_left_hung`` = cases with no evict, restart or
diagnostics action (a notification alone leaves the job hung).

    python benchmarks/hangs.py            # every case (~55)
    python benchmarks/hangs.py --quick    # the same cases (under 2 minutes)
    python benchmarks/hangs.py --smoke    # 6 cases, seconds
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from faultlens.collectors.batch import read_batch_dir  # noqa: E402
from faultlens.config import Config  # noqa: E402
from faultlens.datasets.cluster import ClusterSpec  # noqa: E402
from faultlens.datasets.scenario import FaultSpec, Scenario, ScenarioSpec  # noqa: E402
from faultlens.datasets.scenario_files import write_batch_dir  # noqa: E402
from faultlens.diagnosis.batch import diagnose_records  # noqa: E402
from tests.hangcases import cases as handwritten_cases  # noqa: E402
from tests.hangcases import write_case  # noqa: E402

REMEDIES = ("evict_nodes", "restart_job", "run_diagnostics")

# (nodes, tp, pp, dp, cp, order, state): simulator hangs on varied layouts
SIM_LAYOUTS = [
    (4, 8, 1, 4, 1, "tp-cp-dp-pp", "stuck_cuda_sync"), (4, 8, 2, 2, 1, "tp-cp-dp-pp", "stuck_dataloader"),
    (4, 4, 4, 2, 1, "tp-cp-dp-pp", "stuck_io"), (8, 8, 4, 2, 1, "tp-cp-dp-pp", "stuck_cuda_sync"),
    (8, 8, 2, 2, 2, "tp-cp-dp-pp", "stuck_dataloader"), (8, 4, 2, 4, 2, "tp-cp-dp-pp", "stuck_cuda_sync"),
    (8, 8, 8, 1, 1, "tp-cp-dp-pp", "stuck_io"), (16, 8, 4, 4, 1, "tp-cp-pp-dp", "stuck_cuda_sync"),
    (16, 8, 1, 16, 1, "tp-cp-dp-pp", "stuck_dataloader"), (16, 8, 2, 4, 2, "tp-cp-dp-pp", "stuck_io"),
    (32, 8, 4, 8, 1, "tp-cp-dp-pp", "stuck_cuda_sync"), (32, 8, 8, 4, 1, "tp-cp-pp-dp", "stuck_dataloader"),
    (6, 8, 2, 3, 1, "tp-cp-dp-pp", "stuck_cuda_sync"), (12, 8, 4, 3, 1, "tp-cp-dp-pp", "stuck_io"),
    (24, 8, 8, 3, 1, "tp-cp-dp-pp", "stuck_cuda_sync"), (4, 2, 4, 4, 1, "tp-cp-dp-pp", "stuck_dataloader"),
]


def sim_case(i: int, layout: tuple[Any, ...], out: Path) -> tuple[str, Path]:
    nodes, tp, pp, dp, cp, order, state = layout
    cluster = ClusterSpec(nodes=nodes, gpus_per_node=8, tp=tp, pp=pp, dp=dp, cp=cp, order=order, job=f"hsim{i}",
                          num_layers=32 if pp <= 8 else pp)
    name = f"sim-{i:02d}-{state}-{nodes}n-tp{tp}pp{pp}dp{dp}cp{cp}"
    spec = ScenarioSpec(name=name, seed=9100 + i, cluster=cluster, duration_s=600.0,
                        faults=(FaultSpec(kind="hang_stuck_rank", id="f1", params={"state": state}),))
    d = write_batch_dir(Scenario(spec), out / name)
    return name, d


def judge(d: Path, config: Config) -> dict[str, Any]:
    truth = json.loads((d / "truth.json").read_text())
    culprits = set(truth.get("culprits") or (truth["faults"][0]["nodes"] if truth.get("faults") else []))
    t = time.perf_counter()
    data = read_batch_dir(d)
    incidents, actions = diagnose_records(data.job, list(data.records()), config)
    seconds = time.perf_counter() - t
    evicted = {n for a in actions if a.type == "evict_nodes" for n in a.nodes}
    diagnosed = {n for a in actions if a.type == "run_diagnostics" for n in a.nodes}
    named = evicted or diagnosed
    hung = not any(a.type in REMEDIES for a in actions)
    hang = next((i for i in incidents if i.kind == "hang"), None)
    headline = max(hang.suspects, key=lambda s: float(s.get("score") or 0.0))["node"] if hang and hang.suspects else None
    return {"culprits": sorted(culprits), "evicted": sorted(evicted), "named": sorted(named), "hung": hung,
            "actions": [(a.type, list(a.nodes)) for a in actions], "seconds": seconds,
            "headline_named": headline in named if named else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="every case (they are quick); the figures of record")
    ap.add_argument("--smoke", action="store_true", help="6 cases, seconds")
    ap.add_argument("--only", help="comma-separated substrings of case names")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    config = Config()
    tmp = Path(tempfile.mkdtemp(prefix="faultlens-bench-hangs-"))
    t0 = time.perf_counter()
    rows = []
    try:
        hand = handwritten_cases()
        sims = list(enumerate(SIM_LAYOUTS))
        if args.smoke:
            hand = [c for c in hand if c.name in ("cuda-sync-tp8-dp4", "pipeline4-stage2-cuda", "silent-node-tp8-dp8",
                                                  "fr-only-pickle-dataloader")]
            sims = sims[:2]
        work: list[tuple[str, str, Any]] = [("hand", c.name, c) for c in hand] + [("sim", f"sim-{i:02d}", lay) for i, lay in sims]
        if args.only:
            wanted = [w for w in args.only.split(",") if w]
            work = [w for w in work if any(x in w[1] for x in wanted)]
        for src, name, item in work:
            if src == "hand":
                d = write_case(item, tmp / name)
            else:
                name, d = sim_case(int(name.split("-")[1]), item, tmp)
            r = judge(d, config)
            r.update(name=name, source=src)
            rows.append(r)
            shutil.rmtree(d, ignore_errors=True)
            ok = set(r["named"]) == set(r["culprits"]) and not r["hung"]
            acts = "; ".join(t + " " + ",".join(n) for t, n in r["actions"]) or "nothing"
            print(f"{'ok ' if ok else 'MISS'} {name:44} culprit {','.join(r['culprits']):10} -> {acts}  "
                  f"({r['seconds']:.1f} s)", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    named = sum(len(r["named"]) for r in rows)
    hit = sum(len(set(r["named"]) & set(r["culprits"])) for r in rows)
    culprits = sum(len(r["culprits"]) for r in rows)
    evicted = sum(len(r["evicted"]) for r in rows)
    evict_hit = sum(len(set(r["evicted"]) & set(r["culprits"])) for r in rows)
    heads = [r["headline_named"] for r in rows if r["headline_named"] is not None]
    result = {
        "bench": "hangs", "cases": len(rows), "simulator": sum(r["source"] == "sim" for r in rows),
        "handwritten": sum(r["source"] == "hand" for r in rows),
        "culprit_precision": round(hit / max(1, named), 4), "culprit_recall": round(hit / max(1, culprits), 4),
        "evict_precision": round(evict_hit / max(1, evicted), 4), "evict_recall": round(evict_hit / max(1, culprits), 4),
        "machines_evicted_per_hang": round(evicted / max(1, len(rows)), 3),
        "healthy_machines_evicted": evicted - evict_hit,
        "jobs_left_hung": sum(r["hung"] for r in rows),
        "headline_is_the_named_machine": round(sum(heads) / max(1, len(heads)), 4),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(f"\n{len(rows)} hang cases ({result['simulator']} simulator, {result['handwritten']} hand-written): culprit "
          f"precision {result['culprit_precision']:.2f}, recall {result['culprit_recall']:.2f}; evictions: precision "
          f"{result['evict_precision']:.2f}, recall {result['evict_recall']:.2f}, {result['machines_evicted_per_hang']:.2f} "
          f"machines per hang; jobs left hung {result['jobs_left_hung']}; {result['seconds']:.0f} s")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
