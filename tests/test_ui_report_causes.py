"""The report's cause ledger on a real lake (issue 25): the campaign's causes, adding up to the downtime ledger."""

from __future__ import annotations

from pathlib import Path

import pytest

from faultlens.ui.report import CAUSE_ORDER, collect, render_report
from tests.ui_scenario import JOB, build_lake


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_lake(tmp_path_factory.mktemp("causes") / "lake").path


def test_causes_add_up_to_the_downtime_ledger(lake: Path) -> None:
    data = collect(lake, JOB)
    causes = data["causes"]
    assert tuple(causes) == CAUSE_ORDER
    assert all(v >= 0 for v in causes.values())
    assert sum(causes.values()) == pytest.approx(float(data["ledger"]["lost_s"].sum()))
    gaps = data["gaps"]
    if gaps.filter(gaps["incident"].is_not_null()).height:
        assert causes["detection"] + causes["localisation"] + causes["restart"] > 0
    md = render_report(lake, JOB, fmt="md")
    assert "### Unproductive time by cause" in md and "| localisation |" in md
    assert "Unproductive time by cause" in render_report(lake, JOB, fmt="html")
