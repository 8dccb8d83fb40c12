"""``faultlens train``: fit the fault classifier on simulator suites or labelled incidents.

Sources (one or both):

* ``--suite DIR``: a simulator suite (``faultlens simulate suite``): every
  subdirectory is a batch directory (DESIGN.md) with its truth.json beside the
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

from faultlens.config import Config
from faultlens.errors import FaultlensError, LakeError, ModelError

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
    parser.add_argument("--window-s", dest="window_s", type=float, default=60.0, help="feature window")
    parser.add_argument("--n-estimators", dest="n_estimators", type=int, default=100, help="boosting rounds")
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
    from faultlens.stream.topology import Topology

    try:
        from faultlens.collectors.batch import read_batch_dir
    except ImportError as exc:
        raise ModelError("reading batch directories needs faultlens.collectors.batch (not built yet)") from exc
    truth = json.loads((path / "truth.json").read_text())
    topology = Topology.from_job(json.loads((path / "job.json").read_text()))
    records = list(read_batch_dir(path).records())
    return [r for r in records if getattr(r, "ts", None) is not None], topology, truth


def suite_rows(root: Path, *, window_s: float, seed: int, progress: Any = None) -> Any:
    from faultlens.models.training import Rows, scenario_rows

    rows = Rows()
    dirs = batch_dirs(root)
    task = progress.add_task(f"features {root.name}", total=len(dirs)) if progress else None
    for d in dirs:
        records, topology, truth = read_scenario(d)
        rows.extend(scenario_rows(records, topology, truth, window_s=window_s, seed=seed))
        if progress:
            progress.advance(task)
    return rows


def lake_rows(lake: Path, *, window_s: float) -> Any:
    """Rows around every labelled incident in the lake."""
    import duckdb

    from faultlens.models.training import Rows, incident_rows
    from faultlens.stream import schema
    from faultlens.stream.topology import Topology

    def table(name: str) -> str:
        files = list((lake / name).glob("**/*.parquet"))
        if not files:
            raise LakeError(f"{lake}: no Parquet files for table {name}")
        return f"read_parquet('{lake / name}/**/*.parquet', hive_partitioning=true, union_by_name=true)"

    con = duckdb.connect()

    def dicts(cur: Any) -> list[dict[str, Any]]:
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, row, strict=True)) for row in cur.fetchall()]

    try:
        incidents = dicts(con.execute(
            f"select * from {table('incidents')} where root_cause is not null and root_cause <> ''"
        ))
        # The latest update of each incident carries the label.
        latest: dict[str, dict[str, Any]] = {}
        for inc in incidents:
            if inc["id"] not in latest or inc["updated_ts"] >= latest[inc["id"]]["updated_ts"]:
                latest[inc["id"]] = inc
        jobs = {j["job"]: j for j in dicts(con.execute(f"select * from {table('jobs')}"))}
        rows = Rows()
        for inc in latest.values():
            job = jobs.get(inc["job"])
            if job is None:
                continue
            job["ranks"] = json.loads(job["ranks"]) if isinstance(job["ranks"], str) else job["ranks"]
            topology = Topology.from_job(job)
            inc["suspects"] = json.loads(inc["suspects"]) if isinstance(inc["suspects"], str) else inc["suspects"]
            lo, hi = float(inc["opened_ts"]) - 600.0, float(inc["opened_ts"]) + 300.0
            records: list[Any] = []
            nodes = topology.nodes
            queries = {
                "steps": ("select * from {} where job = ? and ts >= ? and ts < ?", [inc["job"], lo, hi]),
                "kernel": ("select * from {} where list_contains(?, node) and ts >= ? and ts < ?", [nodes, lo, hi]),
                "nccl": ("select * from {} where list_contains(?, node) and ts >= ? and ts < ?", [nodes, lo, hi]),
                "gpu": ("select * from {} where list_contains(?, node) and ts >= ? and ts < ? order by ts, node, gpu",
                        [nodes, lo, hi]),
            }
            found: dict[str, list[dict[str, Any]]] = {}
            for kind, (sql, params) in queries.items():
                try:
                    found[kind] = dicts(con.execute(sql.format(table(kind)), params))
                except LakeError:
                    found[kind] = []  # a table the lake does not have yet
            records: list[Any] = []
            for kind in ("steps", "kernel", "nccl"):
                for r in found[kind]:
                    for col in schema.json_columns(kind):
                        if isinstance(r.get(col), str):
                            r[col] = json.loads(r[col])
                    records.append(schema.from_dict(kind, r))
            gpu_rows = found["gpu"]
            samples: dict[tuple[float, str], list[dict[str, Any]]] = {}
            for g in gpu_rows:
                samples.setdefault((g["ts"], g["node"]), []).append(g)
            for (ts, node), gs in samples.items():
                states = [{**{k: v for k, v in g.items() if v is not None}, "index": g["gpu"]} for g in gs]
                records.append(schema.from_dict("gpu", {"v": schema.SCHEMA_VERSION, "ts": ts, "node": node,
                                                        "job": inc["job"], "gpus": states}))
            rows.extend(incident_rows(records, topology, inc, window_s=window_s))
        return rows
    except duckdb.Error as exc:
        raise LakeError(f"{lake}: {exc}") from None
    finally:
        con.close()


# --------------------------------------------------------------------------- evaluation and card


def evaluate(model: Any, rows: Any) -> dict[str, Any]:
    """Macro-F1 and the per-class table of ``model`` on labelled rows.

    Also the macro-F1 under strict labels (truth's onset alone, every window
    scored, catalogs/labels.toml's evidence rule not applied) and the windows
    that rule left out, per fault kind.
    """
    from sklearn.metrics import f1_score, precision_recall_fscore_support

    X, y = rows.arrays()
    pred = model.predict(X)
    labels = sorted(set(y) | set(pred))
    p, r, f, s = precision_recall_fscore_support(y, pred, labels=labels, zero_division=0)
    Xs, ys = rows.arrays(strict=True)
    ps = model.predict(Xs)
    return {"macro_f1": float(f1_score(y, pred, labels=sorted(set(y)), average="macro", zero_division=0)),
            "strict_macro_f1": float(f1_score(ys, ps, labels=sorted(set(ys)), average="macro", zero_division=0)),
            "rows": len(y), "left_out": dict(sorted(rows.left_out.items())),
            "per_class": {lab: {"precision": round(float(p[i]), 4), "recall": round(float(r[i]), 4),
                                "f1": round(float(f[i]), 4), "support": int(s[i])} for i, lab in enumerate(labels)}}


def write_model_card(path: Path, model: Any, metrics: dict[str, Any] | None) -> Path:
    from faultlens.models.features import FEATURE_SET_VERSION

    meta = model.metadata
    prm = model.params
    left = meta.get("left_out") or {}
    lines = [
        "# Model card: fault classifier", "",
        f"- Model: xgboost gradient-boosted trees (`multi:softprob`), {prm['n_estimators']} rounds, "
        f"depth {prm['max_depth']}, eta {prm['learning_rate']}, {prm.get('colsample', 1.0)} of the features per "
        f"split (`colsample_bynode`), classes weighted to balance, seed {prm['seed']}; xgboost {meta.get('xgboost')} "
        "(the `xgboost-cpu` wheel).",
        f"- Feature set: v{FEATURE_SET_VERSION}, {len(model.features)} features per machine per "
        f"{meta.get('window_s', 60)} s window (models/features.py). A model from another feature-set version "
        "refuses to load (FeatureMismatch).",
        f"- Classes: {', '.join(model.classes_ or [])}.",
        f"- Trained: {meta.get('trained_at')} on {meta.get('rows')} machine-windows of {meta.get('scenarios', '?')} "
        f"scenarios from {meta.get('source', '?')}.",
        "- Labels: models/catalogs/labels.toml. Machine faults label the machines truth names from the onset "
        "window on, where the window's features show the fault's evidence; named machines' windows without it "
        "inside the fault (or with it outside) are left out"
        + (f" ({sum(left.values())} training windows: "
           + ", ".join(f"{k} {v}" for k, v in left.items()) + ")" if left else "")
        + ". Job-wide faults label every machine, by the share of the window's steps (or time) inside the fault.",
        "", "## Training data", "", "| class | rows |", "|---|---:|",
        *[f"| {k} | {v} |" for k, v in meta.get("class_counts", {}).items()], "",
        "## Features", "", ", ".join(f"`{f}`" for f in model.features), "",
    ]
    if metrics:
        held_left = metrics.get("left_out") or {}
        lines += ["## Held-out evaluation", "", f"Source: {metrics.get('source', '?')}; {metrics['rows']} "
                  f"machine-windows; **macro-F1 {metrics['macro_f1']:.4f}**"
                  + (f" (strict labels, every window from truth's onset, no evidence rule: "
                     f"{metrics['strict_macro_f1']:.4f})" if "strict_macro_f1" in metrics else "") + "."
                  + (f" Left out by the evidence rule: {sum(held_left.values())} windows ("
                     + ", ".join(f"{k} {v}" for k, v in held_left.items()) + ")." if held_left else ""), "",
                  "| class | precision | recall | F1 | support |", "|---|---:|---:|---:|---:|",
                  *[f"| {k} | {v['precision']:.3f} | {v['recall']:.3f} | {v['f1']:.3f} | {v['support']} |"
                    for k, v in metrics["per_class"].items()], ""]
    if meta.get("latency"):
        lat = meta["latency"]
        lines += ["## Latency", "", f"One 60 s window of a {lat['machines']}-machine, 1,024-GPU job "
                  f"({lat['records']} records): feature extraction {lat['extract_ms']:.0f} ms, scoring the "
                  f"{lat['machines']} rows {lat['score_ms']:.1f} ms (median; single thread, shared machine).", ""]
    lines += ["## Limits", "", meta.get("limits", "Trained on simulated data: figures on real clusters will be lower "
              "until it is retrained on labelled incidents (`faultlens train --from-lake`)."), ""]
    card = path / "MODEL_CARD.md"
    card.write_text("\n".join(lines))
    return card


# --------------------------------------------------------------------------- command


def run(args: argparse.Namespace, config: Config) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from faultlens.models.classifier import FaultClassifier
    from faultlens.models.training import Rows

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
