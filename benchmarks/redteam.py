"""Red team: every attack of issue 24 against the real services, each counted.

Each attack is one function registered with ``@attack("name")``; it returns a dict of
counts whose keys name what went wrong (forged actions executed, injection effects,
forged log lines, crash loops, secrets in logs, evictions past a cap, ...). Every count
must be zero. Attacks run against real processes or the real classes on the embedded
broker (Tansu), never mocks.

    python benchmarks/redteam.py            # every attack
    python benchmarks/redteam.py --quick    # the same attacks, smaller volumes
    python benchmarks/redteam.py --smoke    # one small case per attack (seconds)
    python benchmarks/redteam.py --only forged_actions,injection

Last line: one JSON object, ``{"bench": "redteam", "<attack>.<count>": n, ..., "total": n}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


@dataclass(frozen=True)
class Scale:
    """How hard each attack pushes: ``smoke`` (seconds), ``quick``, full."""

    name: str
    factor: float  # 1.0 = full volumes

    def n(self, full: int, minimum: int = 1) -> int:
        return max(minimum, int(full * self.factor))


AttackFn = Callable[[Scale], dict[str, int]]
ATTACKS: dict[str, AttackFn] = {}


def attack(name: str) -> Callable[[AttackFn], AttackFn]:
    """Register an attack under ``name`` (its counts print as ``name.count``)."""

    def register(fn: AttackFn) -> AttackFn:
        ATTACKS[name] = fn
        return fn

    return register


# ---------------------------------------------------------------------------
# Signed actions, injection, forged log lines, secrets, the runner's ledger
# (issue 24 items 1, 2, 6, 7)
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# Caps that hold: per-job, fleet, breaker, runner's own limits (issue 24 item 3)
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# Poison messages and checkpoints without pickle (issue 24 items 4, 5)
# ---------------------------------------------------------------------------
# Each attack starts its own embedded broker and runs the real commands (`faultlens diagnose`,
# `faultlens stream`, `faultlens runner`, `faultlens report`) as processes against it.

_TRACEBACK = "Traceback (most recent call last)"


class _Services:
    """An embedded broker, a scratch directory, and `faultlens` processes configured for both."""

    def __init__(self, name: str):
        import tempfile

        from faultlens.stream.broker import EmbeddedBroker

        self.tmp = Path(tempfile.mkdtemp(prefix=f"redteam-{name}-"))
        self.broker = EmbeddedBroker().start()
        self.prefix = f"rt{name.replace('_', '')}{int(time.time())}"
        from faultlens.config import BusConfig

        self.bus = BusConfig(bootstrap_servers=self.broker.bootstrap, topic_prefix=self.prefix, linger_ms=5)
        self.logs: list[Path] = []

    def env(self) -> dict[str, str]:
        import os

        env = {k: v for k, v in os.environ.items() if not k.startswith("FAULTLENS_")}
        env.update(FAULTLENS_BOOTSTRAP=self.broker.bootstrap, FAULTLENS_BUS_TOPIC_PREFIX=self.prefix,
                   FAULTLENS_DIAGNOSIS_GROUP_ID=f"{self.prefix}-diag",
                   FAULTLENS_DIAGNOSIS_CATALOG_PATH=str(self.tmp / "health.duckdb"),
                   FAULTLENS_RUNNER_GROUP_ID=f"{self.prefix}-runner",
                   FAULTLENS_RUNNER_STATE_PATH=str(self.tmp / "ledger.jsonl"),
                   FAULTLENS_LAKE_GROUP_ID=f"{self.prefix}-stream", PYTHONPATH=str(REPO))
        return env

    def start(self, *args: str, log_name: str) -> Any:
        import subprocess

        log = self.tmp / f"{log_name}-{len(self.logs)}.log"
        self.logs.append(log)
        out = log.open("w")
        return subprocess.Popen([sys.executable, "-m", "faultlens.cli", *args], env=self.env(), cwd=self.tmp,
                                stdout=out, stderr=subprocess.STDOUT)

    def run(self, *args: str, log_name: str, timeout_s: float = 120) -> int:
        proc = self.start(*args, log_name=log_name)
        try:
            return proc.wait(timeout_s)
        except Exception:  # noqa: BLE001 - a hang is a failure too
            proc.kill()
            proc.wait()
            return -9

    def tracebacks(self) -> int:
        """Tracebacks through faultlens's code in the processes' logs. One wholly inside kafka-python
        (its IO thread racing a socket close at shutdown, logged by the client itself) is not ours."""
        n = 0
        for p in self.logs:
            for block in p.read_text(errors="replace").split(_TRACEBACK)[1:]:
                frames = [ln for ln in block.splitlines()[1:40] if ln.startswith('  File "')]
                n += not frames or any("/site-packages/kafka/" not in f for f in frames)
        return n

    def producer(self) -> Any:
        from faultlens.stream.bus import Producer, ensure_topics

        ensure_topics(self.bus)
        return Producer(self.bus)

    def consumer(self, *kinds: str) -> Any:
        from faultlens.stream.bus import Consumer

        return Consumer(self.bus, list(kinds), group_id=None)

    def close(self) -> None:
        import os
        import shutil

        self.broker.stop()
        if os.environ.get("REDTEAM_KEEP"):  # the processes' logs, to read what an attack did
            print(f"kept {self.tmp}", file=sys.stderr)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)


def _diagnose(svc: _Services, name: str, timeout_s: float = 90) -> tuple[Any, bool]:
    """`faultlens diagnose` (online) started; (process, True) once it owns its partitions."""
    proc = svc.start("diagnose", "--detectors", "none", "--max-seconds", "300", log_name=name)
    log = svc.logs[-1]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if "took partition" in log.read_text(errors="replace"):
            return proc, True
        time.sleep(0.2)
    return proc, False


def _stop(proc: Any) -> int:
    """SIGTERM (the service finishes its round and exits 0), then the exit status."""
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except Exception:  # noqa: BLE001 - a service that does not stop is a failure
        proc.kill()
        return proc.wait()


def _xid_round(svc: _Services, job: str, node: str, extra: Any = None, timeout_s: float = 45) -> list[Any]:
    """A job's topology, then (after ``extra`` records) a real Xid 79 on ``node``: the actions for ``job``."""
    from faultlens.stream import schema
    from faultlens.stream.topology import Topology

    topo = Topology.packed(tp=8, pp=1, dp=4, gpus_per_node=8, job=job, node_fmt=f"{job}-n{{:03d}}")
    actions = svc.consumer("actions")
    try:
        with svc.producer() as p:
            p.send(schema.JobTopology(ts=time.time(), job=job, **{k: v for k, v in topo.to_job_dict().items()
                                                                   if k != "job"}))
            p.flush(10)
            time.sleep(1.5)  # the jobs reader learns node -> job
            for send in (extra or ()):
                send(p)
            p.send(schema.KernelEvent(ts=time.time(), node=node, kind="xid", xid=79,
                                      raw="NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."))
            p.flush(10)
        got: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while not got and time.monotonic() < deadline:
            got = [a for a in (schema.decode("actions", m.value) for m in actions.poll(300) if m.value) if a.job == job]
        return got
    finally:
        actions.close()


