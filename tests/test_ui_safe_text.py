"""Log text is text: report.md, the HTML report and the batch report.md carry no markup from it,
and a lake path with a quote works (issue 24 item 8). The explorer's side is in test_ui_browser.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from faultlens.cli import main
from faultlens.schema import Action, Incident
from faultlens.ui.report import render_batch_report
from faultlens.ui.text import md_code, md_escape
from tests.hostile_text import (
    BACKTICKS,
    IMG,
    MD_IMAGE,
    SCRIPT,
    HostileLake,
    hostile_lake,
    html_markup,
    markdown_markup,
)


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> HostileLake:
    return hostile_lake(tmp_path_factory.mktemp("hostile"))


def test_markdown_report_shows_log_text_as_text(lake: HostileLake, tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    assert "'" in str(lake.path)  # the lake's directory name holds a quote
    assert main(["report", "--lake", str(lake.path), "--job", lake.job, "--out", str(out)]) == 0
    md = out.read_text()
    assert markdown_markup(md, spans=lake.texts) == {"raw_html": 0, "images": 0, "broken_spans": 0}
    assert "n666" in md and "xid.79" in md  # the hostile incident is in the report, escaped


def test_html_report_escapes_log_text(lake: HostileLake, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    assert main(["report", "--lake", str(lake.path), "--job", lake.job, "--out", str(out)]) == 0
    page = out.read_text()
    assert html_markup(page) == {"script_tags": 0, "img_tags": 0, "event_handlers": 0, "remote_refs": 0}
    assert "&lt;script&gt;" in page


def test_batch_report_md_escapes_every_field() -> None:
    inc = Incident(id="inc-1", job="j`1", opened_ts=time.time(), updated_ts=time.time(), status="open",
                   category="gpu_hardware", kind="gpu_lost", severity="critical", confidence=0.9,
                   title=f"GPU lost on {MD_IMAGE}", summary=f"{SCRIPT} {IMG}",
                   suspects=[{"node": f"n1{IMG}", "score": 0.9, "reason": MD_IMAGE}],
                   evidence=[{"source": "kernel", "node": "n1", "text": f"{BACKTICKS} {SCRIPT}\n<img src=x>"}],
                   muted=[{"item": IMG, "by_rule": "r`1"}])
    act = Action(id="act-1", incident_id="inc-1", job="j1", ts=time.time(), type="evict_nodes", nodes=[f"n1{IMG}"],
                 confidence=0.9, reason=f"{SCRIPT}{MD_IMAGE}")
    md = render_batch_report(Path("/runs/bob's `run`"), [inc], [act], [], 10, 0.1, 0.1,
                             errors=[f"line 3: {SCRIPT}"])
    spans = (f"{BACKTICKS} {SCRIPT}", IMG)
    assert markdown_markup(md, spans=spans) == {"raw_html": 0, "images": 0, "broken_spans": 0}


@pytest.mark.parametrize("text", ["`", "``", " `x` ", "a`b", "```", "\n<script>x</script>", "<!-- c -->", "  "])
def test_code_spans_and_escapes_hold_for_any_backticks(text: str) -> None:
    assert markdown_markup(f"- {md_code(text)} {md_escape(text)}") ["raw_html"] == 0
    if text.strip():
        assert markdown_markup(f"- {md_code(text)}", spans=(text,))["broken_spans"] == 0
