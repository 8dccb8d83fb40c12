"""One corrupt line never stops a post-mortem (issue 19), end to end.

``faultlens explain --json`` on mutated real lines answers every line and exits 0 (in
process through the command's own ``run``, and once as a subprocess); a binary file is
one line that says so. ``faultlens diagnose DIR`` on a directory whose kernel log is
mutated, beside binary, looping, cut and misplaced files, finishes and lists the
unparsed input in its report. Hypothesis drives the batch reader over mutated kernel
logs. Bounded: a few thousand lines, FAULTLENS_FUZZ_EXAMPLES/6 batch directories.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from faultlens.cli import main
from faultlens.collectors.batch import read_batch_dir
from faultlens.datasets.scenario import scenario_for
from faultlens.datasets.scenario_files import write_batch_dir
from tests.fuzzgen import mutate, mutated_lines, seed_lines, to_bytes

EXAMPLES = int(os.environ.get("FAULTLENS_FUZZ_EXAMPLES", "100"))
LINES = 3000
QCT = ("[Sat Qct 12 18:35:32 2024] NVRM: Xid (PCI:0000:05:00): 79, pid='<unknown>', name=<unknown>, "
       "GPU has fallen off the bus.")
REGRESSIONS = [json.loads(x)["line"] for x in
               (Path(__file__).parent / "fixtures" / "fuzz_regressions" / "cases.jsonl").read_text().splitlines() if x]


@pytest.fixture(scope="module")
def mutated_log(tmp_path_factory) -> tuple[Path, int]:
    lines = mutated_lines(("kernel", "nccl"), LINES, seed=19) + [QCT] + REGRESSIONS + ["NVRM: Xid " + "9" * 2_000_000]
    path = tmp_path_factory.mktemp("explain") / "mutated.log"
    data = to_bytes(lines)
    path.write_bytes(data)
    return path, data.count(b"\n")


def _answers(out: bytes, n: int) -> list[dict]:
    rows = [json.loads(x) for x in out.splitlines()]
    assert [r["line_no"] for r in rows] == list(range(1, n + 1))
    assert all(r["category"] and r["meaning"] for r in rows)
    return rows


@pytest.mark.parametrize("fmt", ["auto", "kernel", "nccl", "steps", "stack"])
def test_explain_json_in_process_answers_every_mutated_line(mutated_log, capsysbinary, fmt):
    path, n = mutated_log
    assert main(["explain", "--json", "--format", fmt, str(path)]) == 0
    rows = _answers(capsysbinary.readouterr().out, n)
    if fmt in ("auto", "kernel"):
        assert any(r["xid"] == 79 for r in rows)
    assert rows[-1]["entry"] == "unparsed" and "too long" in rows[-1]["meaning"]  # the 2 MB line says why
    assert len(rows[-1]["text"]) < 1000


def test_explain_cli_subprocess(mutated_log):
    path, n = mutated_log
    got = subprocess.run([sys.executable, "-c", "from faultlens.cli import main; raise SystemExit(main())",
                          "explain", "--json", str(path)], capture_output=True, timeout=300)
    assert got.returncode == 0, got.stderr.decode()[-2000:]
    assert b"Traceback" not in got.stderr
    _answers(got.stdout, n)


def test_explain_binary_file_is_one_line(tmp_path, capsysbinary):
    f = tmp_path / "core.bin"
    f.write_bytes(bytes(range(256)) * 40)
    assert main(["explain", str(f)]) == 0
    out = capsysbinary.readouterr().out.decode()
    assert out.count("\n") == 1 and "not a text file" in out
    assert main(["explain", "--json", str(f)]) == 0
    (row,) = [json.loads(x) for x in capsysbinary.readouterr().out.splitlines()]
    assert row["entry"] == "unparsed" and "binary" in row["meaning"]


@pytest.fixture(scope="module")
def batch_dir(tmp_path_factory) -> Path:
    return write_batch_dir(scenario_for("gpu_lost", nodes=2, duration_s=600.0, seed=5),
                           tmp_path_factory.mktemp("batch") / "run")


def _hostile(root: Path) -> None:
    node = sorted((root / "nodes").iterdir())[0]
    k = node / "kernel.log"
    lines = k.read_text().splitlines() + mutated_lines("kernel", 2000, seed=7) + [QCT] + REGRESSIONS
    k.write_bytes(to_bytes(lines))
    nccl = node / "nccl"
    nccl.mkdir(exist_ok=True)
    (nccl / "loop.log").symlink_to("loop.log")
    (nccl / "dir.log").mkdir()
    (nccl / "core.log").write_bytes(bytes(range(256)) * 64)
    (nccl / "long.log").write_bytes(b"NCCL WARN " + b"x" * 3_000_000 + b"\n[rank0]: NCCL WARN ok\n")
    (nccl / "cut.log").write_bytes(b"[rank0]:[E ProcessGroupNCCL.cpp:1316] [PG 0 Rank 0] Watchdog caught coll")
    (node / "gpu.jsonl").open("ab").write(b'{"v":1,"ts":' + b"[" * 5000 + b"\n\xff\xfe{}\n")
    (root / "stacks").mkdir(exist_ok=True)
    (root / "stacks" / "rankX.txt").write_bytes(b"\x00" * 100)


def test_diagnose_survives_a_hostile_directory_and_reports_unparsed(batch_dir, tmp_path, capsys):
    root = tmp_path / "run"
    shutil.copytree(batch_dir, root)
    _hostile(root)
    out = tmp_path / "diag"
    assert main(["diagnose", str(root), "--out", str(out), "--detectors", "none"]) == 0
    report = (out / "report.md").read_text()
    assert "## Unparsed input" in report
    for why in ("not a text file", "line too long", "unreadable", "not a regular file", "not UTF-8", "malformed_json"):
        assert why in report, why
    assert "unparsed input line(s)" in capsys.readouterr().err
    data = read_batch_dir(root)
    assert data.unparsed.count >= 6 and len(data.kernel) > 1000
    assert any(r.xid == 79 for r in data.kernel)


@settings(max_examples=max(4, EXAMPLES // 6), deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.sampled_from(seed_lines("kernel")), st.integers(0, 2**32 - 1)), min_size=1, max_size=60),
       st.integers(0, 2**32 - 1))
def test_batch_reader_is_total_on_mutated_kernel_logs(batch_dir, tmp_path_factory, picks, seed):
    root = tmp_path_factory.mktemp("b") / "run"
    shutil.copytree(batch_dir, root)
    node = sorted((root / "nodes").iterdir())[-1]
    lines = [mutate(line, random.Random(s)) for line, s in picks]
    data = to_bytes(lines)
    r = random.Random(seed)
    if r.random() < 0.3:  # and byte-level damage: a cut, a flipped bit, bytes that are not UTF-8
        i = r.randrange(len(data))
        data = data[:i] + r.choice((b"", b"\xff\xfe", b"\x00" * 8)) + data[i + r.randint(0, 3):]
    (node / "kernel.log").write_bytes(data)
    got = read_batch_dir(root)
    assert got.gpu and got.steps  # the good files still load
    assert all(r.node for r in got.kernel)
