"""Every command that cannot do what was asked exits non-zero with one sentence naming the
argument, file or value at fault, no traceback and no partial output (issue 26 item 2); help
texts say each default once (item 1); explain names files and reads a pipe (item 5)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ui_scenario import JOB, build_lake

REPO = Path(__file__).resolve().parent.parent
XID79 = "[ 2400.118437] NVRM: Xid (PCI:0000:9d:00): 79, pid=48213, name=python, GPU has fallen off the bus.\n"


def _faultlens(*args: str, stdin: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "faultlens.cli", *args], input=stdin, capture_output=True, text=True,
                          cwd=cwd, timeout=120, env={**os.environ, "FAULTLENS_BOOTSTRAP": ""})


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_lake(tmp_path_factory.mktemp("cli") / "lake").path


def _cases(lake: Path, tmp: Path) -> list[tuple[list[str], str]]:
    (tmp / "empty").mkdir()
    (tmp / "badjob").mkdir()
    (tmp / "badjob" / "job.json").write_text("[1, 2]")
    (tmp / "notalake").mkdir()
    (tmp / "notalake" / "readme.txt").write_text("hello")
    out = str(tmp / "sim")
    return [
        (["report", "--lake", str(lake), "--job", "no-such-job"], "job 'no-such-job' is not in the lake"),
        (["report", "--lake", str(tmp / "notalake"), "--job", JOB], "is not a lake"),
        (["report", "--lake", str(tmp / "missing"), "--job", JOB], "does not exist"),
        (["report", "--lake", str(lake), "--job", JOB, "--since", "2025-03-04", "--until", "2025-03-03"],
         "--since 2025-03-04 is not before --until 2025-03-03"),
        (["report", "--lake", str(lake), "--job", JOB, "--since", "2030-01-01"], "has nothing in"),
        (["report", "--lake", str(lake), "--job", JOB, "--since", "yesterday"], "--since 'yesterday' is not a time"),
        (["ui", "--lake", str(tmp / "notalake")], "is not a lake"),
        (["diagnose", str(tmp / "empty"), "--out", str(tmp / "empty-out")], "no input records"),
        (["diagnose", str(tmp / "badjob"), "--out", str(tmp / "badjob-out")], "job.json:1: expected a JSON object"),
        (["diagnose", str(tmp / "missing")], "is not a directory"),
        (["simulate", "scenario", "--nodes", "0", "--out", out], "argument --nodes: 0 is not a positive"),
        (["simulate", "scenario", "--duration", "-5", "--out", out], "argument --duration: -5 is not a positive"),
        (["simulate", "scenario", "--gpus-per-node", "0", "--out", out], "argument --gpus-per-node: 0 is not"),
        (["simulate", "suite", "--n", "0", "--out", out], "argument --n: 0 is not a positive"),
        (["demo", "--nodes", "-1"], "argument --nodes: -1 is not a positive"),
        (["demo", "--nodes", "4", "--no-ui", "--workdir", str(tmp / "demo")], "--nodes 4: the fleet runs 5 jobs"),
        (["simulate", "live", "--nodes", "2", "--fault", "gpu_lost", "--fault", "hung_task", "--fault", "nan_loss",
          "--workdir", str(tmp / "live")], "give at least --nodes 3"),
        (["explain", str(tmp / "missing.log")], "missing.log"),
        (["stream", "--flush-rows", "-1"], "argument --flush-rows: -1 is not a positive"),
        (["stream", "--exit-when-idle-s", "0"], "argument --exit-when-idle-s: 0 is not a positive"),
        (["agent", "--duration-s", "-1"], "argument --duration-s: -1 is not a positive"),
        (["runner", "--duration-s", "nan"], "argument --duration-s: nan is not a positive"),
        (["train", "--n-estimators", "0"], "argument --n-estimators: 0 is not a positive"),
        (["bench", "--only", "nosuch"], "--only nosuch: no such benchmark"),
        (["diagnose", "--detectors", "bogus", str(tmp / "empty")], "unknown or uninstalled detectors: bogus"),
    ]


def test_every_command_with_bad_arguments_says_what_and_exits_non_zero(lake: Path, tmp_path: Path) -> None:
    for args, said in _cases(lake, tmp_path):
        got = _faultlens(*args)
        assert got.returncode != 0, (args, got.stdout[-500:], got.stderr[-500:])
        assert "Traceback" not in got.stderr, (args, got.stderr[-2000:])
        assert said in got.stderr, (args, got.stderr[-1000:])
    assert not (tmp_path / "sim").exists()  # no partial job.json / truth.json
    assert not (tmp_path / "demo").exists() and not (tmp_path / "live").exists()  # nothing started
    assert not (tmp_path / "empty-out").exists() and not (tmp_path / "badjob-out").exists()


@pytest.mark.parametrize("command", ["diagnose", "report", "ui", "stream", "explain", "runner", "agent"])
def test_help_says_each_default_once(command: str) -> None:
    got = _faultlens(command, "--help")
    assert got.returncode == 0
    text = " ".join(got.stdout.split())
    assert "(default: None)" not in text
    assert "default: lake.path) (default" not in text and text.count("(default: lake.path)") <= 1


def test_explain_names_the_file_on_every_line_and_reads_a_pipe(tmp_path: Path) -> None:
    for name in ("a.log", "b.log"):
        (tmp_path / name).write_text(XID79 + "hello\n")
    got = _faultlens("explain", "a.log", "b.log", cwd=tmp_path)
    lines = got.stdout.splitlines()
    assert got.returncode == 0 and len(lines) == 6
    assert all(line.startswith(("a.log:", "b.log:")) for line in lines), lines
    piped = _faultlens("explain", stdin=XID79)
    assert piped.returncode == 0 and "Xid 79" in piped.stdout and piped.stdout.split()[0] == "1"


def test_the_command_to_run_again_works_in_a_new_shell(tmp_path: Path) -> None:
    """The demo's last line names a command a new shell can run (no activated venv needed)."""
    from faultlens.cli import command_name

    name = command_name()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV",)}
    env["PATH"] = "/usr/bin:/bin"  # a fresh shell: the venv is not on PATH
    got = subprocess.run(f"{name} --version", shell=True, capture_output=True, text=True, env=env, cwd=Path.cwd(),
                         timeout=60)
    assert got.returncode == 0 and got.stdout.startswith("faultlens"), (name, got.stderr)
