"""Children that die with the process that started them.

A demo or benchmark killed from outside (SIGKILL, an OOM kill) runs no cleanup:
its services, started in their own sessions so that a terminal's Ctrl-C reaches
the parent first, would run on as orphans. Two mechanisms, both from here:

* the kernel's parent-death signal (``prctl(PR_SET_PDEATHSIG)``, Linux), set in
  the child between fork and exec, for any program (the embedded broker too).
  The kernel sends it when the *thread* that forked the child ends, so spawns
  from other threads (a benchmark's chaos thread) are made by one long-lived
  spawner thread instead;
* for ``faultlens`` children, a watchdog thread on the parent's pid (handed
  down in ``FAULTLENS_PARENT_PID``; ``faultlens.cli`` starts it): when the
  parent is gone it sends SIGTERM, so the service drains as on a supervisor's
  stop, and SIGKILL after a grace period if the drain hangs on a dead broker.

Usage: ``subprocess.Popen(argv, **die_with_parent(env=env))`` or ``spawn(argv, ...)``
from any thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

PARENT_ENV = "FAULTLENS_PARENT_PID"
PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    """libc's prctl, resolved now: nothing but the call itself runs between fork and exec."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.prctl
    except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_PRCTL = _load_prctl()


def _in_child(parent_pid: int, signum: int) -> None:
    """Runs in the child after fork: ask for ``signum`` when the parent dies; if it already
    died between fork and here (the child was re-parented), go now."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent(signum: int = signal.SIGKILL, *, env: dict[str, str] | None = None) -> dict[str, Any]:
    """``Popen`` keyword arguments (``preexec_fn``, ``env``) that end the child with this process.

    ``signum``: what the child gets when this process dies (SIGTERM for a ``faultlens``
    service, which drains; SIGKILL for anything whose shutdown is not ours to trust).
    Call it in the thread that calls ``Popen``; ``spawn`` does both from any thread.
    """
    me = os.getpid()
    child_env = dict(os.environ if env is None else env)
    child_env[PARENT_ENV] = str(me)
    return {"preexec_fn": functools.partial(_in_child, me, signum), "env": child_env}


# ----------------------------------------------------------------- spawns from other threads

_requests: queue.Queue[tuple[Callable[[], Any], queue.Queue[tuple[bool, Any]]]] = queue.Queue()
_spawner: threading.Thread | None = None
_spawner_lock = threading.Lock()


def _spawner_loop() -> None:
    while True:
        fn, reply = _requests.get()
        try:
            reply.put((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller's thread
            reply.put((False, exc))


def _on_lasting_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in the main thread's stead on a thread that lives as long as the process."""
    global _spawner
    if threading.current_thread() is threading.main_thread():
        return fn()
    with _spawner_lock:
        if _spawner is None or not _spawner.is_alive():
            _spawner = threading.Thread(target=_spawner_loop, name="faultlens-spawner", daemon=True)
            _spawner.start()
    reply: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=1)
    _requests.put((fn, reply))
    ok, value = reply.get()
    if not ok:
        raise value
    return value


def spawn(argv: list[str], *, signum: int = signal.SIGKILL, env: dict[str, str] | None = None,
          **popen: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(argv, **popen)`` whose child dies with this process, from any thread."""

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(argv, **popen, **die_with_parent(signum, env=env))  # noqa: S603 - argv list

    return _on_lasting_thread(start)  # type: ignore[no-any-return]


# ----------------------------------------------------------------- the child's side

def watch_parent(grace_s: float = 5.0, interval_s: float = 0.5) -> threading.Thread | None:
    """In a ``faultlens`` child: end this process when the parent named in ``FAULTLENS_PARENT_PID``
    is gone (SIGTERM, then SIGKILL after ``grace_s``). The variable is taken out of the
    environment, so this process's own children are watched against it, not against their
    grandparent. Returns the watchdog thread, or None when no parent was named."""
    raw = os.environ.pop(PARENT_ENV, "")
    try:
        parent = int(raw)
    except ValueError:
        return None
    if parent <= 1:
        return None

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        log.warning("parent process %d is gone; stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="faultlens-parent-watch", daemon=True)
    thread.start()
    return thread
