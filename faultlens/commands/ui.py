"""``faultlens ui``: the Streamlit incident explorer over the lake (read-only)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

from faultlens import ui
from faultlens.config import Config
from faultlens.errors import ConfigError
from faultlens.lifeline import spawn
from faultlens.ui.lake import is_lake

HELP = (
    "Serve the incident explorer (Streamlit) over a Parquet lake: overview, incident detail with evidence, "
    "suspects, topology and step time, machine heatmaps, and root-cause labels. Reads the lake through its own "
    "in-process DuckDB, never a service's DuckDB file; binds 127.0.0.1 unless told otherwise."
)
EXAMPLE = "faultlens ui --lake ./lake --port 8501"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lake", default=None, help="lake directory (default: lake.path)")
    p.add_argument("--host", default=None, help="address to bind (default: ui.host, 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default: ui.port, 8501)")


def streamlit_argv(lake: Path, host: str, port: int) -> list[str]:
    """The command line that serves the explorer (also used by tests and the demo)."""

    app = Path(ui.__file__).resolve().parent / "app.py"
    return [
        sys.executable, "-m", "streamlit", "run", str(app),
        "--server.address", host, "--server.port", str(port), "--server.headless", "true",
        "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
        "--client.toolbarMode", "viewer",
        "--", "--lake", str(lake),
    ]


def run(args: argparse.Namespace, config: Config) -> int:
    try:
        import streamlit  # noqa: F401
    except ImportError:
        raise ConfigError("the explorer needs Streamlit: pip install 'faultlens[ui]'") from None
    lake = Path(args.lake or config.lake.path).resolve()
    if not lake.is_dir():
        raise ConfigError(f"lake directory {lake} does not exist")

    if not is_lake(lake) and any(lake.iterdir()):  # an empty directory is a lake before its first commit
        raise ConfigError(f"{lake} is not a lake: no table directory (incidents/, steps/, gpu/, ...) in it")
    host = args.host or config.ui.host
    port = args.port or config.ui.port
    print(f"faultlens explorer on http://{host}:{port}/ (lake {lake}); Ctrl-C stops it", flush=True)
    env = {**os.environ, "FAULTLENS_LAKE_PATH": str(lake)}
    proc = spawn(streamlit_argv(lake, host, port), signum=signal.SIGTERM, env=env)  # ends with this process
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        try:
            return proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            return 130
