"""Run faultlens services as child processes and stop them in order.

Used by ``faultlens demo`` and the end-to-end test: each service is the real
``faultlens <command>`` in its own process (as in production), its output kept
in a log file, and a Ctrl-C stops them newest first so the stream processor
flushes the lake before the broker goes away.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from faultlens.lifeline import spawn

log = logging.getLogger(__name__)


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    _log: object = field(default=None, repr=False)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    """Starts ``faultlens`` subcommands with a shared environment; stops them newest first."""

    def __init__(self, workdir: Path, env: dict[str, str] | None = None):
        self.workdir = Path(workdir)
        self.logdir = self.workdir / "logs"
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ, **(env or {}), PYTHONUNBUFFERED="1")
        self.children: list[Child] = []

    def start(self, name: str, *args: str, wrap: tuple[str, ...] = ()) -> Child:
        """``faultlens *args`` as a child; ``wrap`` goes before it (``unshare --pid ...``: a virtual node)."""
        argv = [*wrap, sys.executable, "-m", "faultlens.cli", *args]
        child = Child(name, argv, self.logdir / f"{name}.log")
        child._log = open(child.log_path, "ab")  # noqa: SIM115 - closed in stop()
        # Its own session (a terminal's Ctrl-C reaches us, and we stop children in order); SIGTERM
        # when this process dies without stopping them (faultlens.lifeline).
        child.proc = spawn(argv, signum=signal.SIGTERM, env=self.env, stdout=child._log, stderr=subprocess.STDOUT,
                           cwd=os.getcwd(), start_new_session=True)
        self.children.append(child)
        log.info("started %s (pid %d): %s", name, child.proc.pid, " ".join(args))
        return child

    def check(self) -> list[Child]:
        """Children that exited on their own (a crashed service)."""
        return [c for c in self.children if c.proc is not None and c.proc.poll() is not None]

    def stop(self, timeout_s: float = 15.0) -> None:
        for child in reversed(self.children):
            if child.alive():
                assert child.proc is not None
                try:
                    os.killpg(child.proc.pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout_s
        for child in reversed(self.children):
            if child.proc is None:
                continue
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop on SIGINT; killing", child.name)
                try:
                    os.killpg(child.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                child.proc.wait(timeout=5)
            if child._log:
                child._log.close()  # type: ignore[attr-defined]

    def tail(self, name: str, lines: int = 20) -> str:
        for child in self.children:
            if child.name == name and child.log_path.exists():
                return "\n".join(child.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""
