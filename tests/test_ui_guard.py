"""The explorer shows the guard (issue 37.6): every suppression of an incident (reason, count, when)
and a fleet view of refusals, evictions waiting for a person and evictions retried after a reset."""

from __future__ import annotations

from pathlib import Path

import pytest

from faultlens.cli import main
from faultlens.config import Config, GuardConfig
from faultlens.diagnosis.engine import DiagnosisEngine, run_records
from faultlens.schema import Action, Incident
from faultlens.ui import views
from tests.test_diag_guard import T0, _job, _xid
from tests.ui_scenario import write_records


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """Job g4 (4 nodes, 1 eviction an hour): n01 evicted, n02 refused by the job cap, n03 by the open
    breaker; a person resets the job; both refusals are retried: n02's is granted (the reset forgot
    the job's grants), n03's is refused by the job cap again and waits for the next reset."""
    tmp = tmp_path_factory.mktemp("guard")
    path = tmp / "guard.jsonl"
    job = _job("g4", 4)
    engine = DiagnosisEngine(Config(guard=GuardConfig(state_path=str(path))), batch=True)
    engine.set_topology(job.record)
    out = run_records(engine, [_xid(job.nodes[0], T0), _xid(job.nodes[1], T0 + 60), _xid(job.nodes[2], T0 + 120)])
    assert main(["guard", "reset", "--job", "g4", "--reason", "checked", "--state-path", str(path)]) == 0
    out += engine.tick(T0 + 200)
    records = [o for o in out if isinstance(o, (Action, Incident))] + [i for i in engine.incidents()]
    write_records(tmp / "lake", records)
    by_node = {i.suspects[0]["node"]: i.id for i in engine.incidents()}
    return tmp / "lake", by_node


def test_an_incident_lists_each_suppression_with_its_count_and_time(guarded) -> None:
    lake, by_node = guarded
    con = views.connect(lake)
    try:
        inc = views.incident(con, by_node["g4-n03"])
        assert inc is not None
        counts = views.suppression_counts(inc)
        assert counts.select("reason", "count").rows() == [("breaker", 1), ("job_cap", 1)]
        assert counts["last_ts"].to_list() == [pytest.approx(T0 + 120), pytest.approx(T0 + 200)]
        listed = views.suppressions(inc)  # newest first
        assert listed.select("reason", "type", "retried").rows() == [("job_cap", "evict_nodes", False),
                                                                   ("breaker", "evict_nodes", True)]
        assert "job breaker open" in listed["text"][1]
        assert views.suppression_counts(views.incident(con, by_node["g4-n01"])).is_empty()  # evicted, none held
    finally:
        con.close()


def test_the_fleet_guard_view_counts_refusals_waiting_and_retried(guarded) -> None:
    lake, _ = guarded
    con = views.connect(lake)
    try:
        g = views.guard_state(con)
        assert g["by_reason"] == {"job_cap": 2, "breaker": 1}
        row = g["jobs"].row(0, named=True)
        assert (row["job"], row["refusals"], row["reasons"]) == ("g4", 3, "breaker, job_cap")
        # two refusals retried after the reset; n03's retry was refused again and waits for a person
        assert row["retried"] == 2 and row["waiting"] == 1 and g["waiting"] == 1
        assert g["evicted_last_hour"] == 2  # n01, and n02 by its retry
    finally:
        con.close()


APP = Path(__file__).resolve().parent.parent / "ui" / "app.py"


def _app(lake: Path, monkeypatch: pytest.MonkeyPatch, page: str, **params: str):
    from streamlit.testing.v1 import AppTest  # the explorer's test harness (the ui extra)

    monkeypatch.setenv("FAULTLENS_LAKE_PATH", str(lake))
    at = AppTest.from_file(str(APP), default_timeout=30)
    at.run()
    for k, v in params.items():
        at.query_params[k] = v
    at.switch_page(page).run()
    assert not at.exception, at.exception
    return at


def test_the_incident_and_guard_pages_show_the_suppressions(guarded, monkeypatch: pytest.MonkeyPatch) -> None:
    lake, by_node = guarded
    at = _app(lake, monkeypatch, "app_pages/incident.py", id=by_node["g4-n03"])
    assert "Held back by the guard" in [s.value for s in at.subheader]
    frames = "\n".join(d.value.to_csv() for d in at.dataframe)
    assert "job_cap" in frames and "breaker" in frames and "job breaker open" in frames
    at = _app(lake, monkeypatch, "app_pages/guard.py")
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["refused evictions waiting for a person"] == "1" and metrics["suppressions"] == "3"
    assert "g4" in "\n".join(d.value.to_csv() for d in at.dataframe)
