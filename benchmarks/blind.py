"""Diagnosis scored blind, on scenarios written the way another tool would write them.

tests/blindgen.py writes batch directories to the contract (DESIGN.md "Batch path") with
its own shapes (node names, 4/8 GPUs, kernel log formats, nvidia-smi strings, torchrun
prefixes, real noise lines) and without any of the simulator's code; each comes with its
ground truth (culprit nodes, the action families an operator accepts). Each directory
goes through `faultlens diagnose DIR --out OUT` as a process; the scorer reads only
`incidents.jsonl` and `actions.jsonl`, as an outside scorer would.

Figures, per kind and overall:
- f1: incident F1 over scenarios. A raised incident is one with severity warning or
  critical that is not resolved; a claim is a critical incident or one acted on beyond
  notify; both name their top-scored suspects. A machine fault is a true positive when a
  raised incident or claim names a culprit; a claim naming another machine is a false
  positive. A job-level fault (user code, NaN, OOM, storage) is found when any incident is
  raised. A healthy run or a recovered flap with any claim is a false positive.
- warned_healthy_nodes: non-culprit nodes named by raised warnings (notify for a person) in
  machine-fault and healthy runs:
  not counted against F1, reported so that noise stays visible.
- action_accuracy: share of scenarios whose actions the truth accepts (Truth.judge).
- false_evictions: nodes in evict_nodes actions that are not culprits.

    python benchmarks/blind.py --smoke      # 4 scenarios, seconds
    python benchmarks/blind.py --quick      # 36 scenarios, under 2 minutes
    python benchmarks/blind.py              # 90 scenarios
    python benchmarks/blind.py --only hang,xid79 --keep /tmp/blind
    python benchmarks/blind.py --hard --seed 201   # every scenario with a distractor, harder variants
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.blindgen import KINDS, Scenario, scenarios, write  # noqa: E402

NEGATIVE = ("healthy", "ib_flap", "ckpt_pause")  # no fault: a claim is a false positive


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x).get("data", {}) for x in path.read_text().splitlines() if x.strip()]


def _named(inc: dict[str, Any]) -> set[str]:
    sus = [s for s in inc.get("suspects") or [] if s.get("node")]
    if not sus:
        return set()
    top = max(float(s.get("score") or 0) for s in sus)
    return {s["node"] for s in sus if float(s.get("score") or 0) >= top - 1e-9}


def score_one(sc: Scenario, out: Path) -> dict[str, Any]:
    """Confusion counts, action verdict and false evictions of one scenario's outputs."""
    incidents, actions = _read(out / "incidents.jsonl"), _read(out / "actions.jsonl")
    acted = {a.get("incident_id") for a in actions if a.get("type") != "notify"}
    raised = [i for i in incidents if i.get("severity") in ("warning", "critical") and i.get("status") != "resolved"]
    # a claim: a critical incident, or one acted on beyond notify (a warning for a person is not a claim)
    claims = [i for i in incidents if i.get("severity") == "critical" or i.get("id") in acted]
    t = sc.truth
    tp = fp = fn = 0
    if sc.kind in NEGATIVE:
        fp = int(bool(claims))
    elif t.job_level:
        tp = int(bool(raised or claims))
        fn = 1 - tp
    else:
        named = set().union(*(_named(i) for i in raised + claims)) if raised or claims else set()
        tp = int(bool(named & set(t.culprits)))
        fn = 1 - tp
        claimed = set().union(*(_named(i) for i in claims)) if claims else set()
        fp = int(bool(claimed - set(t.culprits)))
    warned = set() if t.job_level else {n for i in raised for n in _named(i)} - set(t.culprits)
    ok, why = t.judge(actions)
    evicted = {n for a in actions if a.get("type") == "evict_nodes" for n in a.get("nodes") or ()}
    return {"name": sc.name, "kind": sc.kind, "tp": tp, "fp": fp, "fn": fn, "action_ok": ok, "why": why,
            "false_evictions": len(evicted - set(t.culprits)), "warned_healthy": len(warned), "want": t.text,
            "incidents": [(i.get("kind"), i.get("severity"), i.get("status"), sorted(_named(i))) for i in incidents]}


def _run(sc: Scenario, root: Path) -> dict[str, Any]:
    d = write(sc, root / sc.name)
    out = root / f"{sc.name}.out"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "faultlens.cli", "diagnose", str(d), "--out", str(out), "--log-level", "ERROR"],
                          capture_output=True, text=True)
    res = score_one(sc, out)
    res["s"] = round(time.perf_counter() - t0, 2)
    if proc.returncode != 0:
        res.update(action_ok=False, why=f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}", tp=0,
                   fn=int(sc.kind not in NEGATIVE))
    return res


def _figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    tp, fp, fn = (sum(r[k] for r in rows) for k in ("tp", "fp", "fn"))
    f1 = 2 * tp / (2 * tp + fp + fn) if (2 * tp + fp + fn) else 1.0
    return {"n": len(rows), "f1": round(f1, 4), "action_accuracy": round(sum(r["action_ok"] for r in rows) / max(len(rows), 1), 4),
            "false_evictions": sum(r["false_evictions"] for r in rows),
            "warned_healthy_nodes": sum(r.get("warned_healthy", 0) for r in rows)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="4 scenarios")
    ap.add_argument("--quick", action="store_true", help="36 scenarios (the kinds in turn: each at least once)")
    ap.add_argument("--count", type=int, default=90)
    ap.add_argument("--seed", type=int, default=1, help="first scenario seed")
    ap.add_argument("--only", default="", help="comma-separated kinds")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--hard", action="store_true", help="every scenario with a distractor and its harder variant")
    ap.add_argument("--keep", default="", help="write directories and outputs here and keep them")
    args = ap.parse_args(argv)
    count = 4 if args.smoke else 36 if args.quick else args.count
    wanted = {x for x in args.only.split(",") if x}
    specs = scenarios(count if not wanted else count * len(KINDS), args.seed, {"hard": True} if args.hard else None)
    if wanted:
        specs = [s for s in specs if s.kind in wanted][:count]
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            rows = list(pool.map(lambda s: _run(s, root), specs))
    for r in rows:
        mark = "ok " if r["action_ok"] and not r["fp"] and not r["fn"] else "MISS"
        print(f"{mark} {r['name']:<24} want: {r['want']:<38} got: {r['why'][:90]}"
              + ("" if mark == "ok " else f"  tp/fp/fn={r['tp']}/{r['fp']}/{r['fn']} incidents={r['incidents'][:4]}"))
    per_kind = {k: _figures([r for r in rows if r["kind"] == k]) for k in KINDS if any(r["kind"] == k for r in rows)}
    overall = _figures(rows)
    print(f"{len(rows)} scenarios in {time.perf_counter() - t_all:.0f} s: {overall}")
    print(json.dumps({"bench": "blind", "scenarios": len(rows), **{k: v for k, v in overall.items() if k != "n"},
                      "per_kind": per_kind}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
