"""Training rows for the fault classifier: one per machine per window, labelled.

Two label sources, one row builder (``features.WindowFeatures``, the same code
that scores online):

* ``scenario_rows``: a simulator scenario's records with its truth.json
  (``classifier.window_label``);
* ``incident_rows``: labelled incidents from the lake (``root_cause`` set by a
  person in the explorer): the windows of the incident's job around its
  opening, its suspects labelled with the root cause, the other machines
  healthy (``lake_rows`` reads them).

``evaluate`` scores a model on labelled rows; ``write_model_card`` writes the card
that ships beside it.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from faultlens import schema
from faultlens.errors import LakeError
from faultlens.models.classifier import HEALTHY, window_label
from faultlens.models.features import FEATURE_SET_VERSION, FEATURES, WindowFeatures
from faultlens.schema import StepTiming
from faultlens.stream.catalog import sql_literal
from faultlens.stream.topology import Topology


@dataclass
class Rows:
    """Feature rows with labels; ``groups`` names the scenario each row came from.

    ``left_out`` counts, per fault kind, the machine-windows no label can be right
    for (catalogs/labels.toml: the fault's evidence is not in the window, or shows
    outside the fault); they are neither trained on nor in ``arrays()``. Every row
    also keeps its strict label (truth's onset and time coverage alone, no
    evidence rule): ``arrays(strict=True)`` gives all rows with those, so that a
    benchmark can show both.
    """

    X: dict[str, list[float]] = field(default_factory=lambda: {f: [] for f in FEATURES})
    y: list[str] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    y_strict: list[str] = field(default_factory=list)
    left_out: Counter[str] = field(default_factory=Counter)
    left_out_X: dict[str, list[float]] = field(default_factory=lambda: {f: [] for f in FEATURES})
    left_out_strict: list[str] = field(default_factory=list)

    def add(self, row: dict[str, float], label: str | None, group: str, strict: str | None = None,
            kind: str = "?") -> None:
        """One machine-window; ``label`` None leaves it out (counted under ``kind``)."""
        if label is None:
            for f in FEATURES:
                self.left_out_X[f].append(row[f])
            self.left_out_strict.append(strict or HEALTHY)
            self.left_out[kind] += 1
            return
        for f in FEATURES:
            self.X[f].append(row[f])
        self.y.append(label)
        self.groups.append(group)
        self.y_strict.append(strict or label)

    def extend(self, other: Rows) -> None:
        for f in FEATURES:
            self.X[f].extend(other.X[f])
            self.left_out_X[f].extend(other.left_out_X[f])
        self.y.extend(other.y)
        self.groups.extend(other.groups)
        self.y_strict.extend(other.y_strict)
        self.left_out.update(other.left_out)
        self.left_out_strict.extend(other.left_out_strict)

    def arrays(self, *, strict: bool = False) -> tuple[dict[str, np.ndarray], np.ndarray]:
        if strict:
            return ({f: np.asarray(v + self.left_out_X[f], dtype=float) for f, v in self.X.items()},
                    np.asarray(self.y_strict + self.left_out_strict))
        return {f: np.asarray(v, dtype=float) for f, v in self.X.items()}, np.asarray(self.y)

    def __len__(self) -> int:
        return len(self.y)


def windows(records: Iterable[Any], start_ts: float, end_ts: float, window_s: float) -> Iterable[tuple[float, list]]:
    """(window start, records in it) for consecutive windows of [start_ts, end_ts)."""
    recs = sorted((r for r in records if getattr(r, "ts", None) is not None), key=lambda r: r.ts)
    n = max(1, math.ceil((end_ts - start_ts) / window_s))
    i = 0
    for k in range(n):
        lo, hi = start_ts + k * window_s, start_ts + (k + 1) * window_s
        chunk = []
        while i < len(recs) and recs[i].ts < hi:
            if recs[i].ts >= lo:
                chunk.append(recs[i])
            i += 1
        yield lo, chunk


def scenario_rows(records: Iterable[Any], topology: Topology, truth: dict[str, Any], *,
                  window_s: float = 60.0, seed: int = 0) -> Rows:
    """Labelled rows of one scenario (records + truth.json)."""
    wf = WindowFeatures(seed=seed)
    wf.set_topology(topology)
    start = float(truth["start_ts"])
    end = start + float(truth["duration_s"])
    rows = Rows()
    group = f"{truth.get('scenario', '?')}:{truth.get('seed', '?')}"
    kind = "/".join(sorted({f["kind"] for f in truth.get("faults", [])})) or HEALTHY
    for lo, chunk in windows(records, start, end, window_s):
        feats = wf.window(chunk, topology.nodes, end_ts=lo + window_s)
        starts = step_starts(chunk, topology.job or None)
        for node in sorted(feats):
            label = window_label(truth, node, lo, lo + window_s, linger_s=wf.lookback_s, row=feats[node],
                                 step_starts=starts)
            strict = window_label(truth, node, lo, lo + window_s, linger_s=wf.lookback_s)
            rows.add(feats[node], label, group, strict, kind)
    return rows


def step_starts(records: Iterable[Any], job: str | None) -> list[float]:
    """When each of the job's steps (any job's: None) that ended in ``records`` started.

    A step belongs to what was going on when it started: its batch (long sequences)
    was drawn then.
    """
    starts: dict[int, float] = {}
    for r in records:
        if isinstance(r, StepTiming) and (job is None or r.job == job):
            t = r.ts - r.duration_s
            if r.step not in starts or t < starts[r.step]:
                starts[r.step] = t
    return sorted(starts.values())


def incident_rows(records: Iterable[Any], topology: Topology, incident: dict[str, Any], *,
                  window_s: float = 60.0, before_s: float = 600.0, after_s: float = 300.0) -> Rows:
    """Rows around a labelled incident: suspects carry ``root_cause`` from its opening on."""
    label = str(incident["root_cause"])
    opened = float(incident["opened_ts"])
    suspects = {s.get("node") for s in incident.get("suspects") or [] if isinstance(s, dict)}
    truth = {"start_ts": opened - before_s, "duration_s": before_s + after_s, "scenario": incident.get("id"),
             "faults": [{"kind": label, "nodes": sorted(n for n in suspects if n), "onset_ts": opened,
                         "end_ts": None}] if label != HEALTHY else []}
    return scenario_rows(records, topology, truth, window_s=window_s)


# --------------------------------------------------------------------------- labelled incidents from the lake


def lake_rows(lake: Path, *, window_s: float) -> Any:
    """Rows around every labelled incident in the lake."""
    import duckdb


    def table(name: str) -> str:
        files = list((lake / name).glob("**/*.parquet"))
        if not files:
            raise LakeError(f"{lake}: no Parquet files for table {name}")

        glob = sql_literal(f"{lake / name}/**/*.parquet")
        return f"read_parquet({glob}, hive_partitioning=true, union_by_name=true)"

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
    """MODEL_CARD.md beside the model: data, features, held-out metrics, latency and limits."""

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
