"""A real headless Chromium loads the running explorer: the culprit, "not found" for an unknown
id or node, time axes that read as times, and no remote fetch for log text that names images.

The driver (DevTools protocol over ``websockets``) is tests/browser.py. ``FAULTLENS_REGEN=1``
also refreshes docs/explorer.png.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from pathlib import Path

import pytest

from tests.browser import CHROMIUM, explorer
from tests.hostile_text import EVIL, hostile_lake
from tests.ui_scenario import CULPRIT, INCIDENT_ID

pytestmark = pytest.mark.browser
REPO = Path(__file__).resolve().parent.parent
# Streamlit's Vega charts are SVG: axis and legend labels are text elements.
# The first chart of the incident page is the evidence timeline.
CHART_LABELS_JS = ("Array.from((document.querySelector('.vega-embed') || document).querySelectorAll('svg text'))"
                   ".map(t => t.textContent)")


@pytest.mark.timeout(180)
def test_browser_shows_culprit_not_found_and_no_remote_fetch(tmp_path: Path) -> None:
    # A missing browser is a failed check, not a skipped one: the explorer is only
    # verified in a real Chromium (.ci/run installs Debian's `chromium`).
    assert CHROMIUM is not None, "chromium not found on PATH: apt-get install chromium (.ci/run does)"
    lake = hostile_lake(tmp_path)  # the Xid 79 scenario plus an incident and machine named with markup
    with explorer(lake.path, tmp_path) as ui:
        text = ui.visit(f"/incident?id={INCIDENT_ID}", lambda t: f"Culprit: {CULPRIT}" in t and "Topology" in t)
        shot = ui.screenshot()
        (tmp_path / "explorer.png").write_bytes(shot)
        if os.environ.get("FAULTLENS_REGEN") == "1":
            (REPO / "docs" / "explorer.png").write_bytes(shot)
        assert f"Culprit: {CULPRIT}" in text, text[:2000]
        assert "Xid 79" in text and "fallen off the bus" in text
        assert len(shot) > 20_000  # a rendered page, not a blank skeleton
        labels = ui.devtools.evaluate(CHART_LABELS_JS) or []
        times = [t for t in labels if re.fullmatch(r"\d\d:\d\d(:\d\d)?", t)]
        assert times and not [t for t in labels if re.fullmatch(r"\.\d+", t)], labels  # never ".800 .800 .400"
        assert len(times) == len(set(times)), times  # no two ticks read the same
        assert "null" not in labels, labels  # legends name what they show

        for path, what in (("/incident?id=inc-doesnotexist", "Incident inc-doesnotexist"),
                           ("/machine?node=n999", "Machine n999")):
            text = ui.visit(path, lambda t: "not found" in t)
            assert f"{what} not found in this lake" in text, text[:2000]
            assert f"Culprit: {CULPRIT}" not in text and f"Machine {CULPRIT}" not in text and "n101" not in text

        q = urllib.parse.quote
        ui.visit(f"/incident?id={q(lake.incident_id)}", lambda t: "Culprit: n666" in t and "Evidence" in t)
        ui.visit(f"/machine?node={q(lake.node)}", lambda t: "Kernel events" in t)
        assert ui.remote_images() == []
        assert [u for u in ui.remote_requests() if EVIL in u] == []
