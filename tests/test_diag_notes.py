"""An unsure classifier defers to the rules and says so (diagnosis/notes.py).

When the fault classifier's likeliest class is under ``min_probability`` (0.6 in
models/catalogs/detectors.toml) it names no fault: it emits a ``classifier_deferred``
finding naming its top guesses, which policy.toml files with role "note". The note goes
onto the machine's incident as evidence; the rules' decision stands.
"""

from __future__ import annotations

import numpy as np
import pytest

from faultlens.config import Config
from faultlens.diagnosis.engine import DiagnosisEngine, run_records
from faultlens.models.classifier import DEFERRED, ClassifierDetector, FaultClassifier
from faultlens.models.training import Rows, scenario_rows
from faultlens.vocabulary import Category, LineAction, Severity
from faultlens.vocabulary import FaultKind as K
from tests import scengen


@pytest.fixture(scope="module")
def torn_model() -> FaultClassifier:
    """Trained where every ECC machine-window appears twice, once as ecc_uncorrectable and once as
    thermal_throttle: on such a window the best it can say is one half each."""
    rows = Rows()
    for i, kind in enumerate((K.HEALTHY, K.ECC_UNCORRECTABLE) * 3):
        sc = scengen.scenario(kind, nodes=4, seed=200 + i, duration_s=900)
        rows.extend(scenario_rows(sc.records, sc.topology, sc.truth))
    X, y = rows.arrays()
    twice = [i for i, v in enumerate(y) if v == K.ECC_UNCORRECTABLE]
    X = {f: np.concatenate([np.asarray(col), np.asarray(col)[twice]]) for f, col in X.items()}
    y = list(y) + [K.THERMAL_THROTTLE.value] * len(twice)
    return FaultClassifier(n_estimators=30).fit(X, y)


def test_min_probability_comes_from_the_detectors_catalog(torn_model):
    assert ClassifierDetector(torn_model).min_probability == 0.6


def test_an_unsure_classifier_names_no_fault_but_its_top_guesses(torn_model):
    sc = scengen.scenario("ecc_uncorrectable", nodes=4, seed=999, duration_s=900)
    culprit = sc.truth["faults"][0]["nodes"][0]
    det = ClassifierDetector(torn_model)
    det.set_topology(sc.topology)
    out = [f for rec in sc.records for f in det.observe(rec)] + det.tick(sc.records[-1].ts + 3600)
    assert not [f for f in out if f.kind in (K.ECC_UNCORRECTABLE, K.THERMAL_THROTTLE)]
    deferred = [f for f in out if f.kind == DEFERRED]
    assert [f.node for f in deferred] == [culprit]
    d = deferred[0]
    assert (d.category, d.severity, d.action) == (Category.UNKNOWN, Severity.INFO, LineAction.NONE)
    assert {k for k, _ in d.figures["top"][:2]} == {K.ECC_UNCORRECTABLE, K.THERMAL_THROTTLE}
    assert d.figures["top"][0][1] < 0.6 and "defers to the rules" in d.text


def test_the_note_goes_onto_the_rules_incident_and_the_rules_decide(torn_model):
    sc = scengen.scenario("ecc_uncorrectable", nodes=4, seed=999, duration_s=900)
    culprit = sc.truth["faults"][0]["nodes"][0]
    engine = DiagnosisEngine(Config(), batch=True, detectors=[ClassifierDetector(torn_model)])
    engine.set_topology(sc.topology.to_job_dict())
    outputs = run_records(engine, sc.records)
    ecc = [i for i in engine.incidents() if i.kind == "ecc_uncorrectable"]
    assert len(ecc) == 1
    notes = [e for e in ecc[0].evidence if e.get("role") == "note"]
    assert len(notes) == 1 and "classifier is unsure" in notes[0]["text"] and notes[0]["node"] == culprit
    actions = [o for o in outputs if type(o).KIND == "actions"]
    assert [(a.type, a.nodes) for a in actions] == [("evict_nodes", [culprit])]
    assert not [i for i in engine.incidents() if i.kind in (DEFERRED, K.THERMAL_THROTTLE)]