class _Touch:
    """Unpickling this opens (creates) a file: code run by whoever can write the changelog."""

    def __init__(self, target: Path):
        self.target = str(target)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.target, "w"))


def _pickle_bomb(target: Path) -> bytes:
    """A checkpoint value whose unpickling would create ``target`` (the attack's payload, never loaded here)."""
    import pickle
    import zlib

    return zlib.compress(pickle.dumps({"format": 1, "key": "x", "engine": _Touch(target)}), 1)


def _poison_changelog(svc: _Services, job: str, target: Path) -> None:
    from faultlens.stream.topics import REPARTITION_PARTITIONS

    with svc.producer() as p:
        for part in range(REPARTITION_PARTITIONS):
            for key, value in (("~mark", None), ("~mark", b"\x00garbage"), ("~mark", b'{"next_offset": "x"}'),
                               (job, b"garbage"), (job, _pickle_bomb(target)), ("other-job", None)):
                p.send_raw("diag-changelog", key, value, partition=part)
        p.flush(10)


@attack("poison_changelog")
def poison_changelog(scale: Scale) -> dict[str, int]:
    """Null, garbage and pickled markers and checkpoints on diag-changelog before every (re)start of
    `faultlens diagnose`; each round a real Xid 79 must still be acted on."""
    svc = _Services("changelog")
    counts = {"crash_loops": 0, "missed_actions": 0, "tracebacks": 0, "pickle_effects": 0}
    try:
        for r in range(scale.n(3, minimum=1)):
            job, target = f"rtjob{r}", svc.tmp / f"pwned-{r}"
            _poison_changelog(svc, job, target)
            proc, ready = _diagnose(svc, f"diagnose-{r}")
            if not ready:
                counts["crash_loops"] += 1
                counts["missed_actions"] += 1
                _stop(proc)
                continue
            got = _xid_round(svc, job, f"{job}-n001")
            counts["missed_actions"] += 0 if [a for a in got if a.type == "evict_nodes"] else 1
            counts["crash_loops"] += _stop(proc) != 0
            counts["pickle_effects"] += target.exists()
        counts["tracebacks"] = svc.tracebacks()
    finally:
        svc.close()
    return counts


