"""Fault classifier: names the fault category of a machine from its window features.

Gradient-boosted trees (xgboost; the project installs the ``xgboost-cpu`` wheel,
which provides the same ``xgboost`` module without the several-hundred-MB NCCL
package a CPU-only classifier never uses) over ``features.FEATURES``.

Classes are the simulator's fault kinds (the shared vocabulary in the project
brief: gpu_lost, ecc_uncorrectable, ..., seq_surge) plus ``healthy``: the kinds
say both what broke and what to do (``KIND_ACTION``), which DESIGN's coarser
explain categories do not; ``KIND_CATEGORY`` maps each kind onto them.

A model is saved as a directory: ``model.ubj`` (xgboost's binary JSON) and
``model.json`` (feature list, feature-set version, classes, parameters,
training metadata). Loading a model built for another feature set fails with
``FeatureMismatch`` naming both versions.
"""

from __future__ import annotations

import json
import math
import operator
import platform
import re
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from faultlens.config import read_catalog
from faultlens.errors import CatalogError, FeatureMismatch, ModelError, NotFittedError
from faultlens.models.features import FEATURE_SET_VERSION, FEATURES, WindowFeatures
from faultlens.models.params import load_params
from faultlens.models.predictor import _columns
from faultlens.schema import Finding
from faultlens.stream.topology import Topology
from faultlens.vocabulary import FAULT_CATEGORY, Category, FaultKind, LineAction, Severity

HEALTHY = FaultKind.HEALTHY.value
KIND_CATEGORY = FAULT_CATEGORY
KIND_ACTION: dict[str, LineAction] = {  # what a finding of each class asks for (per-line action vocabulary)
    FaultKind.GPU_LOST: LineAction.EVICT_NODE, FaultKind.ECC_UNCORRECTABLE: LineAction.EVICT_NODE,
    FaultKind.ROW_REMAP_FAILURE: LineAction.EVICT_NODE, FaultKind.NVLINK_ERROR: LineAction.EVICT_NODE,
    FaultKind.IB_LINK_PERSISTENT: LineAction.EVICT_NODE, FaultKind.IB_FLAP_TRANSIENT: LineAction.NONE,
    FaultKind.PCIE_DEGRADATION: LineAction.EVICT_NODE, FaultKind.THERMAL_THROTTLE: LineAction.EVICT_NODE,
    FaultKind.HOST_OOM: LineAction.RESTART_JOB, FaultKind.HUNG_TASK: LineAction.RUN_DIAGNOSTICS,
    FaultKind.USER_EXCEPTION: LineAction.ROLLBACK_CODE, FaultKind.NAN_LOSS: LineAction.RUN_DIAGNOSTICS,
    FaultKind.HANG_STUCK_RANK: LineAction.EVICT_NODE, FaultKind.SLOW_STORAGE: LineAction.NOTIFY,
    FaultKind.SEQ_SURGE: LineAction.NONE, FaultKind.HEALTHY: LineAction.NONE,
}
# The finding an unsure classifier emits instead of a fault (a note for the incident, never an incident).
DEFERRED = "classifier_deferred"
MODEL_FILE = "model.ubj"
SIDECAR_FILE = "model.json"
LABEL_CATALOG = Path(__file__).resolve().parent / "catalogs" / "labels.toml"
_OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}
_CONDITION = re.compile(r"^\s*(\w+)\s*(>=|<=|>|<)\s*(-?[0-9.]+(?:[eE][-+]?\d+)?)\s*$")


@dataclass(frozen=True)
class LabelRules:
    """How truth labels windows (models/catalogs/labels.toml): job-wide kinds and evidence conditions."""

    job_wide: dict[str, str]  # kind -> "steps" | "time"
    evidence: dict[str, tuple[tuple[str, Callable[[float, float], bool], float], ...]]

    def shows(self, kind: str, row: dict[str, float]) -> bool:
        """Whether a feature row shows the evidence of ``kind`` (True for a kind without conditions)."""
        conds = self.evidence.get(kind)
        return not conds or any(op(row[f], v) for f, op, v in conds)


