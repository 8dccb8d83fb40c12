"""A real headless Chromium on the running explorer, for tests and benchmarks/redteam.py.

Streamlit renders in the browser over a websocket, so Chromium is driven through the
DevTools protocol (a tiny client on ``websockets``, a Streamlit dependency): navigate,
poll the page text until it has rendered, read the DOM, take a screenshot. Every request
the page makes is recorded (``Network.requestWillBeSent``): one to a host other than the
explorer's is a remote fetch (an image named in log text, for one).
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
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from websockets.sync.client import ClientConnection, connect

from faultlens.commands.ui import streamlit_argv

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1400,1000", "--remote-debugging-port=0", "about:blank"]
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}
# Every <img> whose src is not the explorer's own or inline data
REMOTE_IMAGES_JS = """Array.from(document.querySelectorAll('img')).map(i => i.getAttribute('src') || '')
  .filter(s => /^(https?:)?\\/\\//i.test(s) && !/^(https?:)?\\/\\/(127\\.0\\.0\\.1|localhost)[:\\/]/i.test(s))"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"{url} did not answer in time")


class DevTools:
    """Just enough of the Chrome DevTools protocol: send a command, get its result; events are kept."""

    def __init__(self, ws: ClientConnection):
        self.ws = ws
        self.ids = itertools.count(1)
        self.requests: list[str] = []  # every URL the page asked for

    def call(self, method: str, timeout: float = 15.0, **params: object) -> dict[str, Any]:
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            reply = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if reply.get("method") == "Network.requestWillBeSent":
                self.requests.append(reply["params"]["request"]["url"])
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise AssertionError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def evaluate(self, expression: str) -> Any:
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True).get("result", {}).get("value")


def remote(url: str) -> bool:
    """A request that leaves this machine (not the explorer, not inline data)."""
    parts = urllib.parse.urlsplit(url)
    return parts.scheme in ("http", "https", "ws", "wss") and (parts.hostname or "") not in LOCAL_HOSTS


def _page_ws(chrome: subprocess.Popen[str], deadline: float) -> str:
    """Read 'DevTools listening on ws://...' from Chromium's stderr, then find the page target."""
    port = None
    while time.monotonic() < deadline and port is None:
        line = chrome.stderr.readline() if chrome.stderr else ""
        m = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line or "")
        if m:
            port = int(m.group(1))
    assert port, "chromium did not open its DevTools port"
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:
        targets = json.load(r)
    return next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")


class Explorer:
    """The explorer in Chromium: ``visit`` a page and wait until it has rendered."""

    def __init__(self, devtools: DevTools, port: int, deadline: float):
        self.devtools = devtools
        self.base = f"http://127.0.0.1:{port}"
        self.deadline = deadline

    def visit(self, path: str, rendered: Callable[[str], bool], *, settle_s: float = 1.0) -> str:
        """Open ``path``; poll the page text until ``rendered(text)`` and nothing is running; the text."""
        self.devtools.call("Page.navigate", url=self.base + path)
        text = ""
        while time.monotonic() < self.deadline:
            text = self.devtools.evaluate("document.body ? document.body.innerText : ''") or ""
            running = self.devtools.evaluate("!!document.querySelector('[data-testid=\"stStatusWidget\"]')")
            if rendered(text) and not running:
                break
            time.sleep(0.3)
        time.sleep(settle_s)  # let the charts paint and images be asked for
        return self.devtools.evaluate("document.body ? document.body.innerText : ''") or text

    def screenshot(self) -> bytes:
        return base64.b64decode(self.devtools.call("Page.captureScreenshot", format="png")["data"])

    def remote_images(self) -> list[str]:
        return list(self.devtools.evaluate(REMOTE_IMAGES_JS) or [])

    def remote_requests(self) -> list[str]:
        self.devtools.evaluate("1")  # drain the events that arrived since the last call
        return [u for u in self.devtools.requests if remote(u)]


@contextmanager
def explorer(lake: Path, workdir: Path, *, timeout_s: float = 120.0) -> Iterator[Explorer]:
    """Serve ``lake`` with ``faultlens ui``'s command line and drive it from a fresh headless Chromium."""
    assert CHROMIUM is not None, "chromium not found on PATH: apt-get install chromium (.ci/run does)"
    deadline = time.monotonic() + timeout_s  # a bound on waiting, not a target: a loaded 2-core machine is slow
    port = free_port()
    env = {**os.environ, "FAULTLENS_LAKE_PATH": str(lake)}
    app = subprocess.Popen(streamlit_argv(lake, "127.0.0.1", port), env=env, cwd=workdir,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    chrome: subprocess.Popen[str] | None = None
    try:
        wait_http(f"http://127.0.0.1:{port}/_stcore/health", deadline)
        chrome = subprocess.Popen([CHROMIUM, f"--user-data-dir={workdir / 'chrome'}", *CHROME_FLAGS],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        with connect(_page_ws(chrome, deadline), max_size=64 * 1024 * 1024, open_timeout=10) as ws:
            devtools = DevTools(ws)
            devtools.call("Page.enable")
            devtools.call("Network.enable")
            yield Explorer(devtools, port, deadline)
    finally:
        for proc in (chrome, app):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