def _gpu_json(ts: float, node: str) -> bytes:
    return b'{"v":1,"ts":%r,"node":"%s","job":"rt","gpus":[{"index":0,"util":97.0,"temp_c":71.0}]}' % (ts, node.encode())


@attack("poison_timestamps")
def poison_timestamps(scale: Scale) -> dict[str, int]:
    """GPU samples stamped in ms and us, at 2100 and at 1970 (JSON and the agent's MessagePack) into
    the stream processor (twice: a restart) and into diagnosis, then a real Xid 79."""
    from faultlens.config import Config
    from faultlens.stream import decode, schema
    from faultlens.stream.catalog import open_lake

    svc = _Services("timestamps")
    counts = {"crash_loops": 0, "lake_stops": 0, "good_rows_lost": 0, "bad_rows_stored": 0, "missed_actions": 0,
              "actions_in_future": 0, "incidents_closed_at_once": 0, "tracebacks": 0}
    now = time.time()
    bad_ts = [now * 1e3, now * 1e6, 4102444800.0, 12.5]
    good = scale.n(200, minimum=10)
    try:
        with svc.producer() as p:
            for i in range(good):
                p.send_raw("gpu", f"good{i % 7}", _gpu_json(now - good + i, f"good{i % 7}"))
                if i % max(1, good // len(bad_ts)) == 0 and bad_ts:
                    ts = bad_ts.pop()
                    p.send_raw("gpu", "bad", _gpu_json(ts, "bad"))
                    p.send_raw("gpu", "bad", decode.encode_wire(schema.GpuSample(
                        ts=ts, node="bad", gpus=[schema.GpuState(index=0, util=1.0)])))
            p.flush(10)
        lake, catalog = svc.tmp / "lake", svc.tmp / "catalog.duckdb"
        for r in range(2):  # the processor, and its restart
            rc = svc.run("stream", "--lake", str(lake), "--catalog", str(catalog), "--exit-when-idle-s", "2",
                         "--flush-interval-s", "0.5", log_name=f"stream-{r}")
            counts["crash_loops"] += rc != 0
        if lake.is_dir():
            db = open_lake(lake)
            stored = db.execute("SELECT count(*) FROM gpu WHERE node LIKE 'good%'").fetchone()[0]
            bounds = decode.time_bounds()
            counts["bad_rows_stored"] = db.execute("SELECT count(*) FROM gpu WHERE ts < ? OR ts > ?",
                                                   [bounds.earliest_ts, bounds.latest()]).fetchone()[0]
            db.close()
        else:
            stored = 0
        counts["good_rows_lost"] = good - stored
        counts["lake_stops"] = int(stored == 0)

        proc, ready = _diagnose(svc, "diagnose")
        if not ready:
            counts["crash_loops"] += 1
            counts["missed_actions"] += 1
        else:
            job = "rtclock"
            skew = Config().time.max_clock_skew_s

            def future(p: Any) -> None:  # one in the decoder's window (6 h ahead), one past it (2100)
                for ts in (time.time() + 6 * 3600, 4102444800.0, time.time() * 1e3):
                    p.send(schema.GpuSample(ts=ts, node=f"{job}-n002", job=job,
                                            gpus=[schema.GpuState(index=0, util=90.0)]))

            got = _xid_round(svc, job, f"{job}-n001", extra=[future])
            evictions = [a for a in got if a.type == "evict_nodes"]
            counts["missed_actions"] += 0 if evictions else 1
            counts["actions_in_future"] += sum(a.ts > time.time() + skew for a in got)
            time.sleep(2.0)  # a clock in 2100 would close the incident at the next tick
            incidents = svc.consumer("incidents")
            latest: dict[str, str] = {}
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                for m in incidents.poll(300):
                    if not m.value:
                        continue
                    inc = schema.decode("incidents", m.value)
                    if inc.job == job:
                        latest[inc.id] = inc.status
            incidents.close()
            counts["incidents_closed_at_once"] = sum(s == "resolved" for s in latest.values())
            counts["crash_loops"] += _stop(proc) != 0
        counts["tracebacks"] = svc.tracebacks()
    finally:
        svc.close()
    return counts


@attack("poison_tombstones")
def poison_tombstones(scale: Scale) -> dict[str, int]:
    """A null value and an empty one on every topic each service consumes (processor, diagnosis with
    its internal topics, runner); each service runs over them, and diagnosis still acts on an Xid 79."""
    import re

    from faultlens.stream import topics
    from faultlens.stream.processor import CONSUMED_KINDS

    svc = _Services("tombstones")
    counts = {"crash_loops": 0, "tracebacks": 0, "missed_actions": 0, "tombstones_unaccounted": 0}
    kinds = sorted({*CONSUMED_KINDS, "jobs", *topics.INTERNAL, "actions"})
    try:
        with svc.producer() as p:
            for _ in range(scale.n(5, minimum=1)):
                for kind in kinds:
                    p.send_raw(kind, "rt-key", None)
                    p.send_raw(kind, "rt-key", b"")
            p.flush(10)
        proc, ready = _diagnose(svc, "diagnose")
        if ready:
            got = _xid_round(svc, "rttomb", "rttomb-n003")
            counts["missed_actions"] += 0 if [a for a in got if a.type == "evict_nodes"] else 1
        else:
            counts["missed_actions"] += 1
        counts["crash_loops"] += (not ready) + (_stop(proc) != 0)
        counts["crash_loops"] += svc.run("runner", "--duration-s", "8", log_name="runner") != 0
        counts["crash_loops"] += svc.run("stream", "--lake", str(svc.tmp / "lake"), "--catalog",
                                         str(svc.tmp / "catalog.duckdb"), "--exit-when-idle-s", "2",
                                         log_name="stream") != 0
        counts["tracebacks"] = svc.tracebacks()
        # every service says it dead-lettered them (counted, with the reason), none skips them silently
        said = re.compile(r"dead.letter.*\btombstone\b")
        counts["tombstones_unaccounted"] = sum(not said.search(p.read_text(errors="replace")) for p in svc.logs)
    finally:
        svc.close()
    return counts


@attack("pickle_checkpoint")
def pickle_checkpoint(scale: Scale) -> dict[str, int]:
    """A pickle whose ``__reduce__`` creates a file, as every checkpoint and marker of diag-changelog,
    read by `faultlens diagnose` on start; and every pickle load left in the package's code."""
    import re

    svc = _Services("pickle")
    target = svc.tmp / "pwned"
    counts = {"pickle_effects": 0, "crash_loops": 0, "pickle_loads_in_code": 0}
    try:
        from faultlens.stream.topics import REPARTITION_PARTITIONS

        with svc.producer() as p:
            for part in range(REPARTITION_PARTITIONS):
                for key in ("~mark", "job-a", "~nodes/0", f"job-{part}"):
                    p.send_raw("diag-changelog", key, _pickle_bomb(target), partition=part)
            p.flush(10)
        for r in range(scale.n(2, minimum=1)):
            proc, ready = _diagnose(svc, f"diagnose-{r}")
            counts["crash_loops"] += (not ready) + (_stop(proc) != 0)
        counts["pickle_effects"] = int(target.exists())
    finally:
        svc.close()
    loads = re.compile(r"\b(pickle|joblib|cloudpickle|dill)\.loads?\(")
    for part in ("faultlens", "collectors", "stream", "diagnosis", "models", "ui", "datasets"):
        for path in (REPO / part).rglob("*.py"):
            counts["pickle_loads_in_code"] += len(loads.findall(path.read_text(errors="replace")))
    return counts


@attack("quoted_lake_path")
def quoted_lake_path(scale: Scale) -> dict[str, int]:
    """A lake (and catalog) whose path holds ``'``, ``"`` and spaces: the processor writes it, the
    catalog's views, the explorer's connection and `faultlens report` read it."""
    from faultlens.stream import schema
    from faultlens.stream.catalog import open_lake

    svc = _Services("quoted")
    counts = {"stream_failures": 0, "rows_missing": 0, "view_failures": 0, "report_failures": 0}
    n = scale.n(500, minimum=20)
    t0 = time.time() - n
    try:
        base = svc.tmp / "it's a \"quoted\" dir"
        lake, catalog = base / "o'lake", base / "cat 'x'.duckdb"
        with svc.producer() as p:
            for i in range(n):
                p.send(schema.GpuSample(ts=t0 + i, node=f"n{i % 4}", job="j'1",
                                        gpus=[schema.GpuState(index=0, util=50.0)]))
            p.send(schema.KernelEvent(ts=t0 + n, node="n0", kind="xid", xid=79, raw="NVRM: Xid 79 it's 'quoted'"))
            p.flush(10)
        rc = svc.run("stream", "--lake", str(lake), "--catalog", str(catalog), "--exit-when-idle-s", "2",
                     log_name="stream")
        counts["stream_failures"] += rc != 0
        try:
            db = open_lake(lake)
            counts["rows_missing"] = n - db.execute("SELECT count(*) FROM gpu").fetchone()[0]
            db.close()
        except Exception:  # noqa: BLE001 - a view that breaks on the path is the finding
            counts["view_failures"] += 1
        try:
            from faultlens.ui.lake import connect

            con = connect(lake)
            con.execute("SELECT count(*) FROM gpu_1m_parts").fetchone()
            con.close()
        except ImportError:
            pass  # the [ui] extra is not installed: nothing to attack
        except Exception:  # noqa: BLE001
            counts["view_failures"] += 1
        rc = svc.run("report", "--lake", str(lake), "--job", "j'1", "--since", str(int(t0 - 60)), "--until",
                     str(int(time.time() + 60)), "--out", str(base / "report 'x'.md"), log_name="report")
        counts["report_failures"] += rc != 0
    finally:
        svc.close()
    return counts


# ---------------------------------------------------------------------------
# Safe text: reports and explorer (issue 24 item 8)
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller volumes")
    ap.add_argument("--smoke", action="store_true", help="one small case per attack (seconds)")
    ap.add_argument("--only", default="", help="comma-separated attack names")
    args = ap.parse_args(argv)
    scale = Scale("smoke", 0.01) if args.smoke else Scale("quick", 0.1) if args.quick else Scale("full", 1.0)
    names = [n for n in args.only.split(",") if n] or list(ATTACKS)
    unknown = [n for n in names if n not in ATTACKS]
    if unknown:
        ap.error(f"unknown attack(s): {', '.join(unknown)}; known: {', '.join(ATTACKS)}")
    figures: dict[str, Any] = {"bench": "redteam", "scale": scale.name}
    total = 0
    print(f"{'attack':<28} {'count':<40} {'value':>8}")
    for name in names:
        started = time.monotonic()
        try:
            counts = ATTACKS[name](scale)
        except Exception:  # an attack that breaks is itself a finding: count it, go on
            traceback.print_exc()
            counts = {"attack_failed": 1}
        for key, value in counts.items():
            print(f"{name:<28} {key:<40} {value:>8}")
            figures[f"{name}.{key}"] = value
            total += int(value)
        print(f"{name:<28} {'(seconds)':<40} {time.monotonic() - started:>8.1f}")
    figures["total"] = total
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
