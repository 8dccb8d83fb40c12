"""Workload-aware step-time prediction (ResiHP's micro-batch time predictor).

With sequence packing the token count of a step is fixed but attention cost
grows with the sum of *squared* sequence lengths, so healthy step time swings
from batch to batch. A detector that looks at raw step time mistakes a batch of
long sequences for a slow machine. We predict each rank's compute time from its
workload, ``t ~ a + b*tokens + c*sum_len_sq + d*n_seqs``, and hand the residual
ratio observed/predicted to the detectors: a healthy rank sits near 1.0 whatever
its batch looked like.

Two layers:

* ``StepTimePredictor``: one robust linear model (Huber loss by iteratively
  reweighted least squares), batch ``fit``/``predict`` plus an online window
  (``add`` + ``refit``). It satisfies the model contract (models/registry.py).
* ``JobStepPredictor``: the online, per-job use. One ``StepTimePredictor`` per
  pipeline stage (stages run different layers, so different cost), fitted on the
  recent healthy steps of that stage, refit every ``refit_every`` steps, never
  fed by ranks a detector has flagged. ``observe_step`` returns the residual
  ratio of each rank and, rolled up, of each node.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Any

import numpy as np

from faultlens.errors import FeatureMismatch, ModelError, NotFittedError
from faultlens.schema import StepTiming
from faultlens.stream.topology import Topology

PREDICTOR_VERSION = 1
# Workload columns, in design-matrix order (an intercept is added).
WORKLOAD_FEATURES = ("tokens", "sum_len_sq", "n_seqs")


_rank = attrgetter("rank")


def compute_time(rec: StepTiming) -> float:
    """The rank's own compute time: fwd+bwd when reported, else duration minus wait."""
    if rec.fwd_s is not None and rec.bwd_s is not None:
        return rec.fwd_s + rec.bwd_s
    if rec.comm_s is not None:
        return max(rec.duration_s - rec.comm_s, 1e-6)
    return rec.duration_s


def workload_row(rec: StepTiming) -> tuple[float, float, float]:
    tokens = rec.tokens or rec.sum_len
    return float(tokens), float(rec.sum_len_sq), float(rec.n_seqs)


def _columns(X: Any, names: Sequence[str]) -> np.ndarray:
    """Pull named columns from a mapping/frame into an (n, k) float matrix."""
    missing = [n for n in names if n not in _keys(X)]
    if missing:
        raise FeatureMismatch(f"missing features: {', '.join(missing)}")
    return np.column_stack([np.asarray(X[n], dtype=float) for n in names])


def _keys(X: Any) -> set[str]:
    if hasattr(X, "columns"):
        return set(X.columns)
    if isinstance(X, Mapping):
        return set(X.keys())
    raise ModelError(f"expected a mapping of feature columns or a data frame, got {type(X).__name__}")


def huber_fit(A: np.ndarray, y: np.ndarray, *, k: float = 1.345, iterations: int = 8,
              ridge: float = 1e-6) -> np.ndarray:
    """Huber regression by iteratively reweighted least squares.

    Columns are scaled to unit RMS first so that tokens (1e4) and squared
    lengths (1e8) do not ruin the conditioning; the tiny ridge keeps collinear
    columns (a constant sequence count, say) from blowing up.
    """
    scale = np.sqrt(np.mean(A * A, axis=0))
    scale[scale == 0] = 1.0
    As = A / scale
    w = np.ones(len(y))
    beta = np.zeros(A.shape[1])
    eye = np.eye(A.shape[1]) * ridge * len(y)
    for _ in range(iterations):
        Aw = As * w[:, None]
        beta = np.linalg.solve(As.T @ Aw + eye, Aw.T @ y)
        r = y - As @ beta
        s = 1.4826 * np.median(np.abs(r - np.median(r)))
        if s <= 1e-12 * max(1.0, float(np.abs(y).mean())):
            break
        u = np.abs(r) / (k * s)
        w = np.where(u <= 1.0, 1.0, 1.0 / np.maximum(u, 1e-12))
    return beta / scale


