"""Window features, the fault classifier's persistence rules and the classifier as a detector."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from faultlens.errors import CatalogError, FeatureMismatch
from faultlens.models.classifier import (
    SHIPPED,
    ClassifierDetector,
    FaultClassifier,
    load_label_rules,
    load_shipped,
    window_label,
)
from faultlens.models.features import FEATURE_SET_VERSION, FEATURES, WindowFeatures
from faultlens.models.training import Rows, scenario_rows, windows
from faultlens.schema import KernelEvent, NcclEvent
from tests import scengen


def _rows_at(sc: scengen.Scenario, t: float) -> dict[str, dict[str, float]]:
    """Feature rows of the window holding ``t`` (earlier windows fed first, as online)."""
    wf = WindowFeatures()
    wf.set_topology(sc.topology)
    start = sc.truth["start_ts"]
    for lo, chunk in windows(sc.records, start, start + sc.truth["duration_s"], 60.0):
        rows = wf.window(chunk, sc.topology.nodes, end_ts=lo + 60.0)
        if lo <= t < lo + 60.0:
            return rows
    raise AssertionError("t outside the scenario")


def test_thermal_culprit_stands_out_in_its_window_features() -> None:
    sc = scengen.scenario("thermal_throttle", nodes=4, seed=3, duration_s=900)
    culprit = sc.truth["faults"][0]["nodes"][0]
    rows = _rows_at(sc, sc.truth["faults"][0]["onset_ts"] + 120)
    assert list(rows[culprit]) == list(FEATURES)
    assert rows[culprit]["throttle_thermal_share"] == 1.0
    assert rows[culprit]["clock_min_ratio"] < 0.8
    assert rows[culprit]["step_ratio_max"] > 1.1
    others = [n for n in rows if n != culprit]
    assert all(rows[n]["throttle_thermal_share"] == 0.0 and rows[n]["step_ratio_max"] < 1.05 for n in others)


def test_event_counts_and_job_context() -> None:
    sc = scengen.scenario("ecc_uncorrectable", nodes=4, seed=4, duration_s=900)
    culprit = sc.truth["faults"][0]["nodes"][0]
    rows = _rows_at(sc, sc.truth["faults"][0]["onset_ts"] + 1)
    assert rows[culprit]["xid_ecc"] == 1.0 and rows[culprit]["ecc_dbe_delta"] == 1.0
    ue = scengen.scenario("user_exception", nodes=4, seed=5, duration_s=900)
    rows = _rows_at(ue, ue.truth["faults"][0]["onset_ts"] + 200)  # the job is dead; the tracebacks are recent
    assert all(r["job_exception_share"] == 1.0 and r["job_progress"] == 0.0 for r in rows.values())


def test_nan_losses_and_progress_are_shares_not_counts() -> None:
    """Scale-free step features: a 2-node and a 12-node job read the same when both lost their loss."""
    for nodes in (2, 12):
        sc = scengen.scenario("nan_loss", nodes=nodes, seed=6, duration_s=900)
        rows = _rows_at(sc, sc.truth["faults"][0]["onset_ts"] + 120)
        assert all(r["nan_loss_share"] == 1.0 and r["job_nan_share"] == 1.0 for r in rows.values())
        assert all(0.8 < r["job_progress"] < 1.25 for r in rows.values())  # still training at its usual pace
        before = _rows_at(sc, sc.truth["faults"][0]["onset_ts"] - 120)
        assert all(r["nan_loss_share"] == 0.0 for r in before.values())


def test_event_features_follow_kinds_then_patterns() -> None:
    wf = WindowFeatures()
    ev = KernelEvent(ts=1.0, node="n1", kind="xid", raw="NVRM: Xid (PCI:0000:3b:00): 79, pid=1", xid=79)
    assert wf.event_feature(ev) == "xid_gpu_lost"
    assert wf.event_feature(KernelEvent(ts=1.0, node="n1", kind="xid", raw="...", xid=13)) == "xid_other"
    assert wf.event_feature(KernelEvent(ts=1.0, node="n1", kind="oom_kill", raw="x")) == "oom_kill"
    line = "[rank3]:[E ProcessGroupNCCL.cpp:616] [Rank 3] Watchdog caught collective operation timeout: ..."
    assert wf.event_feature(NcclEvent(ts=1.0, node="n1", kind="other", raw=line)) == "nccl_timeout"
    assert wf.event_feature(NcclEvent(ts=1.0, node="n1", kind="nccl_info", raw="n1:1:1 [0] NCCL INFO ok")) is None
    flap = "mlx5_core 0000:3c:00.0 mlx5_1: Port: 1 Link DOWN"
    assert wf.event_feature(KernelEvent(ts=1.0, node="n1", kind="ib_link_down", raw=flap)) == "ib_link_down"
    veth = "IPv6: ADDRCONF(NETDEV_CHANGE): vethb605c9: link becomes ready"  # a container came up: no fabric event
    assert wf.event_feature(KernelEvent(ts=1.0, node="n1", kind="ib_link_up", raw=veth)) is None


def test_a_bad_event_catalog_entry_names_file_and_entry(tmp_path: Path) -> None:
    bad = tmp_path / "events.toml"
    bad.write_text('[[kernel]]\nfeature = "warp_drive"\nkinds = ["x"]\n')
    with pytest.raises(CatalogError, match=r"events\.toml.*warp_drive"):
        WindowFeatures(catalog=bad)


def test_window_labels_follow_truth() -> None:
    truth = {"faults": [{"kind": "thermal_throttle", "nodes": ["n2"], "onset_ts": 100.0, "end_ts": None},
                        {"kind": "seq_surge", "nodes": [], "onset_ts": 500.0, "end_ts": 600.0}]}
    assert window_label(truth, "n2", 0, 60) == "healthy"
    assert window_label(truth, "n2", 60, 120) == "thermal_throttle"
    assert window_label(truth, "n1", 60, 120) == "healthy"
    assert window_label(truth, "n1", 540, 600) == "seq_surge"
    assert window_label(truth, "n1", 450, 510) == "healthy"  # covers a sixth of the window
    assert window_label(truth, "n1", 480, 540) == "seq_surge"  # two thirds
    assert window_label(truth, "n1", 600, 660, linger_s=900) == "healthy"  # job-wide: no lingering


def test_labels_need_the_faults_evidence_in_the_window() -> None:
    """catalogs/labels.toml: a hung task is named from its kernel record on, not from the stall."""
    truth = {"faults": [{"kind": "hung_task", "nodes": ["n2"], "onset_ts": 100.0, "end_ts": None}]}
    quiet = dict.fromkeys(FEATURES, 0.0)
    seen = quiet | {"hung_task": 1.0}
    assert window_label(truth, "n2", 60, 120, row=quiet) is None  # stalled, no record yet: left out
    assert window_label(truth, "n2", 180, 240, row=seen) == "hung_task"
    assert window_label(truth, "n2", 0, 60, row=seen) is None  # evidence before truth's onset: left out
    assert window_label(truth, "n2", 0, 60, row=quiet) == "healthy"
    assert window_label(truth, "n1", 180, 240, row=quiet) == "healthy"
    assert window_label(truth, "n2", 60, 120) == "hung_task"  # without a row: truth's onset alone (strict)


def test_step_wide_faults_label_by_the_steps_that_started_inside() -> None:
    """A window's median over steps says seq_surge only when most of its steps started in the surge."""
    truth = {"faults": [{"kind": "seq_surge", "nodes": [], "onset_ts": 500.0, "end_ts": 800.0}]}
    assert window_label(truth, "n1", 480, 540, step_starts=[478, 486, 494, 502, 514]) == "healthy"
    assert window_label(truth, "n1", 480, 540, step_starts=[490, 503, 516, 529]) == "seq_surge"
    assert window_label(truth, "n1", 480, 540, step_starts=[490, 496, 503, 516]) == "healthy"  # a tie is no majority
    assert window_label(truth, "n1", 480, 540, step_starts=[]) == "seq_surge"  # no steps: time covered


