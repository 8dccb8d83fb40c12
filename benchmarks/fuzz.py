"""Benchmark: the long fuzz run (issue 19): mutated real lines through explain, mutated batch directories through diagnose.

What is generated (seeded, tests/fuzzgen.py): lines drawn from the repository's real-log
fixtures and the conformance corpus (kernel, NCCL, step logs, py-spy stacks, nvidia-smi,
NVML JSON), each changed 1-3 times (a changed character, a cut, a doubled or dropped field,
a mangled month, digits made huge, invalid UTF-8, NUL, deep brackets, a 20 kB tail, a
splice with another line, a stray line break).

1. explain: ``--lines`` mutated lines, in files of ``--file-lines``, each file read as one
   format in turn (auto, kernel, nccl, steps, stack, nvsmi) through ``explain_lines`` and
   written as ``explain --json`` writes them (orjson). A crash is an exception or a file
   whose lines were not all answered. lines/s counts explain time only (not generation).
2. diagnose: ``--dirs`` batch directories: a small simulated job (2 nodes, 2 minutes) whose
   kernel log, one NCCL log and gpu.jsonl get mutated lines (byte-level damage in some),
   read by ``read_batch_dir`` and diagnosed by ``diagnose_records`` with the report
   rendered, as ``faultlens diagnose DIR`` does. A crash is any exception.

3. last, as a user runs them: ``faultlens explain --json`` (a subprocess) on ``--cli-lines``
   (20,000) mutated kernel and NCCL lines must answer every line and exit 0, and
   ``faultlens diagnose DIR`` with that log as a node's kernel.log must finish and list the
   unparsed input in report.md.

Each crash is written (input + traceback) under ``--out`` for a regression fixture.
Prints lines/s, directories/s, crashes (target 0), unparsed counts and peak RSS.

    python benchmarks/fuzz.py                 # 1M lines, 10k directories (an hour or more on 2 cores)
    python benchmarks/fuzz.py --quick         # 30k lines, 50 directories (about a minute)
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FORMATS = (None, "kernel", "nccl", "steps", "stack", "nvsmi")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _crash(out: Path, kind: str, n: int, payload: dict, exc: BaseException | None, note: str = "") -> None:
    out.mkdir(parents=True, exist_ok=True)
    tb = "".join(traceback.format_exception(exc)) if exc is not None else note
    (out / f"{kind}-{n:04d}.json").write_text(json.dumps({**payload, "traceback": tb}, ensure_ascii=True, indent=1))


def fuzz_explain(n_lines: int, file_lines: int, seed: int, out: Path, progress) -> dict:
    import orjson

    from faultlens.diagnosis.explain import explain_lines
    from tests.fuzzgen import SOURCES, mutated_lines

    rng = random.Random(seed)
    done = crashes = unparsed = 0
    busy = 0.0
    task = progress.add_task("explain", total=n_lines)
    i = 0
    while done < n_lines:
        k = min(file_lines, n_lines - done)
        sources = tuple(rng.sample(SOURCES, rng.randint(1, 2)))
        lines = mutated_lines(sources, k, seed=rng.randrange(2**32))
        fmt = FORMATS[i % len(FORMATS)]
        i += 1
        t0 = time.perf_counter()
        try:
            answered = written = 0
            for e in explain_lines(lines, fmt):
                answered += 1
                unparsed += e.c.rule == "unparsed"
                written += len(orjson.dumps({**e.to_json(), "text": e.text.encode("utf-8", "replace").decode()}))
            if answered != len(lines):
                crashes += 1
                _crash(out, "explain", crashes, {"format": fmt, "lines": lines}, None,
                       f"{answered} of {len(lines)} lines answered")
        except Exception as exc:  # noqa: BLE001 - counted and kept: that is the point
            crashes += 1
            _crash(out, "explain", crashes, {"format": fmt, "lines": lines}, exc)
        busy += time.perf_counter() - t0
        done += k
        progress.update(task, completed=done, description=f"explain  crashes={crashes}")
    return {"lines": done, "explain_s": round(busy, 2), "lines_per_s": round(done / busy) if busy else 0,
            "crashes": crashes, "unparsed_lines": unparsed}


def cli_checks(n_lines: int, seed: int, work: Path) -> dict:
    """issue 19's "done when", as a user runs it: ``faultlens explain --json`` on ``n_lines`` mutated real
    kernel and NCCL lines, and ``faultlens diagnose DIR`` on a directory holding such a kernel log."""
    import subprocess

    from tests.fuzzgen import mutated_lines, to_bytes

    f = work / "mutated.log"
    data = to_bytes(mutated_lines(("kernel", "nccl"), n_lines, seed=seed))
    f.write_bytes(data)
    cli = [sys.executable, "-c", "from faultlens.cli import main; raise SystemExit(main())"]
    t = time.perf_counter()
    got = subprocess.run([*cli, "explain", "--json", str(f)], capture_output=True)
    took = time.perf_counter() - t
    rows = [json.loads(x) for x in got.stdout.splitlines()]
    answered = [r["line_no"] for r in rows] == list(range(1, data.count(b"\n") + 1))
    d = _base_dir(work / "diag")
    node = sorted((d / "nodes").iterdir())[0]
    (node / "kernel.log").write_bytes((node / "kernel.log").read_bytes() + data)
    dg = subprocess.run([*cli, "diagnose", str(d), "--out", str(work / "diag-out"), "--detectors", "none"],
                        capture_output=True)
    report = (work / "diag-out" / "report.md").read_text() if (work / "diag-out" / "report.md").is_file() else ""
    return {"cli_explain_lines": data.count(b"\n"), "cli_explain_rc": got.returncode, "cli_explain_answered_all": answered,
            "cli_explain_unparsed": sum(r["entry"] == "unparsed" for r in rows), "cli_explain_s": round(took, 1),
            "cli_explain_traceback": b"Traceback" in got.stderr, "cli_diagnose_rc": dg.returncode,
            "cli_diagnose_traceback": b"Traceback" in dg.stderr,
            "cli_diagnose_reports_unparsed": "## Unparsed input" in report}


def _base_dir(root: Path) -> Path:
    from faultlens.datasets.scenario import scenario_for
    from faultlens.datasets.scenario_files import write_batch_dir

    return write_batch_dir(scenario_for("gpu_lost", nodes=2, duration_s=120.0, seed=3), root / "base")


def fuzz_batch(n_dirs: int, seed: int, out: Path, work: Path, progress) -> dict:
    from faultlens.collectors.batch import read_batch_dir
    from faultlens.commands.diagnose import unparsed_section
    from faultlens.config import Config
    from faultlens.diagnosis.batch import diagnose_records
    from faultlens.ui.report import render_batch_report
    from tests.fuzzgen import mutate_bytes, mutated_lines, to_bytes

    base = _base_dir(work)
    d = work / "run"
    shutil.copytree(base, d)
    nodes = sorted((d / "nodes").iterdir())
    originals = {p: p.read_bytes() for p in d.rglob("*") if p.is_file()}
    rng = random.Random(seed)
    crashes = unparsed = records = 0
    busy = 0.0
    task = progress.add_task("diagnose", total=n_dirs)
    config = Config()
    for i in range(n_dirs):
        for p, data in originals.items():  # back to the job as simulated, then damage it
            p.write_bytes(data)
        node = rng.choice(nodes)
        k = node / "kernel.log"
        data = to_bytes(k.read_text().splitlines()[: rng.randint(0, 200)]
                        + mutated_lines("kernel", rng.randint(1, 300), seed=rng.randrange(2**32)))
        if rng.random() < 0.3:
            data = mutate_bytes(data, rng)
        k.write_bytes(data)
        nccl = sorted((node / "nccl").glob("*.log"))
        if nccl and rng.random() < 0.5:
            f = rng.choice(nccl)
            f.write_bytes(f.read_bytes() + to_bytes(mutated_lines("nccl", rng.randint(1, 100), seed=rng.randrange(2**32))))
        if rng.random() < 0.3:
            g = node / "gpu.jsonl"
            g.write_bytes(g.read_bytes() + to_bytes(mutated_lines("gpu", rng.randint(1, 20), seed=rng.randrange(2**32))))
        t0 = time.perf_counter()
        try:
            data_in = read_batch_dir(d)
            recs = list(data_in.records())
            incidents, actions = diagnose_records(data_in.job, recs, config, detectors=[])
            render_batch_report(d, incidents, actions, [], len(recs), 0.0, 0.0, clocks=data_in.clocks,
                                errors=data_in.errors) + unparsed_section(data_in)
            unparsed += data_in.unparsed.count
            records += len(recs)
        except Exception as exc:  # noqa: BLE001
            crashes += 1
            keep = out / f"dir-{crashes:04d}"
            shutil.copytree(d, keep, dirs_exist_ok=True)
            _crash(out, "diagnose", crashes, {"dir": str(keep)}, exc)
        busy += time.perf_counter() - t0
        progress.update(task, completed=i + 1, description=f"diagnose crashes={crashes}")
    return {"dirs": n_dirs, "diagnose_s": round(busy, 2), "dirs_per_s": round(n_dirs / busy, 2) if busy else 0,
            "dir_crashes": crashes, "dir_unparsed": unparsed, "dir_records": records}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="30k lines, 50 directories (about a minute)")
    ap.add_argument("--smoke", action="store_true", help="2,000 lines, 3 directories (seconds): does it still run")
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--file-lines", type=int, default=20_000, help="lines per explained file")
    ap.add_argument("--dirs", type=int, default=10_000)
    ap.add_argument("--cli-lines", type=int, default=20_000, help="mutated lines for the explain --json CLI check")
    ap.add_argument("--seed", type=int, default=19)
    ap.add_argument("--out", default="fuzz-crashes", help="where crashing inputs are written")
    args = ap.parse_args()
    if args.quick:
        args.lines, args.dirs = 30_000, 50
    if args.smoke:
        args.lines, args.dirs, args.file_lines, args.cli_lines = 2_000, 3, 1_000, 500
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    out = Path(args.out)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp, Progress(
            TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=console, transient=True) as progress:
        ex = fuzz_explain(args.lines, args.file_lines, args.seed, out, progress)
        rss_explain = peak_rss_mb()
        bd = fuzz_batch(args.dirs, args.seed, out, Path(tmp), progress)
        rss_batch = peak_rss_mb()
        task = progress.add_task("explain --json / diagnose CLI", total=None)
        cl = cli_checks(args.cli_lines, args.seed, Path(tmp))  # last: reading its output back costs memory here
        progress.remove_task(task)
    wall = time.perf_counter() - t0
    res = {"bench": "fuzz", **cl, **ex, "peak_rss_mb_explain": round(rss_explain), **bd,
           "peak_rss_mb": round(rss_batch), "wall_s": round(wall, 1), "quick": args.quick, "seed": args.seed}
    cli_ok = (cl["cli_explain_rc"] == 0 and cl["cli_explain_answered_all"] and not cl["cli_explain_traceback"]
              and cl["cli_diagnose_rc"] == 0 and cl["cli_diagnose_reports_unparsed"] and not cl["cli_diagnose_traceback"])
    print(f"faultlens explain --json on {cl['cli_explain_lines']:,} mutated real lines: rc {cl['cli_explain_rc']}, "
          f"every line answered {cl['cli_explain_answered_all']}, {cl['cli_explain_unparsed']} unparsed, {cl['cli_explain_s']} s; "
          f"faultlens diagnose DIR (that log as a kernel.log): rc {cl['cli_diagnose_rc']}, "
          f"report lists unparsed input {cl['cli_diagnose_reports_unparsed']}")
    print(f"explain:  {ex['lines']:,} mutated lines in {ex['explain_s']:.1f} s = {ex['lines_per_s']:,} lines/s; "
          f"crashes {ex['crashes']}; answered as unparsed {ex['unparsed_lines']:,}; peak RSS {rss_explain:.0f} MB")
    print(f"diagnose: {bd['dirs']:,} mutated batch directories in {bd['diagnose_s']:.1f} s = {bd['dirs_per_s']} dirs/s; "
          f"crashes {bd['dir_crashes']}; unparsed lines/files listed {bd['dir_unparsed']:,}; peak RSS {res['peak_rss_mb']} MB")
    print("(peak RSS: the explain phase alone, then with the batch phase; the CLI checks ran in subprocesses)")
    if ex["crashes"] or bd["dir_crashes"]:
        print(f"crashing inputs and tracebacks: {out}/ (add each to tests/fixtures/fuzz_regressions/cases.jsonl)")
    print(json.dumps(res))
    return 1 if ex["crashes"] or bd["dir_crashes"] or not cli_ok else 0


if __name__ == "__main__":
    raise SystemExit(main())
