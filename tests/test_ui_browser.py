"""A real headless Chromium loads the running explorer and must show the culprit.

Streamlit renders in the browser over a websocket, so the test drives Chromium
through the DevTools protocol (a tiny client on ``websockets``, a Streamlit
dependency): navigate, poll the page text until the incident has rendered,
take a screenshot. ``FAULTLENS_REGEN=1`` also refreshes docs/explorer.png.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from websockets.sync.client import ClientConnection, connect

from faultlens.commands.ui import streamlit_argv
from tests.ui_scenario import CULPRIT, INCIDENT_ID, build_lake

pytestmark = pytest.mark.browser
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
REPO = Path(__file__).resolve().parent.parent
CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1400,1000", "--remote-debugging-port=0", "about:blank"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"{url} did not answer in time")


class DevTools:
    """Just enough of the Chrome DevTools protocol: send a command, get its result."""

    def __init__(self, ws: ClientConnection):
        self.ws = ws
        self.ids = itertools.count(1)

    def call(self, method: str, timeout: float = 15.0, **params: object) -> dict:
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            reply = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise AssertionError(f"{method}: {reply['error']}")
                return reply.get("result", {})


def _page_ws(chrome: subprocess.Popen, deadline: float) -> str:
    """Read 'DevTools listening on ws://...' from Chromium's stderr, then find the page target."""
    port = None
    while time.monotonic() < deadline and port is None:
        line = chrome.stderr.readline()
        m = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line or "")
        if m:
            port = int(m.group(1))
    assert port, "chromium did not open its DevTools port"
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:
        targets = json.load(r)
    return next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")


@pytest.mark.timeout(90)
def test_browser_shows_culprit_and_reason(tmp_path: Path) -> None:
    # A missing browser is a failed check, not a skipped one: the explorer is only
    # verified in a real Chromium (.ci/run installs Debian's `chromium`).
    assert CHROMIUM is not None, "chromium not found on PATH: apt-get install chromium (.ci/run does)"
    deadline = time.monotonic() + 120  # a bound on waiting, not a target: a loaded 2-core machine renders slowly
    lake = build_lake(tmp_path / "lake").path
    port = _free_port()
    env = {**os.environ, "FAULTLENS_LAKE_PATH": str(lake)}
    app = subprocess.Popen(streamlit_argv(lake, "127.0.0.1", port), env=env, cwd=tmp_path,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    chrome = None
    try:
        _wait_http(f"http://127.0.0.1:{port}/_stcore/health", deadline)
        chrome = subprocess.Popen([CHROMIUM, f"--user-data-dir={tmp_path / 'chrome'}", *CHROME_FLAGS],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        with connect(_page_ws(chrome, deadline), max_size=64 * 1024 * 1024, open_timeout=10) as ws:
            devtools = DevTools(ws)
            devtools.call("Page.enable")
            devtools.call("Page.navigate", url=f"http://127.0.0.1:{port}/incident?id={INCIDENT_ID}")
            text = ""
            while time.monotonic() < deadline:
                result = devtools.call("Runtime.evaluate", expression="document.body ? document.body.innerText : ''",
                                       returnByValue=True)
                text = result.get("result", {}).get("value") or ""
                # rendered: the headline and the last section (topology) are there, nothing is still running
                running = devtools.call("Runtime.evaluate", returnByValue=True,
                                        expression="!!document.querySelector('[data-testid=\"stStatusWidget\"]')")
                if f"Culprit: {CULPRIT}" in text and "Topology" in text and not running["result"].get("value"):
                    break
                time.sleep(0.3)
            time.sleep(1.0)  # let the charts paint
            shot = base64.b64decode(devtools.call("Page.captureScreenshot", format="png")["data"])
        (tmp_path / "explorer.png").write_bytes(shot)
        if os.environ.get("FAULTLENS_REGEN") == "1":
            (REPO / "docs" / "explorer.png").write_bytes(shot)
        assert f"Culprit: {CULPRIT}" in text, text[:2000]
        assert "Xid 79" in text and "fallen off the bus" in text
        assert len(shot) > 20_000  # a rendered page, not a blank skeleton
    finally:
        for proc in (chrome, app):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