def test_a_bad_label_catalog_entry_names_file_and_entry(tmp_path: Path) -> None:
    bad = tmp_path / "labels.toml"
    bad.write_text('[evidence]\nhung_task = ["warp_factor > 9"]\n')
    with pytest.raises(CatalogError, match=r"labels\.toml.*evidence\.hung_task.*warp_factor"):
        load_label_rules(bad)
    bad.write_text('[job_wide]\nnan_loss = "vibes"\n')
    with pytest.raises(CatalogError, match=r"job_wide\.nan_loss"):
        load_label_rules(bad)


@pytest.fixture(scope="module")
def small_model() -> FaultClassifier:
    rows = Rows()
    for i, kind in enumerate(("healthy", "thermal_throttle", "ecc_uncorrectable", "user_exception") * 2):
        sc = scengen.scenario(kind, nodes=4, seed=100 + i, duration_s=900)
        rows.extend(scenario_rows(sc.records, sc.topology, sc.truth))
    X, y = rows.arrays()
    return FaultClassifier(n_estimators=30).fit(X, y)


def test_classifier_detector_names_the_culprit(small_model: FaultClassifier) -> None:
    sc = scengen.scenario("thermal_throttle", nodes=4, seed=999, duration_s=900)
    culprit = sc.truth["faults"][0]["nodes"][0]
    det = ClassifierDetector(small_model)
    det.set_topology(sc.topology)
    out = []
    for rec in sc.records:
        out += det.observe(rec)
    out += det.tick(sc.records[-1].ts + 3600)
    assert [(f.kind, f.node) for f in out] == [("thermal_throttle", culprit)]
    assert out[0].source == "model:classifier" and out[0].action == "evict_node"
    assert out[0].category == "thermal_power"


