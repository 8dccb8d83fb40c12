"""One contract for every learned model in models/registry.py (a new model needs no new test code)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from faultlens.errors import FeatureMismatch, NotFittedError
from faultlens.models.registry import MODELS, ModelSpec

SPECS = [pytest.param(spec, id=name) for name, spec in sorted(MODELS.items())]


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind in "fc":
        return bool(np.allclose(a, b, rtol=1e-9, atol=0))
    return bool(np.array_equal(a, b))


@pytest.mark.parametrize("spec", SPECS)
def test_fits_a_seeded_stream_and_generalises(spec: ModelSpec) -> None:
    X, y = spec.example(1, 600)
    model = spec.factory(0).fit(X, y)
    Xt, yt = spec.example(2, 300)
    pred = model.predict(Xt)
    assert len(pred) == len(yt)
    assert spec.score(yt, pred) >= spec.min_score


@pytest.mark.parametrize("spec", SPECS)
def test_save_load_round_trip_predicts_the_same(spec: ModelSpec, tmp_path: Path) -> None:
    X, y = spec.example(1, 400)
    model = spec.factory(0).fit(X, y)
    Xt, _ = spec.example(3, 200)
    model.save(tmp_path / spec.name)
    back = spec.load(tmp_path / spec.name)
    assert tuple(back.features) == tuple(model.features)
    assert _same(model.predict(Xt), back.predict(Xt))


@pytest.mark.parametrize("spec", SPECS)
def test_same_seed_same_output(spec: ModelSpec) -> None:
    X, y = spec.example(4, 400)
    X2, y2 = spec.example(4, 400)
    assert _same(y, y2)
    Xt, _ = spec.example(5, 100)
    a = spec.factory(7).fit(X, y).predict(Xt)
    b = spec.factory(7).fit(X2, y2).predict(Xt)
    assert _same(a, b)


@pytest.mark.parametrize("spec", SPECS)
def test_predict_before_fit_raises(spec: ModelSpec, tmp_path: Path) -> None:
    X, _ = spec.example(1, 20)
    with pytest.raises(NotFittedError):
        spec.factory(0).predict(X)
    with pytest.raises(NotFittedError):
        spec.factory(0).save(tmp_path / "unfitted")


@pytest.mark.parametrize("spec", SPECS)
def test_missing_features_are_named(spec: ModelSpec) -> None:
    X, y = spec.example(1, 300)
    model = spec.factory(0)
    dropped = model.features[-1]
    partial = {k: v for k, v in X.items() if k != dropped}
    with pytest.raises(FeatureMismatch, match=dropped):
        model.fit(partial, y)
    model.fit(X, y)
    with pytest.raises(FeatureMismatch, match=dropped):
        model.predict(partial)