def load_label_rules(path: str | Path | None = None) -> LabelRules:
    """The label catalog; a bad entry names file and entry."""
    file = Path(path) if path else LABEL_CATALOG
    data = read_catalog(file)
    unknown = set(data) - {"job_wide", "evidence"}
    if unknown:
        raise CatalogError("unknown table; known: job_wide, evidence", file=str(file), entry=sorted(unknown)[0])
    job_wide: dict[str, str] = {}
    for kind, how in data.get("job_wide", {}).items():
        if kind not in KIND_ACTION or kind == HEALTHY:
            raise CatalogError("unknown fault kind", file=str(file), entry=f"job_wide.{kind}")
        if how not in ("steps", "time"):
            raise CatalogError(f"expected \"steps\" or \"time\", got {how!r}", file=str(file),
                               entry=f"job_wide.{kind}")
        job_wide[kind] = how
    evidence: dict[str, tuple[tuple[str, Callable[[float, float], bool], float], ...]] = {}
    for kind, conds in data.get("evidence", {}).items():
        where = f"evidence.{kind}"
        if kind not in KIND_ACTION or kind == HEALTHY or kind in job_wide:
            raise CatalogError("not a machine fault kind", file=str(file), entry=where)
        if not isinstance(conds, list) or not conds:
            raise CatalogError("expected a non-empty list of conditions", file=str(file), entry=where)
        parsed = []
        for cond in conds:
            m = _CONDITION.match(str(cond))
            if m is None:
                raise CatalogError(f"bad condition {cond!r}; expected \"feature op number\"", file=str(file),
                                   entry=where)
            if m.group(1) not in FEATURES:
                raise CatalogError(f"unknown feature {m.group(1)!r}", file=str(file), entry=where)
            parsed.append((m.group(1), _OPS[m.group(2)], float(m.group(3))))
        evidence[kind] = tuple(parsed)
    return LabelRules(job_wide, evidence)


LABEL_RULES = load_label_rules()
# Faults of the whole job, not of a machine: every machine's window carries the label.
JOB_WIDE_KINDS = frozenset(LABEL_RULES.job_wide)


def window_label(truth: dict[str, Any], node: str, start_ts: float, end_ts: float, *,
                 linger_s: float = 0.0, row: dict[str, float] | None = None,
                 step_starts: Sequence[float] | None = None, rules: LabelRules | None = None) -> str | None:
    """The class of ``node`` in [start_ts, end_ts) by a truth.json, or None: the window is left out.

    A machine fault labels only the machines it names, from the window its onset
    falls in; a fault that ended still labels windows up to ``linger_s`` later (the
    features' event lookback still shows it). Given the window's feature ``row``,
    a kind with evidence conditions (catalogs/labels.toml) labels only windows
    showing them, and a named machine's window showing them outside the fault
    is left out too. A job-wide fault labels every machine: by ``step_starts``
    (when the job's steps that ended in the window started; more than half
    inside the fault) when its evidence is step statistics, else by time
    covered. When two overlap, the one named first in truth.json wins.
    """
    rules = rules or LABEL_RULES
    evidence_outside = False
    for fault in truth.get("faults", []):
        onset = float(fault.get("onset_ts", math.inf))
        end = fault.get("end_ts")
        kind = fault["kind"]
        named = set(fault.get("nodes") or [])
        if kind in rules.job_wide:
            stop = end_ts if end is None else min(float(end), end_ts)
            if rules.job_wide[kind] == "steps" and step_starts:
                inside = sum(1 for t in step_starts if onset <= t and (end is None or t < float(end)))
                if 2 * inside > len(step_starts):
                    return kind
            elif stop - max(onset, start_ts) >= 0.5 * (end_ts - start_ts):
                return kind
            continue
        if named and node not in named:
            continue
        if onset >= end_ts or (end is not None and float(end) + linger_s <= start_ts):
            evidence_outside = evidence_outside or (row is not None and bool(named) and rules.shows(kind, row)
                                                  and kind in rules.evidence)
            continue
        if row is not None and not rules.shows(kind, row):
            return None
        return kind
    return None if evidence_outside else HEALTHY