class StepTimePredictor:
    """One robust linear step-time model over the workload columns.

    ``fit(X, y)`` takes a mapping (or polars frame) with the columns of
    ``WORKLOAD_FEATURES`` and the observed compute times; ``predict`` gives the
    healthy time of each row. Online use: ``add`` rows to the window and
    ``refit``; the window keeps the most recent ``window`` rows.
    """

    name = "step_time"
    features = WORKLOAD_FEATURES

    def __init__(self, *, window: int = 4096, huber_k: float = 1.345, min_samples: int = 16) -> None:
        self.window = window
        self.huber_k = huber_k
        self.min_samples = min_samples
        self.coef_: np.ndarray | None = None
        self.n_fit_ = 0
        self._buf = np.zeros((window, 4))  # ring buffer: tokens, sum_len_sq, n_seqs, time
        self._n = 0  # rows ever added

    # ---- batch
    def fit(self, X: Any, y: Sequence[float]) -> StepTimePredictor:
        W = _columns(X, self.features)
        self._fit_matrix(W, np.asarray(y, dtype=float))
        return self

    def _fit_matrix(self, W: np.ndarray, y: np.ndarray) -> None:
        if len(y) < self.min_samples:
            raise ModelError(f"step-time model needs at least {self.min_samples} samples, got {len(y)}")
        A = np.column_stack([np.ones(len(y)), W])
        self.coef_ = huber_fit(A, y, k=self.huber_k)
        self.n_fit_ = len(y)

    def predict(self, X: Any) -> np.ndarray:
        if self.coef_ is None:
            raise NotFittedError("step-time predictor used before fit")
        return self.predict_matrix(_columns(X, self.features))

    def predict_matrix(self, W: np.ndarray) -> np.ndarray:
        if self.coef_ is None:
            raise NotFittedError("step-time predictor used before fit")
        pred = self.coef_[0] + W @ self.coef_[1:]
        return np.maximum(pred, 1e-6)

    # ---- online window
    def add(self, W: np.ndarray, y: np.ndarray) -> None:
        rows = np.column_stack([np.atleast_2d(W), np.atleast_1d(y)])[-self.window:]
        idx = (self._n + np.arange(len(rows))) % self.window
        self._buf[idx] = rows
        self._n += len(rows)

    @property
    def fitted(self) -> bool:
        return self.coef_ is not None

    def refit(self) -> bool:
        """Refit on the window; False (and the old model kept) while it is too small."""
        n = min(self._n, self.window)
        if n < self.min_samples:
            return False
        data = self._buf[:n]
        self._fit_matrix(data[:, :3], data[:, 3])
        return True

    # ---- persistence
    def to_dict(self) -> dict[str, Any]:
        if self.coef_ is None:
            raise NotFittedError("cannot save an unfitted step-time predictor")
        return {"model": self.name, "version": PREDICTOR_VERSION, "features": list(self.features),
                "coef": self.coef_.tolist(), "n_fit": self.n_fit_,
                "params": {"window": self.window, "huber_k": self.huber_k, "min_samples": self.min_samples}}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "step_time.json").write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> StepTimePredictor:
        file = Path(path) / "step_time.json"
        data = json.loads(file.read_text())
        if data.get("version") != PREDICTOR_VERSION or tuple(data.get("features", ())) != WORKLOAD_FEATURES:
            raise FeatureMismatch(
                f"{file}: step-time model version {data.get('version')} with features {data.get('features')}; "
                f"this code reads version {PREDICTOR_VERSION} with {list(WORKLOAD_FEATURES)}")
        model = cls(**data["params"])
        model.coef_ = np.asarray(data["coef"], dtype=float)
        model.n_fit_ = int(data["n_fit"])
        return model


@dataclass
class StepResiduals:
    """Residual ratios of one step: observed/predicted compute time."""

    job: str
    step: int
    ts: float
    ranks: np.ndarray  # rank ids, sorted
    nodes: list[str]  # node of each rank
    ratio: np.ndarray  # per rank; nan where no model yet
    compute_s: np.ndarray
    comm_s: np.ndarray  # nan where not reported
    duration_s: np.ndarray
    predicted_s: np.ndarray
    per_node: dict[str, float] = field(default_factory=dict)  # worst (max) rank ratio per node

    @property
    def ready(self) -> bool:
        return bool(np.isfinite(self.ratio).any())


