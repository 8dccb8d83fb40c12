"""Windowed per-machine features, shared by training and online scoring.

One row per machine per window, in the order of ``FEATURES``. Training
(``faultlens train``) and the online ``ClassifierDetector`` build rows with the
same ``WindowFeatures`` object, so a model can never see features computed two
ways. ``FEATURE_SET_VERSION`` changes whenever a feature is added, removed,
renamed or computed differently; a saved model records it and refuses to load
under another version (``FeatureMismatch``).

Groups of features:

* NVML counter deltas over the window (cumulative counters, as NVML reports
  them): ECC DBE/SBE, retired pages, row-remap flags, PCIe replays, NVLink
  errors; GPU lost; throttle time share (thermal / power); temperature, clock,
  power and utilisation extremes, and the machine's robust z-scores against its
  peers (models/peer.py).
* Kernel and NCCL record counts by kind (models/catalogs/event_features.toml).
* Step statistics: the machine's worst workload-normalised compute ratio
  (models/predictor.py), its wait share and step lag, the share of its step
  reports whose loss was lost (NaN/null); and job-wide context every machine's
  row carries (job median ratio, overhead share beyond baseline, effective sequence length
  ratio, NaN share, share of machines with Python exceptions, progress: steps in
  the window against the job's usual pace), because job-wide faults look the
  same on every machine.

Counts and magnitudes that grow with the job (steps per window, ranks per
machine) are given as shares or ratios against the job's own history: a model
trained on small clusters then reads a large one's rows on the same scale.

v2: ``nan_loss_steps`` (a count) became ``nan_loss_share``, ``job_steps`` (a
count) became ``job_progress``; kernel lines of container veth interfaces no
longer count as IB link events (``exclude`` in the event catalog).

v4: a storage server's recovery line ("nfs: server X OK") no longer counts as a
storage error but as ``storage_recovered``; ``storage_open`` says the machine's
latest storage line is an error with no recovery after it (the stall is still on);
``job_overhead_share``, the share of the job's median step that is overhead
beyond the job's own baseline, replaces ``job_overhead_ratio`` (which divided by
that baseline: tiny on some jobs, so step-time noise alone moved it by a third on
the held-out family's slow steps, and healthy windows read as slow storage).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from faultlens.config import read_catalog
from faultlens.errors import CatalogError
from faultlens.models.peer import _ABS_FLOOR, robust_z
from faultlens.models.predictor import JobStepPredictor
from faultlens.schema import GpuSample, KernelEvent, NcclEvent, StepTiming
from faultlens.stream.topology import Topology

FEATURE_SET_VERSION = 4
EVENT_CATALOG = Path(__file__).resolve().parent / "catalogs" / "event_features.toml"

NVML_FEATURES = (
    "ecc_dbe_delta", "ecc_sbe_delta", "retired_pages_delta", "ecc_dbe_total", "retired_pages_total", "remap_pending", "remap_failure",
    "pcie_replay_delta", "nvlink_errors_delta", "gpu_lost", "gpu_missing",
    "throttle_thermal_share", "throttle_power_share", "temp_max_c", "clock_min_ratio", "power_min_ratio",
    "util_min", "z_temp", "z_clock", "z_power", "z_util",
)
XID_FEATURES = ("xid_gpu_lost", "xid_ecc", "xid_remap", "xid_nvlink", "xid_other")
KERNEL_FEATURES = ("gpu_fell_off_bus", "pcie_aer", "ib_link_down", "ib_link_up", "oom_kill", "hung_task",
                   "storage_error", "storage_recovered", "edac", "sxid")
DERIVED_KERNEL_FEATURES = ("storage_open",)
NCCL_FEATURES = ("nccl_timeout", "nccl_ib_error", "py_exception", "nccl_warn", "timeout_silent_ranks")
STEP_FEATURES = (
    "step_ratio_max", "step_ratio_node_median", "wait_share", "step_lag", "nan_loss_share",
    "job_step_ratio", "job_overhead_share", "job_len_ratio", "job_nan_share",
    "job_exception_share", "job_progress",
)
FEATURES: tuple[str, ...] = (NVML_FEATURES + XID_FEATURES + KERNEL_FEATURES + DERIVED_KERNEL_FEATURES + NCCL_FEATURES
                             + STEP_FEATURES)
# A machine with no data of a group in the window reads as "nothing unusual".
_NEUTRAL = {f: 1.0 for f in ("clock_min_ratio", "power_min_ratio", "step_ratio_max", "step_ratio_node_median",
                             "job_step_ratio", "job_len_ratio")}


@dataclass(frozen=True)
class _Rule:
    feature: str
    kinds: frozenset[str]
    pattern: re.Pattern[str] | None
    exclude: re.Pattern[str] | None = None  # raw text that this rule never takes, even of its kinds


def load_event_catalog(path: str | Path | None = None) -> tuple[dict[int, str], dict[str, list[_Rule]]]:
    """(xid code -> feature, source -> ordered rules); a bad entry names file and entry."""
    file = Path(path) if path else EVENT_CATALOG
    data = read_catalog(file)
    xid: dict[int, str] = {}
    for feature, codes in data.get("xid", {}).items():
        if feature not in XID_FEATURES:
            raise CatalogError(f"unknown feature; known: {', '.join(XID_FEATURES)}", file=str(file), entry=f"xid.{feature}")
        for code in codes:
            xid[int(code)] = feature
    rules: dict[str, list[_Rule]] = {}
    for source, known in (("kernel", KERNEL_FEATURES), ("nccl", NCCL_FEATURES)):
        for i, entry in enumerate(data.get(source, [])):
            where = f"{source}[{i}] {entry.get('feature', '?')}"
            if entry.get("feature") not in known:
                raise CatalogError(f"unknown feature; known: {', '.join(known)}", file=str(file), entry=where)
            try:
                pattern = re.compile(entry["pattern"]) if entry.get("pattern") else None
                exclude = re.compile(entry["exclude"]) if entry.get("exclude") else None
            except re.error as exc:
                raise CatalogError(f"bad pattern: {exc}", file=str(file), entry=where) from None
            rules.setdefault(source, []).append(
                _Rule(entry["feature"], frozenset(entry.get("kinds", [])), pattern, exclude))
    return xid, rules


_PER_RANK_FEATURES = ("nccl_timeout", "nccl_ib_error", "py_exception", "nccl_warn", "timeout_silent_ranks")
_DELTA_FEATURES = ("ecc_dbe_delta", "ecc_sbe_delta", "retired_pages_delta", "pcie_replay_delta", "nvlink_errors_delta")
# NVML clocks-event reasons: thermal (SW 0x20, HW 0x40, HW slowdown 0x8) and power (SW cap 0x4, HW brake 0x80).
_THERMAL_BITS = 0x20 | 0x40 | 0x8
_POWER_BITS = 0x4 | 0x80


def _median(values: list[float]) -> float:
    """np.median of a short list of floats, without an array."""
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2.0


def _counters(g: Any) -> tuple[float, float, float, float, float]:
    """The cumulative error counters of one GPU reading, in ``_DELTA_FEATURES`` order."""
    def num(v: float | None) -> float:
        return math.nan if v is None else float(v)  # null (unknown): NaN compares false, so no delta and no max

    nvlink = sum(num(v) for v in (g.nvlink_errors, g.nvlink_crc_errors, g.nvlink_replay_errors, g.nvlink_recovery_errors))
    return (num(g.ecc_dbe), num(g.ecc_sbe), num(g.retired_pages), num(g.pcie_replay), nvlink)


class WindowFeatures:
    """Stateful per-window feature extraction for the machines of jobs.

    Call ``window(records, start_ts, end_ts)`` once per consecutive window; it
    keeps counter baselines and the step-time model across windows.
    """

    def __init__(self, *, catalog: str | Path | None = None, lookback_s: float = 900.0, seed: int = 0) -> None:
        self._xid, self._rules = load_event_catalog(catalog)
        # Event counts cover the trailing lookback, not just the window: an Xid line is
        # one record, but the machine it names stays faulty after the window it fell in.
        self.lookback_s = lookback_s
        self._events: deque[tuple[float, str, str]] = deque()
        self._timeouts: deque[tuple[float, str, int]] = deque()  # (ts, job, rank) of watchdog timeouts
        self._loss_ranks: set[tuple[str, int]] = set()
        self._topologies: dict[str, Topology] = {}
        self._last_counters: dict[tuple[str, int], tuple[float, ...]] = {}
        self._gpus_seen: dict[str, int] = {}
        self._predictors: dict[str, JobStepPredictor] = {}
        self._overhead_base: dict[str, list[float]] = defaultdict(list)
        self._len_base: dict[str, list[float]] = defaultdict(list)
        self._steps_base: dict[str, list[int]] = defaultdict(list)  # steps per window of a job's first windows
        self._seed = seed

    def set_topology(self, topology: Topology) -> None:
        self._topologies[topology.job] = topology

    def event_feature(self, rec: KernelEvent | NcclEvent) -> str | None:
        """The count feature a kernel/NCCL record belongs to, or None."""
        if isinstance(rec, KernelEvent) and (rec.xid is not None or rec.kind == "xid"):
            if rec.xid is not None:
                return self._xid.get(rec.xid, "xid_other")
        source = "kernel" if isinstance(rec, KernelEvent) else "nccl"
        text = rec.raw or rec.message
        for rule in self._rules.get(source, []):
            if rec.kind in rule.kinds and not (rule.exclude is not None and rule.exclude.search(text)):
                return rule.feature
        for rule in self._rules.get(source, []):
            if rule.pattern is not None and rule.pattern.search(text) and not (
                    rule.exclude is not None and rule.exclude.search(text)):
                return rule.feature
        if isinstance(rec, NcclEvent) and rec.exception:
            return "py_exception"
        return None

    def window(self, records: Iterable[Any], nodes: Iterable[str] = (),
               end_ts: float | None = None) -> dict[str, dict[str, float]]:
        """Feature rows (node -> feature -> value) of one window's records (ending at ``end_ts``)."""
        rows: dict[str, dict[str, float]] = {}

        def row(node: str) -> dict[str, float]:
            r = rows.get(node)
            if r is None:
                r = rows[node] = dict.fromkeys(FEATURES, 0.0) | _NEUTRAL
            return r

        for n in nodes:
            row(n)
        gpu_recs: list[GpuSample] = []
        steps: dict[tuple[str, int], list[StepTiming]] = defaultdict(list)
        for rec in records:
            if isinstance(rec, GpuSample):
                gpu_recs.append(rec)
            elif isinstance(rec, StepTiming):
                steps[(rec.job, rec.step)].append(rec)
            elif isinstance(rec, (KernelEvent, NcclEvent)):
                f = self.event_feature(rec)
                if f is not None:
                    self._events.append((rec.ts, rec.node, f))
                    row(rec.node)
                if f == "nccl_timeout" and rec.rank is not None:
                    self._timeouts.append((rec.ts, getattr(rec, "job", None) or "", rec.rank))
        if end_ts is None:
            end_ts = max((e[0] for e in self._events), default=0.0)
        while self._events and self._events[0][0] < end_ts - self.lookback_s:
            self._events.popleft()
        while self._timeouts and self._timeouts[0][0] < end_ts - self.lookback_s:
            self._timeouts.popleft()
        self._silent(row, end_ts)
        last_storage: dict[str, tuple[float, str]] = {}
        for ts, node, f in self._events:
            if ts < end_ts:
                row(node)[f] += 1.0
                if f in ("storage_error", "storage_recovered") and ts >= last_storage.get(node, (-math.inf, ""))[0]:
                    last_storage[node] = (ts, f)
        for node, (_, f) in last_storage.items():
            row(node)["storage_open"] = 1.0 if f == "storage_error" else 0.0
        self._per_rank(rows)
        self._gpu(gpu_recs, row)
        self._steps(steps, row, rows)
        return rows

    def _per_rank(self, rows: dict[str, dict[str, float]]) -> None:
        """Per-rank NCCL/torch line counts: every rank of a node prints its own watchdog line and
        traceback, so raw counts grow with the GPUs a node has (8 here, 4 there); rates per rank do not."""
        if not self._topologies:
            return
        per_node: dict[str, int] = defaultdict(int)
        for topo in self._topologies.values():
            for node, _ in topo.placement.values():
                per_node[node] += 1
        for node, r in rows.items():
            n = per_node.get(node)
            if n:
                for f in _PER_RANK_FEATURES:
                    if r[f]:
                        r[f] /= n

    def _silent(self, row: Any, end_ts: float) -> None:
        """Ranks that stayed silent while most of their job's ranks hit the collective timeout.

        In a hang the healthy ranks wait in a collective and time out; the rank that
        holds them up is busy elsewhere (or dead) and does not.
        """
        timed_out: dict[str, set[int]] = defaultdict(set)
        for ts, job, rank in self._timeouts:
            if ts < end_ts:
                timed_out[job].add(rank)
        for job, ranks in timed_out.items():
            topo = self._topologies.get(job) or (next(iter(self._topologies.values()))
                                                 if len(self._topologies) == 1 else None)
            if topo is None or len(ranks) * 2 < topo.world_size:
                continue
            for rank, (node, _) in topo.placement.items():
                if rank not in ranks:
                    row(node)["timeout_silent_ranks"] += 1.0

    # ---- NVML
    def _gpu(self, recs: list[GpuSample], row: Any) -> None:
        # One pass in plain Python floats: per GPU its first and last reading (cumulative
        # counters) and running sums of the gauges; arrays only for the peer comparison.
        # (A numpy row per GPU per sample cost ~3x the whole window's budget at 1,024 GPUs.)
        recs.sort(key=lambda r: r.ts)
        acc: dict[str, dict[int, list[Any]]] = {}  # node -> gpu -> [first, last, n, util, power, clock, temp, thermal, power cap]
        flags: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        lost: dict[str, set[int]] = defaultdict(set)
        samples: dict[str, int] = defaultdict(int)
        for rec in recs:
            node = rec.node
            samples[node] += 1
            gpus = acc.get(node)
            if gpus is None:
                gpus = acc[node] = {}
            for g in rec.gpus:
                if g.lost:
                    flags[node]["gpu_lost"] = 1.0
                    lost[node].add(g.index)
                    continue
                tr = g.throttle_reasons or 0
                a = gpus.get(g.index)
                if a is None:
                    a = gpus[g.index] = [g, g, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
                a[1] = g
                util, power, clock, temp = g.util, g.power_w, g.sm_clock_mhz, g.temp_c
                # A gauge NVML could not give is null: the reading's counters count, its gauges do not.
                if util is not None and power is not None and clock is not None and temp is not None:
                    a[2] += 1
                    a[3] += util
                    a[4] += power
                    a[5] += clock
                    a[6] += temp
                    if tr & _THERMAL_BITS:
                        a[7] += 1.0
                    if tr & _POWER_BITS:
                        a[8] += 1.0
                if g.remap_pending:
                    flags[node]["remap_pending"] = 1.0
                if g.remap_failure:
                    flags[node]["remap_failure"] = 1.0
        means: dict[tuple[str, int], list[float]] = {}
        for node, gpus in acc.items():
            if not gpus:
                continue
            r = row(node)
            for index, a in gpus.items():
                key = (node, index)
                last = _counters(a[1])
                prev = self._last_counters.get(key) or _counters(a[0])
                self._last_counters[key] = last
                r["ecc_dbe_total"] = max(r["ecc_dbe_total"], last[0])  # cumulative: persists
                r["retired_pages_total"] = max(r["retired_pages_total"], last[2])
                for fname, now, before in zip(_DELTA_FEATURES, last, prev, strict=True):
                    if now > before:
                        r[fname] += now - before
                n = a[2]
                if n:
                    means[key] = [a[3] / n, a[4] / n, a[5] / n, a[6] / n, a[7] / n, a[8] / n]
        for node, fl in flags.items():
            for k, v in fl.items():
                row(node)[k] = v
        for node, gpus in acc.items():
            seen = len(gpus.keys() | lost[node]) if node in lost else len(gpus)
            self._gpus_seen[node] = max(self._gpus_seen.get(node, 0), seen)
        for node, n in self._gpus_seen.items():
            if samples.get(node, 0) == 0:
                row(node)["gpu_missing"] = float(n)  # the machine sent no NVML sample at all
        if not means:
            return
        keys = sorted(means)
        A = np.array([means[k] for k in keys])  # util, power, clock, temp, thermal share, power share
        med = np.median(A, axis=0)
        z = {}
        for j, (fname, floor) in enumerate((("z_util", _ABS_FLOOR["util"]), ("z_power", _ABS_FLOOR["power_w"]),
                                             ("z_clock", _ABS_FLOOR["sm_clock_mhz"]), ("z_temp", _ABS_FLOOR["temp_c"]))):
            z[fname] = robust_z(A[:, j], rel_floor=0.02, abs_floor=floor) if len(keys) >= 8 else np.zeros(len(keys))
        by_node: dict[str, list[int]] = defaultdict(list)
        for i, (node, _) in enumerate(keys):
            by_node[node].append(i)
        for node, idx in by_node.items():
            r = row(node)
            sub = A[idx]
            r["throttle_thermal_share"] = float(sub[:, 4].max())
            r["throttle_power_share"] = float(sub[:, 5].max())
            r["temp_max_c"] = float(sub[:, 3].max())
            r["clock_min_ratio"] = float(sub[:, 2].min() / med[2]) if med[2] > 0 else 1.0
            r["power_min_ratio"] = float(sub[:, 1].min() / med[1]) if med[1] > 0 else 1.0
            r["util_min"] = float(sub[:, 0].min())
            for fname, zz in z.items():
                vals = zz[idx]
                r[fname] = float(vals[np.argmax(np.abs(vals))])

    # ---- steps
    def _steps(self, steps: dict[tuple[str, int], list[StepTiming]], row: Any,
               rows: dict[str, dict[str, float]]) -> None:
        by_job: dict[str, list[int]] = {job: [] for job in self._topologies}
        for job, step in steps:
            by_job.setdefault(job, []).append(step)
        for job, step_ids in by_job.items():
            pred = self._predictors.get(job)
            if pred is None:
                pred = self._predictors[job] = JobStepPredictor(topology=self._topologies.get(job), seed=self._seed)
            node_ratios: dict[str, list[float]] = defaultdict(list)
            rank_ratios: dict[int, list[float]] = defaultdict(list)
            node_wait: dict[str, list[float]] = defaultdict(list)
            node_step: dict[str, int] = {}
            node_nan: dict[str, int] = defaultdict(int)
            node_recs: dict[str, int] = defaultdict(int)
            overheads, durations, lens, all_ratios = [], [], [], []
            nan_steps = 0
            exceptions = 0
            rank_node: dict[int, str] = {}
            loss_ranks = self._loss_ranks
            for step in sorted(step_ids):
                recs = steps[(job, step)]
                res = pred.observe_step(recs)
                dur = float(np.median(res.duration_s))
                overheads.append(dur - float(res.compute_s.max()))
                durations.append(dur)
                tok = sum((r.tokens or r.sum_len) for r in recs)
                lens.append(sum(r.sum_len_sq for r in recs) / max(tok, 1))
                step_nan = False
                for rec in recs:
                    node = rec.node
                    if rec.step > node_step.get(node, -1):
                        node_step[node] = rec.step
                    node_recs[node] += 1
                    if rec.duration_s > 0:
                        node_wait[node].append((rec.comm_s or 0.0) / rec.duration_s)
                    # JSON has no NaN: a rank that used to report its loss and now sends null
                    # (or a non-finite number) has lost it.
                    if rec.loss is not None and math.isfinite(rec.loss):
                        loss_ranks.add((job, rec.rank))
                    elif rec.loss is not None or (job, rec.rank) in loss_ranks:
                        node_nan[node] += 1
                        step_nan = True
                nan_steps += step_nan
                if res.ready:
                    for rank, node, ratio in zip(res.ranks.tolist(), res.nodes, res.ratio.tolist(), strict=True):
                        if math.isfinite(ratio):
                            rank_ratios[rank].append(ratio)
                            node_ratios[node].append(ratio)
                            all_ratios.append(ratio)
                            rank_node[rank] = node
            ob, lb = self._overhead_base[job], self._len_base[job]
            if len(ob) < 20:
                ob.extend(overheads[: 20 - len(ob)])
                lb.extend(lens[: 20 - len(lb)])
            base_over = float(np.median(ob)) if ob else 0.0
            base_len = float(np.median(lb)) if lb else 0.0
            job_ratio = float(np.median(all_ratios)) if all_ratios else 1.0
            med_dur = float(np.median(durations)) if durations else 0.0
            over_share = max(0.0, float(np.median(overheads)) - base_over) / med_dur if med_dur > 0 else 0.0
            len_ratio = float(np.median(lens)) / base_len if lens and base_len > 0 else 1.0
            # Progress against the job's own pace (steps per window differ by orders of magnitude
            # between jobs and cluster sizes; a stall or a slowdown is a share of the usual).
            sb = self._steps_base[job]
            progress = (len(step_ids) / float(np.median(sb)) if sb else float(bool(step_ids)))
            if step_ids and len(sb) < 10:
                sb.append(len(step_ids))
            topo = self._topologies.get(job)
            job_nodes = set(topo.nodes) if topo else set(node_step)
            for node in job_nodes:
                row(node)
            for node in job_nodes:
                if rows[node]["py_exception"] > 0:
                    exceptions += 1
            max_step = max(step_ids, default=0)
            worst_rank: dict[str, float] = {}  # node -> its worst rank's median ratio
            for rank, v in rank_ratios.items():
                m = _median(v)
                node = rank_node[rank]
                if m > worst_rank.get(node, -math.inf):
                    worst_rank[node] = m
            for node in job_nodes:
                r = rows[node]
                r["step_ratio_max"] = worst_rank.get(node, 1.0)
                r["step_ratio_node_median"] = float(np.median(node_ratios[node])) if node_ratios.get(node) else 1.0
                r["wait_share"] = float(np.median(node_wait[node])) if node_wait.get(node) else 0.0
                r["step_lag"] = float(max_step - node_step.get(node, min(step_ids, default=1) - 1))
                r["nan_loss_share"] = node_nan.get(node, 0) / node_recs[node] if node_recs.get(node) else 0.0
                r["job_step_ratio"] = job_ratio
                r["job_overhead_share"] = over_share
                r["job_len_ratio"] = len_ratio
                r["job_nan_share"] = nan_steps / max(len(step_ids), 1)
                r["job_exception_share"] = exceptions / max(len(job_nodes), 1)
                r["job_progress"] = progress
