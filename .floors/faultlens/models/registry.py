"""Every learned model of faultlens, with what the shared contract test needs.

tests/test_models_contract.py runs one contract over each entry of ``MODELS``
(fit on a seeded stream, save/load round trip, same seed same output,
predict-before-fit and missing-feature errors, a floor on quality). A new model
is one entry here and no new test code: its factory, its loader and an
``example`` that draws a seeded sample ``(X, y)`` from the kind of data it is
meant for.

A model in this contract has ``features`` (column names), ``fit(X, y)``,
``predict(X)``, ``save(dir)`` and a ``load(dir)`` classmethod; ``X`` is a
mapping of column name -> values or a polars/pandas frame.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from faultlens.models.classifier import HEALTHY, FaultClassifier
from faultlens.models.features import FEATURES
from faultlens.models.predictor import StepTimePredictor
from faultlens.vocabulary import FaultKind

Example = tuple[dict[str, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    factory: Callable[[int], Any]  # seed -> an unfitted model
    load: Callable[[Path], Any]
    example: Callable[[int, int], Example]  # (seed, rows) -> (X, y)
    score: Callable[[np.ndarray, np.ndarray], float]  # (truth, predicted) -> higher is better
    min_score: float  # what the model must reach on a fresh example after fitting on another


def _step_time_example(seed: int, n: int) -> Example:
    """Packed workloads with a long-tailed share of long sequences; time = cost model + 1.5% noise."""
    rng = np.random.default_rng(seed)
    tokens = np.full(n, 65_536.0)
    mean_len = np.where(rng.random(n) < 0.2, 4000.0, 700.0)
    n_seqs = np.maximum(1, np.round(tokens / mean_len * rng.lognormal(0, 0.2, n)))
    sum_len_sq = tokens * tokens / n_seqs * rng.lognormal(0.3, 0.3, n)
    t = (0.35 + 2.0e-5 * tokens + 2.2e-9 * sum_len_sq + 5e-4 * n_seqs) * rng.lognormal(0, 0.015, n)
    return {"tokens": tokens, "sum_len_sq": sum_len_sq, "n_seqs": n_seqs}, t


def _neg_mape(y: np.ndarray, p: np.ndarray) -> float:
    return -float(np.mean(np.abs(p - y) / y))


# Signatures of a few fault kinds in feature space (mean shifts over healthy noise).
_SIGNATURES: dict[str, dict[str, float]] = {
    HEALTHY: {},
    FaultKind.ECC_UNCORRECTABLE: {"ecc_dbe_delta": 2.0, "xid_ecc": 1.0, "retired_pages_delta": 1.0},
    FaultKind.THERMAL_THROTTLE: {"throttle_thermal_share": 0.8, "temp_max_c": 18.0, "clock_min_ratio": -0.3,
                                 "step_ratio_max": 0.2},
    FaultKind.IB_LINK_PERSISTENT: {"ib_link_down": 3.0, "nccl_ib_error": 4.0},
    FaultKind.USER_EXCEPTION: {"py_exception": 2.0, "job_exception_share": 1.0, "job_progress": -0.9},
}


def _classifier_example(seed: int, n: int) -> Example:
    rng = np.random.default_rng(seed)
    kinds = sorted(_SIGNATURES)
    y = np.array([kinds[i] for i in rng.integers(0, len(kinds), n)])
    X = {f: np.abs(rng.normal(0.0, 0.05, n)) for f in FEATURES}
    for f in ("clock_min_ratio", "power_min_ratio", "step_ratio_max", "step_ratio_node_median", "job_step_ratio",
              "job_len_ratio", "job_progress"):
        X[f] = 1.0 + rng.normal(0.0, 0.02, n)
    X["temp_max_c"] = 65.0 + rng.normal(0.0, 2.0, n)
    for kind, shift in _SIGNATURES.items():
        sel = y == kind
        for f, d in shift.items():
            X[f][sel] += d * rng.uniform(0.6, 1.4, sel.sum())
    return X, y


def _accuracy(y: np.ndarray, p: np.ndarray) -> float:
    return float(np.mean(np.asarray(y) == np.asarray(p)))


MODELS: dict[str, ModelSpec] = {
    "step_time": ModelSpec(
        name="step_time", factory=lambda seed: StepTimePredictor(), load=StepTimePredictor.load,
        example=_step_time_example, score=_neg_mape, min_score=-0.03),
    "fault_classifier": ModelSpec(
        name="fault_classifier", factory=lambda seed: FaultClassifier(n_estimators=40, seed=seed),
        load=FaultClassifier.load, example=_classifier_example, score=_accuracy, min_score=0.95),
}