class JobStepPredictor:
    """Online per-job predictor: one robust model per pipeline stage.

    ``observe_step(records)`` scores a complete step (all ranks' StepTimings),
    then feeds the healthy ranks' samples to the window; every
    ``refit_every`` steps the stage models are refit. Ranks in ``excluded``
    (flagged by a detector) never train the model.
    """

    def __init__(self, *, topology: Topology | None = None, window_steps: int = 200, refit_every: int = 25,
                 warmup_steps: int = 20, samples_per_step: int = 32, seed: int = 0) -> None:
        self.topology = topology
        self.window_steps = window_steps
        self.refit_every = refit_every
        self.warmup_steps = warmup_steps
        self.samples_per_step = samples_per_step
        self.excluded: set[int] = set()
        self.frozen = False  # a job-wide slowdown is under way: do not learn it
        self._models: dict[int, StepTimePredictor] = {}
        self._steps_seen = 0
        self._rng = np.random.default_rng(seed)

    def _stage(self, rec: StepTiming) -> int:
        if rec.pp is not None:
            return rec.pp
        if self.topology is not None and rec.rank < self.topology.world_size:
            return self.topology.coords(rec.rank)["pp"]
        return 0

    def _model(self, stage: int) -> StepTimePredictor:
        m = self._models.get(stage)
        if m is None:
            m = self._models[stage] = StepTimePredictor(window=self.window_steps * self.samples_per_step)
        return m

    def observe_step(self, records: Iterable[StepTiming]) -> StepResiduals:
        recs = sorted(records, key=_rank)
        n = len(recs)
        # One pass over the records into plain lists, then one array each (a 1,024-rank
        # step is scored in every window of every job: six generator passes cost twice this).
        rank_l, work_l, comp_l, comm_l, dur_l, stage_l = [], [], [], [], [], []
        nan = math.nan
        for r in recs:
            rank_l.append(r.rank)
            work_l.append(workload_row(r))
            comp_l.append(compute_time(r))
            comm_l.append(nan if r.comm_s is None else r.comm_s)
            dur_l.append(r.duration_s)
            stage_l.append(r.pp if r.pp is not None else self._stage(r))
        ranks = np.array(rank_l, dtype=np.int64)
        W = np.array(work_l, dtype=float).reshape(n, 3)
        comp = np.array(comp_l, dtype=float)
        comm = np.array(comm_l, dtype=float)
        dur = np.array(dur_l, dtype=float)
        stages = np.array(stage_l, dtype=np.int64)
        pred = np.full(n, np.nan)
        for stage in np.unique(stages):
            m = self._model(int(stage))
            if m.fitted:
                idx = stages == stage
                pred[idx] = m.predict_matrix(W[idx])
        ratio = comp / pred
        nodes = [r.node for r in recs]
        res = StepResiduals(job=recs[0].job if recs else "", step=recs[0].step if recs else -1,
                            ts=max((r.ts for r in recs), default=0.0), ranks=ranks, nodes=nodes, ratio=ratio,
                            compute_s=comp, comm_s=comm, duration_s=dur, predicted_s=pred)
        if np.isfinite(ratio).any():
            per_node: dict[str, float] = {}
            for node, r in zip(nodes, ratio.tolist(), strict=True):
                if math.isfinite(r) and r > per_node.get(node, -math.inf):
                    per_node[node] = r
            res.per_node = per_node
        self._learn(recs, W, comp, stages)
        return res

    def _learn(self, recs: list[StepTiming], W: np.ndarray, comp: np.ndarray, stages: np.ndarray) -> None:
        self._steps_seen += 1
        if self.frozen:
            return
        healthy = np.fromiter((r.rank not in self.excluded for r in recs), dtype=bool, count=len(recs))
        for stage in np.unique(stages):
            idx = np.flatnonzero((stages == stage) & healthy)
            if len(idx) > self.samples_per_step:  # keep the window's span in steps, not in ranks
                idx = np.sort(self._rng.choice(idx, self.samples_per_step, replace=False))
            self._model(int(stage)).add(W[idx], comp[idx])
        due = self._steps_seen == self.warmup_steps or (
            self._steps_seen > self.warmup_steps and self._steps_seen % self.refit_every == 0)
        if due:
            for m in self._models.values():
                m.refit()

    @property
    def fitted(self) -> bool:
        return bool(self._models) and all(m.fitted for m in self._models.values())
