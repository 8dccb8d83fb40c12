"""Children die with the process that started them (faultlens.lifeline): a demo killed with
SIGKILL leaves none of its processes (the embedded broker, the services) running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return fields[0], int(fields[1])


def running(pid: int) -> bool:
    """Alive and not a zombie (this container's pid 1 may never reap orphans)."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None and st[0] not in ("Z", "X"):
                children.setdefault(st[1], []).append(int(entry))
    out, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    left = {p for p in pids if running(p)}
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = {p for p in left if running(p)}
    return left


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and PR_SET_PDEATHSIG")


def test_a_demo_killed_with_sigkill_leaves_no_process(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAULTLENS_")}  # the embedded broker
    demo = subprocess.Popen([sys.executable, "-m", "faultlens.cli", "demo", "--no-ui", "--nodes", "10",
                             "--workdir", str(tmp_path / "demo"), "--exit-after-s", "300"],
                            env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kids: set[int] = set()
    try:
        want = ("tansu", " stream", " diagnose", " runner", " simulate live")
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and demo.poll() is None:
            kids = descendants(demo.pid)
            lines = " | ".join(cmdline(p) for p in kids)
            if all(w in lines for w in want):
                break
            time.sleep(0.5)
        assert demo.poll() is None, "the demo exited by itself"
        lines = " | ".join(cmdline(p) for p in kids)
        assert all(w in lines for w in want), lines
        time.sleep(1.0)  # past start-up: services in their loops
        kids = descendants(demo.pid)
        os.kill(demo.pid, signal.SIGKILL)
        demo.wait(10)
        left = wait_gone(kids, 15.0)
        assert not left, [cmdline(p) for p in left]
        stray = [p for p in map(int, filter(str.isdigit, os.listdir("/proc")))
                 if running(p) and str(tmp_path / "demo") in cmdline(p)]
        assert not stray, [cmdline(p) for p in stray]
    finally:  # a failed run must not leave its own orphans behind either
        for p in kids | (descendants(demo.pid) if demo.poll() is None else set()):
            if running(p):
                os.kill(p, signal.SIGKILL)
        if demo.poll() is None:
            demo.kill()
            demo.wait(10)


PARENT = textwrap.dedent("""
    import sys, threading, time
    sys.path.insert(0, {repo!r})
    from faultlens import lifeline
    procs = []
    t = threading.Thread(target=lambda: procs.append(lifeline.spawn(["sleep", "120"])))
    t.start(); t.join()   # the thread that asked is gone: the child must not go with it
    procs.append(lifeline.spawn(["sleep", "121"]))
    time.sleep(0.5)
    print(" ".join(str(p.pid) for p in procs), flush=True)
    time.sleep(120)
""")


def test_a_child_spawned_from_a_thread_outlives_the_thread_and_dies_with_the_process() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(repo=str(REPO))], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pids = {int(x) for x in parent.stdout.readline().split()}
        assert len(pids) == 2 and all(running(p) for p in pids)  # the spawning thread ended; its child lives
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        assert not wait_gone(pids, 5.0)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)


CHILD = textwrap.dedent("""
    import signal, sys, time
    sys.path.insert(0, {repo!r})
    from faultlens import lifeline
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a drain that never ends
    lifeline.watch_parent(grace_s=0.5, interval_s=0.1)
    print("watching", flush=True)
    time.sleep(120)
""")

MIDDLE = textwrap.dedent("""
    import os, subprocess, sys
    # starts the child without a parent-death signal, then dies: only the watchdog is left to act
    env = dict(os.environ, FAULTLENS_PARENT_PID=str(os.getpid()))
    child = subprocess.Popen([sys.executable, sys.argv[1]], env=env, stdout=subprocess.PIPE, text=True)
    child.stdout.readline()
    print(child.pid, flush=True)
    os._exit(0)
""")


def test_the_parent_watchdog_ends_a_child_whose_parent_died_even_if_it_ignores_sigterm(tmp_path: Path) -> None:
    (tmp_path / "child.py").write_text(CHILD.format(repo=str(REPO)))
    out = subprocess.run([sys.executable, "-c", MIDDLE, str(tmp_path / "child.py")], capture_output=True, text=True,
                         timeout=60)
    pid = int(out.stdout.split()[0])
    assert not wait_gone({pid}, 5.0)
