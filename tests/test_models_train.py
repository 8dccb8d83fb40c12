"""`faultlens train` from a simulator suite and from labelled incidents in a Parquet lake."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from faultlens import schema
from faultlens.cli import main
from faultlens.commands.train import lake_rows
from faultlens.models.classifier import FaultClassifier
from tests import scengen


def test_train_on_a_simulator_suite_writes_model_and_card(tmp_path: Path) -> None:
    suite_mod = pytest.importorskip("faultlens.datasets.suite")
    suite = suite_mod.write_suite(tmp_path / "suite", 3, 5, min_nodes=2, max_nodes=2)
    out = tmp_path / "model"
    assert main(["train", "--suite", str(suite), "--out", str(out), "--n-estimators", "10"]) == 0
    model = FaultClassifier.load(out)
    kinds = {json.loads(p.read_text())["faults"][0]["kind"] if json.loads(p.read_text())["faults"] else "healthy"
             for p in suite.glob("*/truth.json")}
    assert set(model.classes_ or []) == kinds | {"healthy"}
    card = (out / "MODEL_CARD.md").read_text()
    assert "Feature set: v" in card and "## Training data" in card


def _write(lake: Path, kind: str, records: list) -> None:
    rows = [row for r in records for row in schema.lake_row(r)]
    table = pa.Table.from_pylist(rows, schema=schema.lake_schema(kind))
    (lake / kind / "date=2023-11-14").mkdir(parents=True, exist_ok=True)
    pq.write_table(table, lake / kind / "date=2023-11-14" / "part-0.parquet")


def test_rows_from_labelled_incidents_in_the_lake(tmp_path: Path) -> None:
    sc = scengen.scenario("thermal_throttle", nodes=4, seed=8, duration_s=900)
    culprit = sc.truth["faults"][0]["nodes"][0]
    onset = sc.truth["faults"][0]["onset_ts"]
    lake = tmp_path / "lake"
    by_kind: dict[str, list] = {}
    for r in sc.records:
        by_kind.setdefault(type(r).KIND, []).append(r)
    for kind, recs in by_kind.items():
        _write(lake, kind, recs)
    topo = sc.topology
    _write(lake, "jobs", [schema.JobTopology(ts=0.0, job=topo.job, tp=topo.tp, pp=topo.pp, dp=topo.dp,
                                             ranks=topo.to_job_dict()["ranks"])])
    inc = dict(id="i1", job=topo.job, opened_ts=onset + 60, updated_ts=onset + 60, status="open",
               category="unknown", kind="fail_slow", title="slow", suspects=[{"node": culprit, "score": 1.0}])
    _write(lake, "incidents", [schema.Incident(**inc), schema.Incident(**{**inc, "updated_ts": onset + 99,
                                                                          "root_cause": "thermal_throttle"})])
    rows = lake_rows(lake, window_s=60.0)
    assert set(rows.y) == {"healthy", "thermal_throttle"}
    labelled = {g for g, lab in zip(rows.groups, rows.y, strict=True) if lab == "thermal_throttle"}
    assert labelled == {"i1:?"}
    X, y = rows.arrays()
    hot = X["throttle_thermal_share"][y == "thermal_throttle"]
    assert (hot[1:] == 1.0).all()  # from the first full window after opening on, the culprit is throttled
