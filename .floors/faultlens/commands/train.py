"""``faultlens train``: fit the fault classifier on simulator suites or labelled incidents.

Sources (one or both):

* ``--suite DIR``: a simulator suite (``faultlens simulate suite``): every
  subdirectory is a batch directory (docs/design.md) with its truth.json beside the
  inputs; DIR itself may be one batch directory.
* ``--from-lake LAKE``: incidents whose ``root_cause`` a person set in the
  explorer, with the telemetry of their job around them from the lake.

Writes the model directory (``model.ubj`` + ``model.json``) and a MODEL_CARD.md
with the data, features and, given ``--eval-suite``, held-out metrics.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from faultlens.argtypes import positive_float, positive_int
from faultlens.collectors.batch import read_batch_dir
from faultlens.config import Config
from faultlens.errors import FaultlensError, ModelError
from faultlens.models.classifier import FaultClassifier

# Reading the lake, evaluation and the model card live with the training code
# (models/training.py); re-exported here for callers of this module.
from faultlens.models.training import Rows, evaluate, lake_rows, scenario_rows, write_model_card  # noqa: F401
from faultlens.stream.topology import Topology

HELP = "train the fault classifier on simulator suites (truth.json) or labelled incidents from the lake"
EXAMPLE = ("faultlens simulate suite --n 40 --seed 1 --out suite1 && "
           "faultlens train --suite suite1 --eval-suite suite2 --out models/shipped")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", action="append", default=[], metavar="DIR",
                        help="simulator suite directory (subdirectories with truth.json); repeatable")
    parser.add_argument("--from-lake", dest="from_lake", metavar="LAKE",
                        help="Parquet lake with labelled incidents (incidents.root_cause set)")
    parser.add_argument("--out", required=True, metavar="DIR", help="where to write the model directory")
    parser.add_argument("--eval-suite", dest="eval_suite", metavar="DIR",
                        help="held-out suite to report macro-F1 on (written to the model card)")
    parser.add_argument("--window-s", dest="window_s", type=positive_float, default=60.0, help="feature window")
    parser.add_argument("--n-estimators", dest="n_estimators", type=positive_int, default=100, help="boosting rounds")
    parser.add_argument("--colsample", type=float, default=0.3,
                        help="share of the features each split may choose from (xgboost colsample_bynode)")
    parser.add_argument("--seed", type=int, default=0)


# --------------------------------------------------------------------------- sources


def batch_dirs(root: Path) -> list[Path]:
    """The batch directories of a suite: ROOT itself when it has truth.json, else its subdirectories."""
    if (root / "truth.json").is_file():
        return [root]
    dirs = sorted(p.parent for p in root.glob("*/truth.json"))
    if not dirs:
        raise ModelError(f"{root}: no truth.json in it or its subdirectories; is it a simulator suite?")
    return dirs


def read_scenario(path: Path) -> tuple[list[Any], Any, dict[str, Any]]:
    """(records, topology, truth) of one batch directory.

    The batch reader puts every text log on the job's clock itself (syslog years,
    dmesg boot times, untimed NCCL lines; estimates are marked
    ``fields["ts_estimated"]``), so its records are taken as they come.
    """

    truth = json.loads((path / "truth.json").read_text())
    topology = Topology.from_job(json.loads((path / "job.json").read_text()))
    records = list(read_batch_dir(path).records())
    return [r for r in records if getattr(r, "ts", None) is not None], topology, truth


def suite_rows(root: Path, *, window_s: float, seed: int, progress: Any = None) -> Any:

    rows = Rows()
    dirs = batch_dirs(root)
    task = progress.add_task(f"features {root.name}", total=len(dirs)) if progress else None
    for d in dirs:
        records, topology, truth = read_scenario(d)
        rows.extend(scenario_rows(records, topology, truth, window_s=window_s, seed=seed))
        if progress:
            progress.advance(task)
    return rows


# --------------------------------------------------------------------------- command


def run(args: argparse.Namespace, config: Config) -> int:
    from rich.console import Console
    from rich.progress import Progress


    console = Console(stderr=True)
    if not args.suite and not args.from_lake:
        raise FaultlensError("give --suite DIR and/or --from-lake LAKE")
    rows = Rows()
    sources = []
    started = time.monotonic()
    with Progress(console=console, transient=True) as progress:
        for suite in args.suite:
            rows.extend(suite_rows(Path(suite), window_s=args.window_s, seed=args.seed, progress=progress))
            sources.append(f"suite {suite}")
        if args.from_lake:
            rows.extend(lake_rows(Path(args.from_lake), window_s=args.window_s))
            sources.append(f"lake {args.from_lake}")
    if not len(rows):
        raise ModelError("no labelled rows found")
    X, y = rows.arrays()
    model = FaultClassifier(n_estimators=args.n_estimators, colsample=args.colsample, seed=args.seed)
    model.fit(X, y, metadata={"source": "; ".join(sources), "window_s": args.window_s,
                              "scenarios": len(set(rows.groups)), "left_out": dict(sorted(rows.left_out.items()))})
    metrics = None
    if args.eval_suite:
        held = suite_rows(Path(args.eval_suite), window_s=args.window_s, seed=args.seed)
        metrics = evaluate(model, held) | {"source": f"suite {args.eval_suite}"}
        model.metadata["eval"] = {"source": args.eval_suite, "macro_f1": metrics["macro_f1"]}
    out = model.save(Path(args.out))
    write_model_card(out, model, metrics)
    counts = Counter(y.tolist())
    console.print(f"trained on {len(y)} rows ({len(counts)} classes) in {time.monotonic() - started:.1f} s "
                  f"-> {out}")
    if metrics:
        console.print(f"held-out macro-F1 {metrics['macro_f1']:.4f} on {metrics['rows']} rows")
    return 0