def test_a_model_from_another_feature_set_refuses_to_load(small_model: FaultClassifier, tmp_path: Path) -> None:
    path = small_model.save(tmp_path / "m")
    side = json.loads((path / "model.json").read_text())
    side["feature_set_version"] = FEATURE_SET_VERSION + 1
    (path / "model.json").write_text(json.dumps(side))
    with pytest.raises(FeatureMismatch, match=rf"v{FEATURE_SET_VERSION + 1}.*v{FEATURE_SET_VERSION}"):
        FaultClassifier.load(path)


def test_score_rows_names_missing_features(small_model: FaultClassifier) -> None:
    row = dict.fromkeys(FEATURES, 0.0)
    del row["xid_ecc"]
    with pytest.raises(FeatureMismatch, match="xid_ecc"):
        small_model.score_rows({"n1": row})


def test_the_shipped_model_loads_and_scores() -> None:
    assert (SHIPPED / "MODEL_CARD.md").is_file()
    model = load_shipped()
    assert model.classes_ and "healthy" in model.classes_
    rows = {f"n{i:03d}": dict.fromkeys(FEATURES, 0.0) | {"step_ratio_max": 1.0, "job_progress": 1.0}
            for i in range(128)}
    scores = model.score_rows(rows)
    assert len(scores) == 128 and all(0.0 <= p <= 1.0 for _, p in scores.values())
    assert np.isfinite([p for _, p in scores.values()]).all()


def test_a_storage_stall_is_open_until_the_server_answers_again() -> None:
    """v4: the recovery line is not a storage error; storage_open says the last word was an error."""
    def line(ts: float, text: str) -> KernelEvent:
        return KernelEvent(ts=ts, node="n1", kind="nfs_timeout", raw=text, message=text)

    wf = WindowFeatures()
    down = "nfs: server storage01 not responding, still trying"
    rows = wf.window([line(10.0, down)], ["n1", "n2"], end_ts=60.0)
    assert (rows["n1"]["storage_error"], rows["n1"]["storage_open"], rows["n1"]["storage_recovered"]) == (1.0, 1.0, 0.0)
    assert rows["n2"]["storage_open"] == 0.0
    rows = wf.window([line(70.0, "nfs: server storage01 OK")], ["n1", "n2"], end_ts=120.0)
    assert (rows["n1"]["storage_error"], rows["n1"]["storage_open"], rows["n1"]["storage_recovered"]) == (1.0, 0.0, 1.0)


def test_null_gpu_fields_give_features_not_a_crash() -> None:
    """A GPU sample whose gauges and counters are null ("N/A") counts as seen; its gauges are
    not averaged in and its counters make no delta."""
    from faultlens import schema

    sc = scengen.scenario("thermal_throttle", nodes=4, seed=3, duration_s=300)
    nulls = {"util": None, "power_w": None, "temp_c": None, "throttle_reasons": None, "ecc_dbe": None,
             "nvlink_errors": None}
    records = [schema.replace(r, gpus=[schema.replace(g, **nulls) for g in r.gpus])
               if isinstance(r, schema.GpuSample) else r for r in sc.records]
    wf = WindowFeatures()
    wf.set_topology(sc.topology)
    start = sc.truth["start_ts"]
    for lo, chunk in windows(records, start, start + 300, 60.0):
        rows = wf.window(chunk, sc.topology.nodes, end_ts=lo + 60.0)
        assert all(r["ecc_dbe_delta"] == 0.0 and r["gpu_missing"] == 0.0 for r in rows.values())
