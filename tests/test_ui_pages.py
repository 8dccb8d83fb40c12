"""Every explorer page under Streamlit's AppTest on the Xid 79 scenario lake."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from faultlens.ui import views
from faultlens.ui.text import md_escape
from tests.ui_scenario import CULPRIT, INCIDENT_ID, JOB, XID_LINE, build_lake

APP = Path(__file__).resolve().parent.parent / "ui" / "app.py"


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_lake(tmp_path_factory.mktemp("ui") / "lake").path


@pytest.fixture
def app(lake: Path, monkeypatch: pytest.MonkeyPatch) -> AppTest:
    monkeypatch.setenv("FAULTLENS_LAKE_PATH", str(lake))
    at = AppTest.from_file(str(APP), default_timeout=30)
    at.run()
    assert not at.exception
    return at


def _texts(at: AppTest) -> str:
    parts = [e.value for kind in ("title", "markdown", "error", "caption", "subheader", "success")
             for e in getattr(at, kind)]
    return "\n".join(str(p) for p in parts)


def _frames(at: AppTest) -> str:
    return "\n".join(d.value.to_csv() for d in at.dataframe)


def test_overview_shows_open_incident_actions_and_health(app: AppTest) -> None:
    metrics = {m.label: m.value for m in app.metric}
    assert metrics["open critical"] == "1"
    assert metrics["actions executed"] == "0" and metrics["actions dry-run"] == "1"  # the dry-run answer is not done
    frames = _frames(app)
    assert "GPU fell off the bus on n003" in frames and JOB in frames
    assert "critical" in frames and "evict_nodes" in frames


def test_incident_page_shows_culprit_suspects_evidence_and_actions(app: AppTest) -> None:
    app.query_params["id"] = INCIDENT_ID
    app.switch_page("app_pages/incident.py").run()
    assert not app.exception
    assert [t.value for t in app.title] == [f"Culprit: {CULPRIT} GPU 5"]
    assert "Xid 79" in app.error[0].value
    frames = _frames(app)
    assert XID_LINE in frames  # the raw kernel line is shown
    assert "0.98" in frames and "n004" in frames  # both suspects with scores
    assert "dry_run" in frames and "would drain n003" in frames  # runner status
    assert "synchronize (torch/cuda/__init__.py:" in frames  # the outlier stack group (diagnosis's fingerprint)
    assert len(app.get("arrow_vega_lite_chart")) + len(app.get("vega_lite_chart")) >= 3


def test_incident_page_gives_the_reason_the_incident_recorded(app: AppTest, lake: Path) -> None:
    """The page's "Why" is the recorded verdict (read here straight from the lake's Parquet), and
    its evidence table leads with the line diagnosis cited."""
    import orjson
    import pyarrow.dataset as ds

    rows = ds.dataset(lake / "incidents", format="parquet", partitioning="hive").to_table().to_pylist()
    record = max((r for r in rows if r["id"] == INCIDENT_ID), key=lambda r: r["updated_ts"])
    suspects = orjson.loads(record["suspects"])
    top = max(suspects, key=lambda s: s.get("score") or 0.0)
    recorded = top.get("reason") or record["summary"] or record["title"]
    app.query_params["id"] = INCIDENT_ID
    app.switch_page("app_pages/incident.py").run()
    assert not app.exception
    assert app.error[0].value == f"**Why:** {md_escape(recorded)}"
    cited = [e["text"] for e in orjson.loads(record["evidence"])]
    evidence = next(d.value for d in app.dataframe if "evidence" in d.value.columns)
    assert list(evidence["evidence"][: len(cited)]) == [True] * len(cited)
    assert set(evidence["text"][: len(cited)]) == set(cited) and XID_LINE in cited
    assert not evidence["evidence"][len(cited):].any()  # context below


def test_machine_page_shows_kernel_events_and_history(app: AppTest) -> None:
    app.query_params["node"] = CULPRIT
    app.switch_page("app_pages/machine.py").run()
    assert not app.exception
    assert app.title[0].value == f"Machine {CULPRIT}"
    frames = _frames(app)
    assert XID_LINE in frames and INCIDENT_ID in frames
    assert len(app.get("arrow_vega_lite_chart")) + len(app.get("vega_lite_chart")) == 6


def test_labels_page_writes_a_label_the_lake_reads_back(app: AppTest, lake: Path, tmp_path: Path) -> None:
    app.query_params["id"] = INCIDENT_ID
    app.switch_page("app_pages/labels.py").run()
    assert not app.exception
    app.radio[0].set_value("corrected")
    app.selectbox[1].set_value("pcie_degradation")
    app.selectbox[2].set_value("pcie")
    app.text_input[1].set_value("alice")
    app.button[0].click().run()
    assert not app.exception
    assert any("Saved corrected label" in s.value for s in app.success)
    con = views.connect(lake)
    got = views.labels(con, incident_id=INCIDENT_ID).row(0, named=True)
    assert (got["verdict"], got["kind"], got["category"], got["author"]) == ("corrected", "pcie_degradation", "pcie", "alice")
    assert got["nodes"] == f'["{CULPRIT}"]'


@pytest.mark.parametrize(("page", "param", "value"), [("incident", "id", "inc-doesnotexist"),
                                                     ("machine", "node", "n999"), ("labels", "id", "inc-nope")])
def test_an_unknown_id_or_node_is_not_found_not_another_one(app: AppTest, page: str, param: str, value: str) -> None:
    app.query_params[param] = value
    app.switch_page(f"app_pages/{page}.py").run()
    assert not app.exception
    assert [e.value for e in app.error] == [f"{'Machine' if page == 'machine' else 'Incident'} `{value}` not found in this lake."]
    assert not app.dataframe and not app.selectbox  # nothing of another incident or machine
    assert all(CULPRIT not in t.value for t in app.title)
