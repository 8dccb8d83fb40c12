"""The batch report: its sections, its figures, and that it needs nothing from the network."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from faultlens.cli import main
from faultlens.ui import labels, views
from faultlens.ui.report import SECTIONS, parse_time, render_report
from tests.ui_scenario import CULPRIT, INCIDENT_ID, JOB, T0, XID_LINE, build_lake


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_lake(tmp_path_factory.mktemp("report") / "lake").path


class _Refs(HTMLParser):
    """Every URL the page would load or link to, and the ids of its sections."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.ids: list[str] = []
        self.svgs = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in ("src", "href", "xlink:href", "action", "data") and value:
                self.urls.append(value)
            if name == "id" and value:
                self.ids.append(value)
        self.svgs += tag == "svg"


def test_html_report_is_self_contained_with_every_section(lake: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    assert main(["report", "--lake", str(lake), "--job", JOB, "--out", str(out)]) == 0
    text = out.read_text()
    refs = _Refs()
    refs.feed(text)
    assert refs.ids == [sid for sid, _ in SECTIONS]
    assert all(not re.match(r"(https?:)?//", u) for u in refs.urls), refs.urls
    assert not re.search(r"url\(\s*['\"]?(https?:)?//", text) and "@import" not in text
    assert refs.svgs == 2  # downtime per cause and the Xid histogram, drawn inline
    assert f"Culprit:</b> {CULPRIT} GPU 5" in text and "Xid 79: GPU has fallen off the bus" in text
    assert "evict_nodes n003 (dry_run)" in text and XID_LINE.split("]", 1)[1].strip() in text
    assert "repeated double-bit ECC errors" in text  # n002 GPU 3 is an RMA candidate
    assert "MTBF" in text and "MTTR" in text and "ETTR" in text


def test_markdown_report_and_time_window(lake: Path) -> None:
    md = render_report(lake, JOB, fmt="md")
    for _, title in SECTIONS:
        assert f"## {title}" in md
    assert f"**Culprit:** {CULPRIT} GPU 5" in md and "| gpu_lost | 11 min | 1 |" in md
    # a window before the fault: no failure, no lost time to the GPU
    early = render_report(lake, JOB, since=T0, until=T0 + 30 * 60, fmt="md")
    assert "GPU fell off the bus" not in early and "gpu_lost" not in early
    assert parse_time("2025-03-03T09:00:00") == T0 == parse_time(str(T0))


def test_labels_override_the_diagnosed_cause(lake: Path, tmp_path: Path) -> None:
    inc = views.incident(views.connect(lake), INCIDENT_ID)
    labels.write_label(lake, inc, verdict="corrected", kind="pcie_degradation", category="pcie", author="carol")
    md = render_report(lake, JOB, fmt="md")
    assert "pcie_degradation (corrected)" in md and "| pcie_degradation | 11 min | 1 |" in md
    with pytest.raises(ValueError):
        render_report(lake, JOB, fmt="pdf")