class FaultClassifier:
    """xgboost over window feature rows; classes are fault kinds plus ``healthy``.

    Trees of depth 3 by default: on the held-out family (benchmarks/classifier.py --quick),
    depth 4 and 6 sent healthy windows of a stalled job into hang_stuck_rank depending on the
    seed (its F1 0.76-0.95); depth 3 kept every class at 0.9 or more over seeds 0-2.
    """

    name = "fault_classifier"

    def __init__(self, *, n_estimators: int = 200, max_depth: int = 3, learning_rate: float = 0.1,
                 seed: int = 0, colsample: float = 0.3, tree_method: str = "hist",
                 features: tuple[str, ...] = FEATURES) -> None:
        self.params = {"n_estimators": n_estimators, "max_depth": max_depth, "learning_rate": learning_rate,
                       "seed": seed, "colsample": colsample, "tree_method": tree_method}
        self.features = tuple(features)
        self.classes_: list[str] | None = None
        self.metadata: dict[str, Any] = {}
        self._booster: Any = None

    def _xgb(self):  # noqa: ANN202 - the xgboost module
        try:
            import xgboost
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ModelError("the fault classifier needs xgboost: pip install 'faultlens[ml]'") from exc
        return xgboost

    def fit(self, X: Any, y: Iterable[str], *, metadata: dict[str, Any] | None = None) -> FaultClassifier:
        xgb = self._xgb()
        M = _columns(X, self.features)
        labels = [str(v) for v in y]
        classes = sorted(set(labels))
        if len(classes) < 2:
            raise ModelError(f"the classifier needs at least two classes, got {classes}")
        index = {c: i for i, c in enumerate(classes)}
        target = np.array([index[v] for v in labels])
        counts = Counter(labels)
        # Balance classes: a fault seen in 20 windows must weigh as much as 20,000 healthy ones.
        weight = np.array([len(labels) / (len(classes) * counts[v]) for v in labels])
        dtrain = xgb.DMatrix(M, label=target, weight=weight, feature_names=list(self.features))
        p = self.params
        booster_params = {"objective": "multi:softprob", "num_class": len(classes), "max_depth": p["max_depth"],
                          "eta": p["learning_rate"], "seed": p["seed"], "nthread": 1,
                          "tree_method": p.get("tree_method", "hist"),
                          # Each split sees a random share of the features: a fault with several
                          # pieces of evidence (a counter, an Xid, an NCCL line) is then learnt from
                          # all of them, not only from the one a first split happened to pick.
                          "colsample_bynode": p.get("colsample", 1.0),
                          "eval_metric": "mlogloss", "verbosity": 0}
        self._booster = xgb.train(booster_params, dtrain, num_boost_round=p["n_estimators"])
        self.classes_ = classes
        self.metadata = {"trained_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                         "rows": len(labels), "class_counts": dict(sorted(counts.items())),
                         "xgboost": xgb.__version__, "python": platform.python_version(), **(metadata or {})}
        return self

    def predict_proba(self, X: Any) -> np.ndarray:
        if self._booster is None or self.classes_ is None:
            raise NotFittedError("fault classifier used before fit (train one with `faultlens train`)")
        M = _columns(X, self.features)
        return self.predict_proba_matrix(M)

    def predict_proba_matrix(self, M: np.ndarray) -> np.ndarray:
        if self._booster is None:
            raise NotFittedError("fault classifier used before fit (train one with `faultlens train`)")
        xgb = self._xgb()
        # One thread: a window's rows are too few to repay an OpenMP team (on a shared 2-core host
        # the team made scoring 128 rows take 24 ms instead of 2).
        return self._booster.predict(xgb.DMatrix(M, feature_names=list(self.features), nthread=1))

    def predict(self, X: Any) -> np.ndarray:
        proba = self.predict_proba(X)
        return np.array(self.classes_)[np.argmax(proba, axis=1)]

    def score_rows(self, rows: dict[str, dict[str, float]]) -> dict[str, tuple[str, float]]:
        """node -> (class, probability) for one window's feature rows."""
        return {n: top[0] for n, top in self.top_guesses(rows, 1).items()}

    def top_guesses(self, rows: dict[str, dict[str, float]], k: int = 3) -> dict[str, list[tuple[str, float]]]:
        """node -> its ``k`` likeliest classes with their probabilities, likeliest first."""
        if not rows:
            return {}
        nodes = sorted(rows)
        missing = [f for f in self.features if f not in rows[nodes[0]]]
        if missing:
            raise FeatureMismatch(f"missing features: {', '.join(missing)}")
        M = np.array([[rows[n][f] for f in self.features] for n in nodes], dtype=float)
        proba = self.predict_proba_matrix(M)
        order = np.argsort(-proba, axis=1, kind="stable")[:, :k]
        assert self.classes_ is not None
        return {n: [(self.classes_[j], float(proba[i, j])) for j in order[i]] for i, n in enumerate(nodes)}

    # ---- persistence
    def save(self, path: str | Path) -> Path:
        if self._booster is None:
            raise NotFittedError("cannot save an unfitted fault classifier")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._booster.save_model(str(path / MODEL_FILE))
        sidecar = {"model": self.name, "feature_set_version": FEATURE_SET_VERSION, "features": list(self.features),
                   "classes": self.classes_, "params": self.params, "metadata": self.metadata}
        (path / SIDECAR_FILE).write_text(json.dumps(sidecar, indent=1, sort_keys=True))
        return path

    @classmethod
    def load(cls, path: str | Path) -> FaultClassifier:
        path = Path(path)
        try:
            sidecar = json.loads((path / SIDECAR_FILE).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelError(f"{path / SIDECAR_FILE}: cannot read the model sidecar: {exc}") from None
        version = sidecar.get("feature_set_version")
        if version != FEATURE_SET_VERSION:
            raise FeatureMismatch(
                f"{path}: model was trained on feature set v{version}, this faultlens computes feature set "
                f"v{FEATURE_SET_VERSION}; retrain it with `faultlens train`")
        features = tuple(sidecar["features"])
        unknown = [f for f in features if f not in FEATURES]
        if unknown:
            raise FeatureMismatch(f"{path}: model uses features this code does not compute: {', '.join(unknown)}")
        model = cls(**sidecar["params"], features=features)
        xgb = model._xgb()
        booster = xgb.Booster()
        try:
            booster.load_model(str(path / MODEL_FILE))
        except xgb.core.XGBoostError as exc:
            raise ModelError(f"{path / MODEL_FILE}: cannot load: {exc}") from None
        booster.set_param({"nthread": 1})
        model._booster = booster
        model.classes_ = list(sidecar["classes"])
        model.metadata = dict(sidecar.get("metadata", {}))
        return model


@dataclass(frozen=True)
class ClassifierParams:
    window_s: float = 60.0
    min_probability: float = 0.6


# Directly in shipped/ so that the package-data glob "shipped/*" puts it in wheels.
SHIPPED = Path(__file__).resolve().parent / "shipped"


def load_shipped() -> FaultClassifier:
    """The classifier that ships in the package (models/shipped/, see its MODEL_CARD.md)."""
    return FaultClassifier.load(SHIPPED)


class ClassifierDetector:
    """The classifier as a detector: windows records, scores each machine, emits findings."""

    name = "classifier"

    def __init__(self, model: FaultClassifier | None = None, *, window_s: float | None = None,
                 min_probability: float | None = None) -> None:
        params = ClassifierParams(**load_params("classifier", ClassifierParams))
        self.model = model if model is not None else load_shipped()
        self.window_s = window_s if window_s is not None else params.window_s
        self.min_probability = min_probability if min_probability is not None else params.min_probability
        self.features = WindowFeatures()
        self._window: int | None = None
        self._buf: list[Any] = []
        self._nodes: set[str] = set()
        self._jobs: dict[str, set[str]] = defaultdict(set)
        self._reported: set[tuple[str, str]] = set()

    def set_topology(self, topology: Topology) -> None:
        self.features.set_topology(topology)
        self._nodes.update(topology.nodes)
        self._jobs[topology.job].update(topology.nodes)

    def observe(self, record: Any) -> list[Finding]:
        ts = getattr(record, "ts", None)
        if ts is None:
            return []
        w = math.floor(ts / self.window_s)
        out: list[Finding] = []
        if self._window is not None and w > self._window:
            out = self._close()
        if self._window is None or w > self._window:
            self._window = w
        self._buf.append(record)
        node = getattr(record, "node", None)
        if node:
            self._nodes.add(node)
        return out

    def tick(self, now: float) -> list[Finding]:
        if self._window is not None and now >= (self._window + 2) * self.window_s:
            out = self._close()
            self._window = None
            return out
        return []

    def _close(self) -> list[Finding]:
        assert self._window is not None
        end_ts = (self._window + 1) * self.window_s
        rows = self.features.window(self._buf, self._nodes, end_ts=end_ts)
        self._buf = []
        guesses = self.model.top_guesses(rows, 3)
        scores = {n: top[0] for n, top in guesses.items()}
        out: list[Finding] = []
        job_votes: Counter[str] = Counter()
        for node, (kind, prob) in scores.items():
            if prob < self.min_probability:
                deferred = self._deferred(end_ts, node, guesses[node])
                if deferred is not None:
                    out.append(deferred)
                continue
            if kind == HEALTHY:
                continue
            if kind in JOB_WIDE_KINDS:
                job_votes[kind] += 1
                continue
            if (node, kind) in self._reported:
                continue
            self._reported.add((node, kind))
            out.append(self._finding(end_ts, kind, prob, node=node, rows=rows[node]))
        if job_votes:
            kind, votes = job_votes.most_common(1)[0]
            if votes * 2 >= len(scores) and ("*", kind) not in self._reported:
                self._reported.add(("*", kind))
                out.append(self._finding(end_ts, kind, max(p for k, p in scores.values() if k == kind),
                                         node=None, rows=None, votes=votes, machines=len(scores)))
        return out

    def _deferred(self, ts: float, node: str, top: list[tuple[str, float]]) -> Finding | None:
        """Unsure (the likeliest class under ``min_probability``): no fault of its own; a note that names
        the top guesses and leaves the decision to the rules. Only when a fault is among the two
        likeliest classes, once per machine and set of guesses."""
        faults = [k for k, _ in top[:2] if k != HEALTHY]
        key = (node, DEFERRED + ":" + ",".join(sorted(faults)))
        if not faults or key in self._reported:
            return None
        self._reported.add(key)
        named = ", ".join(f"{k} p={p:.2f}" for k, p in top)
        return Finding(ts=ts, kind=DEFERRED, category=Category.UNKNOWN, severity=Severity.INFO,
                       action=LineAction.NONE, confidence=round(top[0][1], 3), source="model:classifier",
                       rule=f"classifier.v{FEATURE_SET_VERSION}.deferred",
                       text=f"{node}: the classifier is unsure (top guesses {named}; below min_probability "
                            f"{self.min_probability:.2f}): it defers to the rules", node=node,
                       figures={"top": [[k, round(p, 4)] for k, p in top], "min_probability": self.min_probability,
                                "window_s": self.window_s})

    def _finding(self, ts: float, kind: str, prob: float, *, node: str | None, rows: dict[str, float] | None,
                 votes: int = 0, machines: int = 0) -> Finding:
        top = {}
        if rows is not None:
            top = {f: round(v, 4) for f, v in rows.items() if v and f in _SALIENT}
        where = node or f"{votes} of {machines} machines"
        return Finding(ts=ts, kind=kind, category=KIND_CATEGORY.get(kind, Category.UNKNOWN), severity=Severity.WARNING,
                       action=KIND_ACTION.get(kind, LineAction.NOTIFY), confidence=round(prob, 3),
                       source="model:classifier", rule=f"classifier.v{FEATURE_SET_VERSION}",
                       text=f"{where}: window features look like {kind} (p={prob:.2f})", node=node,
                       figures={"probability": round(prob, 4), "window_s": self.window_s, "features": top})


_SALIENT = frozenset(f for f in FEATURES if not f.startswith("job_") and f not in ("temp_max_c", "util_min"))
