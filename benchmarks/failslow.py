"""Fail-slow detection: faultlens's workload-aware CUSUM vs a naive and an NVRx-style detector.

Runs the three detectors side by side over the same step streams:

* ``faultlens``: models/failslow.py (residual of a workload-aware step-time
  model, per-rank CUSUM, localised by compute-vs-wait);
* ``naive``: alarm when a step takes over 20% longer than the rolling median of
  the last 50 steps, three steps running (Greyhound-style change detection
  without a workload model); it blames the node whose rank computed longest;
* ``nvrx``: NVIDIA nvidia-resiliency-ext's straggler scores every 20 steps
  (its report interval): relative = fastest rank's median compute / this
  rank's, individual = the rank's best median / its current one; a rank
  scoring under 0.75 is a straggler, reported with its node.

Streams come from the simulator (datasets/, a thermal-throttle fault whose
speed factor gives a 5/10/20/40% longer compute; healthy runs; a long run with
repeated long-sequence surges), or with ``--source synthetic`` from
tests/stepgen.py. Prints detection rate, steps to detect, localisation
accuracy and false alarms per 1,000 job-hours by slowdown size, the false
alarms of each detector per 10,000 steps under sequence-length variability,
and the predictor's error on healthy steps; the last line is JSON.

    python benchmarks/failslow.py [--quick] [--source sim|synthetic]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from faultlens.models.failslow import FailSlowDetector  # noqa: E402
from faultlens.models.predictor import JobStepPredictor, compute_time  # noqa: E402
from faultlens.schema import StepTiming  # noqa: E402
from faultlens.stream.topology import Topology  # noqa: E402

SIZES = (0.05, 0.10, 0.20, 0.40)
WITHIN_STEPS = 50
_STEP_FIELDS = set(StepTiming.__struct_fields__)  # a msgspec Struct, not a dataclass


@dataclass
class Stream:
    steps: list[list[StepTiming]]
    topology: Topology
    onset_step: int | None  # first slow step
    culprit: str | None
    duration_s: float


# --------------------------------------------------------------------------- detectors


@dataclass
class Alarm:
    step: int
    node: str | None


class Ours:
    name = "faultlens"

    def __init__(self, topology: Topology) -> None:
        self.det = FailSlowDetector()
        self.det.set_topology(topology)

    def step(self, recs: list[StepTiming]) -> list[Alarm]:
        return [Alarm(recs[0].step, f.node) for f in self.det.observe_step(recs)]


class Naive:
    name = "naive"

    def __init__(self, topology: Topology, threshold: float = 0.2, window: int = 50, confirm: int = 3) -> None:
        self.hist: deque[float] = deque(maxlen=window)
        self.threshold, self.confirm = threshold, confirm
        self.run = 0
        self.quiet = 0
        self.latched = False

    def step(self, recs: list[StepTiming]) -> list[Alarm]:
        d = float(np.median([r.duration_s for r in recs]))
        over = len(self.hist) >= 10 and d > (1 + self.threshold) * float(np.median(self.hist))
        self.hist.append(d)
        self.run = self.run + 1 if over else 0
        if self.latched:
            self.quiet = 0 if over else self.quiet + 1
            if self.quiet >= 50:
                self.latched = False
            return []
        if self.run >= self.confirm:
            self.latched, self.quiet = True, 0
            worst = max(recs, key=compute_time)
            return [Alarm(recs[0].step, worst.node)]
        return []


class Nvrx:
    name = "nvrx"

    def __init__(self, topology: Topology, interval: int = 20, threshold: float = 0.75) -> None:
        self.interval, self.threshold = interval, threshold
        self.buf: dict[int, list[float]] = {}
        self.best: dict[int, float] = {}
        self.node = {r: n for r, (n, _) in topology.placement.items()}
        self.reported: set[str] = set()

    def step(self, recs: list[StepTiming]) -> list[Alarm]:
        for r in recs:
            self.buf.setdefault(r.rank, []).append(compute_time(r))
        if len(self.buf[recs[0].rank]) < self.interval:
            return []
        med = {r: float(np.median(v)) for r, v in self.buf.items()}
        self.buf = {}
        fastest = min(med.values())
        out, flagged = [], set()
        for r, m in med.items():
            relative = fastest / m
            individual = self.best.get(r, m) / m
            self.best[r] = min(self.best.get(r, m), m)
            if relative < self.threshold or individual < self.threshold:
                flagged.add(self.node[r])
        for node in sorted(flagged - self.reported):
            out.append(Alarm(recs[0].step, node))
        self.reported = flagged
        return out


DETECTORS: tuple[Callable[[Topology], object], ...] = (Ours, Naive, Nvrx)


# --------------------------------------------------------------------------- streams


def _group(recs: Iterable[StepTiming]) -> list[list[StepTiming]]:
    by: dict[int, list[StepTiming]] = {}
    for r in recs:
        by.setdefault(r.step, []).append(r)
    return [sorted(by[s], key=lambda r: r.rank) for s in sorted(by)]


def sim_stream(seed: int, *, slowdown: float | None, nodes: int = 8, duration_s: float = 900.0,
               surges: int = 0) -> Stream:
    from faultlens.datasets.cluster import ClusterSpec
    from faultlens.datasets.scenario import FaultSpec, Scenario, ScenarioSpec

    rng = np.random.default_rng(seed)
    faults = []
    culprit = None
    if slowdown is not None:
        culprit = f"n{int(rng.integers(nodes)) + 1:03d}"
        faults.append(FaultSpec(kind="thermal_throttle", id="f1", onset_s=float(rng.uniform(250, 350)),
                                node=culprit, gpu=int(rng.integers(8)), params={"slowdown": 1.0 / (1.0 + slowdown)}))
    for i in range(surges):
        faults.append(FaultSpec(kind="seq_surge", id=f"s{i}", onset_s=(i + 0.5) * duration_s / surges,
                                params={"length_s": 0.2 * duration_s / surges}))
    sc = Scenario(ScenarioSpec(name=f"bench-{seed}", seed=seed, cluster=ClusterSpec.for_nodes(nodes, 8),
                               duration_s=duration_s, faults=tuple(faults)))
    recs = []
    for node in sc.topology.nodes:
        for _, line in sc.step_lines(node):
            obj = orjson.loads(line)
            recs.append(StepTiming(**{k: v for k, v in obj.items() if k in _STEP_FIELDS}))
    steps = _group(recs)
    onset = None
    if culprit is not None:
        onset_ts = sc.truth()["faults"][0]["onset_ts"]
        onset = next((s[0].step for s in steps if s[0].ts - s[0].duration_s >= onset_ts), None)
    return Stream(steps, sc.topology, onset, culprit, duration_s)


def synthetic_stream(seed: int, *, slowdown: float | None, nodes: int = 8, steps: int = 300,
                     surges: int = 0) -> Stream:
    from tests import stepgen

    rng = np.random.default_rng(seed)
    sd = None
    if slowdown is not None:
        sd = stepgen.Slowdown(f"n{int(rng.integers(nodes)) + 1:03d}", int(rng.integers(80, 120)), slowdown)
    spec = stepgen.StreamSpec(nodes=nodes, steps=steps, slowdown=sd, seed=seed,
                              surge_every=steps // surges if surges else 0, surge_len=20 if surges else 0)
    st = list(stepgen.steps(spec))
    dur = st[-1][0].ts - st[0][0].ts + st[0][0].duration_s
    return Stream(st, stepgen.topology(spec), sd.onset_step if sd else None, sd.node if sd else None, dur)


# --------------------------------------------------------------------------- scoring


def run_detectors(stream: Stream) -> dict[str, list[Alarm]]:
    dets = [d(stream.topology) for d in DETECTORS]
    out: dict[str, list[Alarm]] = {d.name: [] for d in dets}
    for recs in stream.steps:
        for d in dets:
            out[d.name] += d.step(recs)
    return out


def healthy_hours(stream: Stream) -> float:
    if stream.onset_step is None:
        return stream.duration_s / 3600
    pre = [s for s in stream.steps if s[0].step < stream.onset_step]
    return (pre[-1][0].ts - stream.steps[0][0].ts) / 3600 if pre else 0.0


def score(streams: list[Stream]) -> dict[str, dict[str, float]]:
    res: dict[str, dict[str, float]] = {}
    per: dict[str, dict[str, list]] = {d.name: {"hit": [], "steps": [], "loc": [], "false": []} for d in DETECTORS}
    hours = 0.0
    for st in streams:
        alarms = run_detectors(st)
        hours += healthy_hours(st)
        for name, al in alarms.items():
            p = per[name]
            if st.onset_step is None:
                p["false"].append(len({a.step for a in al}))
                continue
            p["false"].append(len({a.step for a in al if a.step < st.onset_step}))
            after = [a for a in al if a.step >= st.onset_step]
            first = after[0] if after else None
            right = [a for a in after if a.node == st.culprit]
            hit = bool(right) and right[0].step - st.onset_step < WITHIN_STEPS
            p["hit"].append(hit)
            if first is not None:
                p["loc"].append(first.node == st.culprit)
            if right:
                p["steps"].append(right[0].step - st.onset_step + 1)
    for name, p in per.items():
        res[name] = {
            "detect_rate": float(np.mean(p["hit"])) if p["hit"] else math.nan,
            "steps_to_detect_median": float(np.median(p["steps"])) if p["steps"] else math.nan,
            "localisation": float(np.mean(p["loc"])) if p["loc"] else math.nan,
            "false_alarms": float(sum(p["false"])),
            "false_per_1000_job_h": 1000.0 * sum(p["false"]) / hours if hours else math.nan,
            "healthy_hours": hours,
        }
    return res


def predictor_mape(stream: Stream) -> float:
    pred = JobStepPredictor(topology=stream.topology)
    errs = []
    for recs in stream.steps:
        res = pred.observe_step(recs)
        if res.ready:
            errs.append(np.abs(res.ratio - 1.0))
    return float(np.mean(np.concatenate(errs)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer scenarios (under a minute)")
    ap.add_argument("--smoke", action="store_true", help="one scenario per size, short runs (seconds): does it still run")
    ap.add_argument("--source", choices=("sim", "synthetic"), default="sim")
    ap.add_argument("--n", type=int, default=None, help="scenarios per slowdown size")
    args = ap.parse_args(argv)
    n = args.n or (1 if args.smoke else 6 if args.quick else 40)
    source = args.source
    if source == "sim":
        try:
            import faultlens.datasets.scenario  # noqa: F401
        except ImportError:
            source = "synthetic"
            print("simulator not available: using tests/stepgen.py", file=sys.stderr)
    make = sim_stream if source == "sim" else synthetic_stream
    started = time.monotonic()
    by_size: dict[str, dict[str, dict[str, float]]] = {}
    for size in SIZES:
        streams = [make(1000 * int(size * 100) + i, slowdown=size) for i in range(n)]
        by_size[f"{size:.0%}"] = score(streams)
        print(f"  {size:.0%}: {n} scenarios ({time.monotonic() - started:.0f} s)", file=sys.stderr)
    healthy = [make(90_000 + i, slowdown=None) for i in range(max(2, n // 3))]
    healthy_score = score(healthy)
    # Sequence-length variability: one long healthy run with repeated long-sequence surges.
    if source == "sim":
        long_s = 1_500.0 if args.smoke else 9_000.0 if args.quick else 30_000.0
        seq = sim_stream(77, slowdown=None, duration_s=long_s, surges=int(long_s // 1500))
    else:
        seq_steps = 300 if args.smoke else 3000 if args.quick else 10_000
        seq = synthetic_stream(77, slowdown=None, steps=seq_steps, surges=seq_steps // 100)
    seq_alarms = run_detectors(seq)
    n_steps = len(seq.steps)
    # One alarm event per step, however many machines it names (NVRx flags each straggler).
    per_10k = {k: len({a.step for a in v}) * 10_000 / n_steps for k, v in seq_alarms.items()}
    durations = np.array([s[0].duration_s for s in seq.steps])
    mape = predictor_mape(seq)

    print(f"\nfail-slow detection ({source} streams, 8 nodes x 8 GPUs, {n} scenarios per size; "
          f"detected = right node within {WITHIN_STEPS} steps of onset)\n")
    print(f"{'slowdown':>8} {'detector':>10} {'detected':>9} {'steps':>6} {'localised':>9} {'false':>6}")
    for size, res in by_size.items():
        for name, r in res.items():
            print(f"{size:>8} {name:>10} {r['detect_rate']:>9.1%} {r['steps_to_detect_median']:>6.0f} "
                  f"{r['localisation']:>9.1%} {r['false_alarms']:>6.0f}")
    results = [*by_size.values(), healthy_score]
    false_total = {name: sum(r[name]["false_alarms"] for r in results) for name in healthy_score}
    hours = sum(r["faultlens"]["healthy_hours"] for r in results)
    fa_rate = {name: 1000.0 * false_total[name] / hours for name in false_total}
    print(f"\nfalse alarms per 1,000 job-hours over {hours:.1f} healthy job-hours ({len(healthy)} healthy runs "
          "plus the pre-onset part of every fault run):")
    for name in fa_rate:
        print(f"  {name:>10}: {fa_rate[name]:8.1f}  ({false_total[name]:.0f} alarms)")
    print(f"\nsequence-length variability: {n_steps} steps, step time {durations.min():.2f}-{durations.max():.2f} s "
          f"(median {np.median(durations):.2f}); false alarms per 10,000 steps:")
    for name, v in per_10k.items():
        print(f"  {name:>10}: {v:.2f}")
    print(f"\nstep-time predictor on healthy steps: mean abs error {mape:.2%} per rank-iteration")
    print(f"elapsed {time.monotonic() - started:.0f} s")
    ours = {s: by_size[s]["faultlens"] for s in by_size}
    def clean(v: object) -> object:
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        return None if isinstance(v, float) and math.isnan(v) else v

    print(json.dumps(clean({
        "bench": "failslow", "source": source, "scenarios_per_size": n,
        "detect_rate": {s: round(v["detect_rate"], 4) for s, v in ours.items()},
        "steps_to_detect_median": {s: v["steps_to_detect_median"] for s, v in ours.items()},
        "localisation": {s: round(v["localisation"], 4) for s, v in ours.items()},
        "naive_detect_rate": {s: round(by_size[s]["naive"]["detect_rate"], 4) for s in by_size},
        "nvrx_detect_rate": {s: round(by_size[s]["nvrx"]["detect_rate"], 4) for s in by_size},
        "false_alarms_per_1000_job_h": {k: round(v, 2) for k, v in fa_rate.items()},
        "seq_var_false_alarms_per_10k_steps": {k: round(v, 2) for k, v in per_10k.items()},
        "predictor_mape": round(mape, 4),
    })))
    return 0


if __name__ == "__main__":
    sys.exit(main())
