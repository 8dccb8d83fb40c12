"""The explorer's queries and chart builders, as plain functions on the scenario lake."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from faultlens.ui import charts, labels, views
from tests.ui_scenario import (
    CULPRIT,
    CULPRIT_GPU,
    FAULT_TS,
    INCIDENT_ID,
    JOB,
    RESUME_TS,
    XID_LINE,
    build_lake,
)


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_lake(tmp_path_factory.mktemp("views") / "lake").path


@pytest.fixture(scope="module")
def con(lake: Path):
    c = views.connect(lake)
    yield c
    c.close()


@pytest.fixture(scope="module")
def inc(con) -> dict:
    found = views.incident(con, INCIDENT_ID)
    assert found is not None
    return found


def test_incident_is_latest_version_with_decoded_fields(inc: dict) -> None:
    assert inc["updated_ts"] == FAULT_TS + 610 and len(inc["evidence"]) == 4
    assert views.headline(inc)["culprit"] == f"{CULPRIT} GPU {CULPRIT_GPU}"


def test_overview_counts(con, lake: Path) -> None:
    assert views.open_incidents_by_severity(con) == {"critical": 1, "warning": 0, "info": 0}
    assert views.actions_summary(con)["dry_run"] == 1
    health = {r["node"]: r["health"] for r in views.fleet_health(con, lake_path=lake).iter_rows(named=True)}
    assert health[CULPRIT] == "critical" and health["n001"] == "ok"
    assert health["n002"] == "critical"  # its double-bit ECC errors are within the last hour


def test_ettr_and_downtime_ledger_add_up(con) -> None:
    e = views.ettr(con, job=JOB).row(0, named=True)
    ledger, gaps = views.downtime_ledger(con, JOB)
    assert gaps.height == 1 and gaps["incident"][0] == INCIDENT_ID and gaps["cause"][0] == "gpu_lost"
    # the gap runs from the last step minute before the fault to the first after the restart
    assert FAULT_TS - 60 <= gaps["start_ts"][0] <= FAULT_TS + 60 and abs(gaps["end_ts"][0] - RESUME_TS) <= 60
    assert ledger["lost_s"].sum() + e["productive_s"] == pytest.approx(e["wall_s"])
    assert 0.7 < e["ettr"] < 0.85
    rel = views.reliability(con, JOB)
    assert rel["failures"] == 1 and rel["mttr_s"] == gaps["lost_s"][0]


def test_evidence_timeline_has_cited_lines_and_context(con, inc: dict) -> None:
    t = views.evidence_timeline(con, inc)
    assert t["ts"].is_sorted()
    cited = t.filter(pl.col("evidence"))
    assert XID_LINE in cited["text"].to_list() and cited.height == 4
    # context: the culprit node's own watchdog line, not cited by diagnosis
    assert t.filter(~pl.col("evidence") & (pl.col("node") == CULPRIT) & (pl.col("source") == "nccl")).height == 1


def test_topology_grid_marks_culprit_rank_and_evicted_node(con, inc: dict) -> None:
    grid = views.topology_grid(con, inc)
    assert grid.height == 32 and grid["column"].n_unique() == 16 and grid["pp"].n_unique() == 2
    states = dict(zip(grid["rank"].to_list(), grid["state"].to_list(), strict=True))
    assert states[21] == "suspect"  # n003 GPU 5 before the restart
    assert {r for r, s in states.items() if s == "evicted"} == set(range(16, 24)) - {21}
    assert grid.filter(pl.col("state") == "healthy")["node"].unique().sort().to_list() == ["n001", "n002", "n004"]


def test_stack_groups_put_the_outlier_first(con, inc: dict) -> None:
    groups = views.stack_groups(con, inc)
    assert groups["count"].to_list() == [1, 31] and groups["outlier"].to_list() == [True, False]
    assert groups["ranks"][0] == "21" and groups["group"][0].startswith("synchronize (torch/cuda/__init__.py")


def test_stack_groups_use_diagnosis_fingerprint_and_recorded_outliers(con, inc: dict) -> None:
    """Groups are diagnosis's own fingerprints; the outlier flag follows the incident's stack verdict."""
    from faultlens.diagnosis.stacks import fingerprint

    dumps = con.sql("SELECT rank, text FROM stacks WHERE job = ? ORDER BY rank", params=[JOB]).fetchall()
    by_fp: dict[str, list[int]] = {}
    for rank, text in dumps:
        by_fp.setdefault(fingerprint(text), []).append(rank)
    assert sorted(len(r) for r in by_fp.values()) == views.stack_groups(con, inc)["count"].sort().to_list()
    # an incident whose recorded verdict names rank 3 (a rank of the big group): that group is the outlier
    recorded = dict(inc, evidence=[*inc["evidence"], {"ts": inc["opened_ts"], "source": "stacks",
                                                      "rule": "stacks:aggregate", "text": "",
                                                      "figures": {"groups": [], "outliers": [3]}}])
    groups = views.stack_groups(con, recorded)
    assert groups["outlier"].to_list() == [True, False] and groups["count"][0] == 31


def test_step_prediction_explains_workload(con, inc: dict) -> None:
    per_step, per_rank = views.step_prediction(con, JOB, onset_ts=inc["opened_ts"])
    assert per_step.height > 100
    # the workload explains the step time: residuals are small next to the spread of step times
    assert per_step["residual_s"].abs().median() < 0.1 * per_step["observed_s"].std() + 0.05
    assert per_rank.height == 10


def test_step_prediction_is_the_predictors_own_model(con, inc: dict) -> None:
    """The chart's prediction is models.predictor's StepTimePredictor on its own features, not a local fit."""
    from faultlens import schema
    from faultlens.models.predictor import (
        WORKLOAD_FEATURES,
        StepTimePredictor,
        compute_time,
        workload_row,
    )
    from faultlens.schema import StepTiming

    onset = float(inc["opened_ts"])
    rows = con.sql("SELECT * FROM steps WHERE job = ? AND ts BETWEEN ? AND ?",
                   params=[JOB, onset - 1800, onset]).pl()
    fields = set(schema.field_names(StepTiming))
    recs = [StepTiming(**{k: v for k, v in r.items() if k in fields}) for r in rows.iter_rows(named=True)]
    columns = list(zip(*[workload_row(r) for r in recs], strict=True))
    model = StepTimePredictor().fit(dict(zip(WORKLOAD_FEATURES, columns, strict=True)), [compute_time(r) for r in recs])
    per_step, _ = views.step_prediction(con, JOB, onset_ts=onset, fit_rows=len(recs))
    step0 = per_step.row(0, named=True)
    same_step = [r for r in recs if r.step == step0["step"]]
    assert same_step
    expected = max(float(model.predict({f: [v] for f, v in zip(WORKLOAD_FEATURES, workload_row(r), strict=True)})[0])
                   for r in same_step)
    assert step0["predicted_s"] == pytest.approx(expected, rel=1e-3)  # IRLS on rows in another order


def test_machine_views(con) -> None:
    cells = views.gpu_heatmap(con, CULPRIT, "sm_clock_mhz_min")
    assert cells["gpu"].n_unique() == 8 and cells.height <= views.MAX_CHART_ROWS
    lost = cells.filter((pl.col("gpu") == CULPRIT_GPU) & (pl.col("time").dt.epoch("s") >= FAULT_TS))
    assert lost["value"].max() == 0.0
    assert views.kernel_events(con, CULPRIT)["xid"].to_list() == [None, 79]
    assert views.node_incidents(con, CULPRIT)["id"].to_list() == [INCIDENT_ID]
    with pytest.raises(ValueError, match="unknown metric"):
        views.gpu_heatmap(con, CULPRIT, "nope")


def test_report_figures(con) -> None:
    assert views.xid_histogram(con).rows() == [(79, 1, 1)]
    rma = views.rma_candidates(con).row(0, named=True)
    assert (rma["node"], rma["gpu"], rma["ecc_dbe"], rma["reason"]) == ("n002", 3, 2, "repeated double-bit ECC errors")
    assert views.failing_machines(con)["node"][0] == CULPRIT


def test_chart_builders_make_valid_specs(con, inc: dict) -> None:
    topo = charts.topology_chart(views.topology_grid(con, inc)).to_dict()
    colours = topo["layer"][0]["encoding"]["color"]["scale"]
    assert colours["domain"] == ["suspect", "evicted", "healthy"] and colours["range"][0] == "#d62728"
    step = charts.step_time_chart(views.step_prediction(con, JOB, onset_ts=inc["opened_ts"])[0]).to_dict()
    assert len(step["vconcat"]) == 2
    heat = charts.gpu_heatmap_chart(views.gpu_heatmap(con, CULPRIT, "temp_c_max"), title="t").to_dict()
    assert heat["mark"]["type"] == "rect" and heat["encoding"]["y"]["field"] == "gpu"
    ev = charts.evidence_chart(views.evidence_timeline(con, inc)).to_dict()
    assert ev["encoding"]["x"]["type"] == "temporal"
    for chart in (charts.severity_bar({"critical": 1, "warning": 0, "info": 0}), charts.ettr_bar(views.ettr(con)),
                  charts.downtime_chart(views.downtime_ledger(con, JOB)[0]), charts.xid_chart(views.xid_histogram(con))):
        spec = chart.to_dict()
        assert spec["mark"]["type"] == "bar"


def test_label_rows_validate(inc: dict, tmp_path: Path) -> None:
    row = labels.label_row(inc, verdict="confirmed", author="bob")
    assert (row["kind"], row["category"], row["nodes"]) == ("gpu_lost", "gpu_hardware", f'["{CULPRIT}"]')
    with pytest.raises(ValueError, match="unknown fault kind"):
        labels.label_row(inc, verdict="corrected", kind="gremlins")
    with pytest.raises(ValueError, match="verdict"):
        labels.label_row(inc, verdict="maybe")


def test_tolerated_incidents_are_not_failures_and_one_fault_counts_once(tmp_path: Path) -> None:
    """A link flap nothing was done about is tolerated; a throttled GPU opened as thermal throttling
    and as a fail-slow machine (two incidents, one culprit, minutes apart) is one failure."""
    from faultlens.schema import Incident
    from tests.ui_scenario import T0, write_records

    lake = build_lake(tmp_path / "lake").path
    base = {"job": JOB, "severity": "critical", "confidence": 0.9, "status": "mitigated"}
    write_records(lake, [
        Incident(id="inc-flap", opened_ts=T0 + 300, updated_ts=T0 + 400, status="resolved", job=JOB,
                 severity="critical", confidence=0.6, category="network", kind="ib_link", title="IB link down on n004",
                 suspects=[{"node": "n004", "score": 0.6, "reason": "link down"}], actions=[],
                 summary="network alert not repeated: tolerated (link flap recovered)"),
        *(Incident(id=f"inc-{kind}", opened_ts=T0 + 600 + i * 120, updated_ts=T0 + 900, category="thermal_power",
                   kind=kind, title=f"{kind} on n001", suspects=[{"node": "n001", "gpu": 2, "score": 0.9, "reason": "hot"}],
                   actions=[f"act-{kind}"], **base)
          for i, kind in enumerate(("thermal_throttle", "fail_slow"))),
    ])
    con = views.connect(lake)
    try:
        assert views.reliability(con, JOB)["failures"] == 2  # the Xid 79 and the throttled GPU
    finally:
        con.close()


def test_time_axes_read_as_24_hour_times_and_legends_never_null(con, inc: dict) -> None:
    import datetime as dt

    timeline = views.evidence_timeline(con, inc)
    ev = charts.evidence_chart(timeline).to_dict()
    assert ev["encoding"]["x"]["axis"]["format"] == "%H:%M:%S"  # 10 minutes of evidence: ticks under a minute apart
    hours = pl.DataFrame({"time": [dt.datetime(2025, 3, 3, 9), dt.datetime(2025, 3, 3, 13)]})
    assert charts.time_x(hours).to_dict()["axis"]["format"] == "%H:%M"  # hours within one day
    short = timeline.filter(pl.col("ts") < FAULT_TS + 1)
    assert charts.time_x(short).to_dict()["axis"]["format"] == "%H:%M:%S.%L"  # not ".800 .800 .400"
    days = pl.DataFrame({"time": [dt.datetime(2025, 3, 3, 23), dt.datetime(2025, 3, 4, 1)]})
    assert charts.time_x(days).to_dict()["axis"]["format"] == "%b %d %H:%M"  # the range spans two dates
    job_wide = timeline.with_columns(pl.lit(None, dtype=pl.String).alias("node"))
    spec = charts.evidence_chart(job_wide).to_dict()
    assert {r["node"] for r in spec["datasets"][spec["data"]["name"]]} == {"(job-wide)"}
