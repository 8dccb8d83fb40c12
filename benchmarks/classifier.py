"""Fault classifier: macro-F1 on a held-out suite and per-machine scoring latency.

Trains on one simulator suite and evaluates on another generated with a
different seed and different cluster sizes (no scenario, seed or cluster size
shared), reading both through the batch-directory parsers exactly as
``faultlens train`` does. Then times scoring one window of a 1,024-GPU
(128-node) job: the model alone on 128 feature rows, and feature extraction
plus scoring from that window's raw records.

    python benchmarks/classifier.py [--quick] [--source sim|synthetic]
        [--train-suite DIR --test-suite DIR] [--ship]

``--ship`` writes the trained model and its card to models/shipped.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from faultlens.commands.train import evaluate, suite_rows, write_model_card  # noqa: E402
from faultlens.models.classifier import SHIPPED, FaultClassifier  # noqa: E402
from faultlens.models.features import FEATURES, WindowFeatures  # noqa: E402
from faultlens.models.training import Rows, scenario_rows  # noqa: E402


def sim_suite(out: Path, n: int, seed: int, min_nodes: int, max_nodes: int) -> Path:
    from faultlens.datasets.suite import write_suite

    return write_suite(out, n, seed, min_nodes=min_nodes, max_nodes=max_nodes)


def synthetic_rows(seed: int, sizes: tuple[int, ...], per_kind: int) -> Rows:
    from tests import scengen

    rows = Rows()
    for sc in scengen.suite(seed=seed, sizes=sizes, per_kind=per_kind):
        rows.extend(scenario_rows(sc.records, sc.topology, sc.truth))
    return rows


def latency(model: FaultClassifier, repeats: int) -> dict[str, float]:
    """Scoring one window of a 128-node x 8-GPU job (seeded synthetic records)."""
    from tests import scengen

    sc = scengen.scenario("thermal_throttle", nodes=128, seed=5, duration_s=180.0, onset_s=60.0,
                          gpu_interval_s=1.0)
    start = sc.truth["start_ts"]
    warm = [r for r in sc.records if r.ts < start + 120.0]
    window = [r for r in sc.records if start + 120.0 <= r.ts < start + 180.0]
    wf = WindowFeatures()
    wf.set_topology(sc.topology)
    wf.window(warm, sc.topology.nodes, end_ts=start + 120.0)
    t = time.perf_counter()
    rows = wf.window(window, sc.topology.nodes, end_ts=start + 180.0)
    extract_s = time.perf_counter() - t
    model.score_rows(rows)  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        model.score_rows(rows)
        times.append(time.perf_counter() - t)
    return {"machines": len(rows), "records": len(window), "score_ms": 1000 * float(np.median(times)),
            "score_p99_ms": 1000 * float(np.percentile(times, 99)), "extract_ms": 1000 * extract_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--source", choices=("sim", "synthetic"), default="sim")
    ap.add_argument("--train-suite", dest="train_suite", metavar="DIR")
    ap.add_argument("--test-suite", dest="test_suite", metavar="DIR")
    ap.add_argument("--n", type=int, default=None, help="scenarios per suite")
    ap.add_argument("--ship", action="store_true", help="write the model to models/shipped")
    args = ap.parse_args(argv)
    started = time.monotonic()
    source = args.source
    with tempfile.TemporaryDirectory(prefix="faultlens-bench-") as tmp:
        if args.train_suite and args.test_suite:
            source = "sim"
            train = suite_rows(Path(args.train_suite), window_s=60.0, seed=0)
            test = suite_rows(Path(args.test_suite), window_s=60.0, seed=0)
            train_desc, test_desc = args.train_suite, args.test_suite
        elif source == "sim":
            n = args.n or (16 if args.quick else 96)
            lo_train, hi_train, lo_test, hi_test = (2, 3, 4, 5) if args.quick else (2, 8, 9, 16)
            tr = sim_suite(Path(tmp) / "train", n, 11, lo_train, hi_train)
            print(f"  train suite written ({time.monotonic() - started:.0f} s)", file=sys.stderr)
            train = suite_rows(tr, window_s=60.0, seed=0)
            te = sim_suite(Path(tmp) / "test", max(16, n // 2), 22, lo_test, hi_test)
            print(f"  test suite written ({time.monotonic() - started:.0f} s)", file=sys.stderr)
            test = suite_rows(te, window_s=60.0, seed=0)
            train_desc = f"simulator suite seed 11, {n} scenarios, {lo_train}-{hi_train} nodes"
            test_desc = f"simulator suite seed 22, {max(16, n // 2)} scenarios, {lo_test}-{hi_test} nodes"
        else:
            per = 1 if args.quick else 3
            train = synthetic_rows(11, (4, 8), per)
            test = synthetic_rows(22, (6, 12), max(1, per - 1))
            train_desc = f"tests/scengen.py seed 11, {per} per kind, 4/8 nodes"
            test_desc = "tests/scengen.py seed 22, 6/12 nodes"
    print(f"  features: {len(train)} train rows, {len(test)} test rows ({time.monotonic() - started:.0f} s)",
          file=sys.stderr)
    X, y = train.arrays()
    model = FaultClassifier(seed=0).fit(X, y, metadata={"source": train_desc, "window_s": 60.0,
                                                        "scenarios": len(set(train.groups))})
    metrics = evaluate(model, test) | {"source": test_desc}
    lat = latency(model, repeats=5 if args.quick else 30)
    print(f"\nfault classifier ({len(FEATURES)} features, {len(model.classes_ or [])} classes)")
    print(f"train: {train_desc}; {len(train)} machine-windows")
    print(f"test:  {test_desc}; {len(test)} machine-windows\n")
    print(f"{'class':>20} {'precision':>9} {'recall':>7} {'F1':>6} {'support':>8}")
    for k, v in metrics["per_class"].items():
        print(f"{k:>20} {v['precision']:>9.3f} {v['recall']:>7.3f} {v['f1']:>6.3f} {v['support']:>8}")
    print(f"\nmacro-F1 {metrics['macro_f1']:.4f}")
    print(f"scoring a {lat['machines']}-machine (1,024-GPU) window: model {lat['score_ms']:.1f} ms "
          f"(p99 {lat['score_p99_ms']:.1f}); features from {lat['records']} raw records {lat['extract_ms']:.0f} ms")
    if args.ship:
        model.metadata["eval"] = {"source": test_desc, "macro_f1": metrics["macro_f1"]}
        out = model.save(SHIPPED)
        write_model_card(out, model, metrics)
        print(f"shipped -> {out}")
    print(f"elapsed {time.monotonic() - started:.0f} s")
    print(json.dumps({"bench": "classifier", "source": source, "macro_f1": round(metrics["macro_f1"], 4),
                      "train_rows": len(train), "test_rows": len(test),
                      "score_ms_128_machines": round(lat["score_ms"], 2),
                      "extract_ms_128_machines": round(lat["extract_ms"], 1),
                      "per_class_f1": {k: v["f1"] for k, v in metrics["per_class"].items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
