"""Peer comparison of machines in one job (Minder's idea, without the VAE).

Data, tensor and pipeline parallelism balance load, so the healthy machines of
one job draw near-identical NVML curves; the machine that stays apart from its
peers is the suspect, whatever its fault. Every ``window_s`` each GPU's mean
utilisation, power, SM clock, temperature and throttle-time share are compared
with all GPUs of the job's other machines by robust z-score (median and MAD,
with a floor so that identical healthy peers do not turn noise into infinity);
a machine's score per feature is that of its most extreme GPU. A machine is
flagged only when it stays beyond ``z_threshold`` for ``continuity_s`` (Minder:
real faults persist; most last over 5 minutes, so one odd window is not enough).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from faultlens.models.params import load_params
from faultlens.schema import Finding, GpuSample
from faultlens.stream.topology import Topology
from faultlens.vocabulary import Category

PEER_FEATURES = ("util", "power_w", "sm_clock_mhz", "temp_c", "throttle_share")
# NVML clocks-event reasons that mean the GPU is being held back (not idle/app-clock bits):
# HW slowdown 0x8, SW thermal 0x20, HW thermal 0x40, HW power brake 0x80.
THROTTLE_BAD_BITS = 0x8 | 0x20 | 0x40 | 0x80
# Absolute MAD floors, in each feature's unit.
_ABS_FLOOR = {"util": 2.0, "power_w": 10.0, "sm_clock_mhz": 20.0, "temp_c": 2.0, "throttle_share": 0.05}
_CATEGORY = {"temp_c": Category.THERMAL_POWER, "throttle_share": Category.THERMAL_POWER,
             "sm_clock_mhz": Category.THERMAL_POWER, "power_w": Category.THERMAL_POWER, "util": Category.UNKNOWN}


@dataclass(frozen=True)
class PeerParams:
    window_s: float = 30.0
    z_threshold: float = 6.0
    continuity_s: float = 240.0
    min_peers: int = 4
    rel_floor: float = 0.02

    @classmethod
    def from_catalog(cls, path: str | None = None) -> PeerParams:
        return cls(**load_params("peer", cls, path))


def robust_z(values: np.ndarray, *, rel_floor: float, abs_floor: float) -> np.ndarray:
    """(x - median) / max(1.4826 MAD, rel_floor*|median|, abs_floor)."""
    med = float(np.median(values))
    mad = 1.4826 * float(np.median(np.abs(values - med)))
    scale = max(mad, rel_floor * abs(med), abs_floor)
    return (values - med) / scale


@dataclass
class _Acc:
    """Running sums of one node's GPU readings within the open window.

    Plain Python floats, one list of ``len(PEER_FEATURES)`` per GPU, added in arrival
    order: building a numpy array per GPU per sample cost ~5 s of CPU on a one-hour
    1,024-GPU run, while the arrays are needed only once, when the window closes.
    """

    sums: dict[int, list[float]] = field(default_factory=dict)  # gpu index -> per-feature sums
    counts: dict[int, int] = field(default_factory=dict)


class PeerDetector:
    """Flags the machine whose GPUs stay apart from the job's other machines."""

    name = "peer"

    def __init__(self, params: PeerParams | None = None) -> None:
        self.params = params or PeerParams.from_catalog()
        self._node_job: dict[str, str] = {}
        self._window: int | None = None
        self._acc: dict[str, dict[str, _Acc]] = defaultdict(dict)  # job -> node -> acc
        self._apart: dict[tuple[str, str], int] = {}  # (job, node) -> consecutive apart windows
        self._reported: set[tuple[str, str]] = set()
        self.last_scores: dict[str, dict[str, dict[str, float]]] = {}  # job -> node -> feature -> z

    def set_topology(self, topology: Topology) -> None:
        for node in topology.nodes:
            self._node_job[node] = topology.job

    def observe(self, record: object) -> list[Finding]:
        if not isinstance(record, GpuSample):
            return []
        w = math.floor(record.ts / self.params.window_s)
        out: list[Finding] = []
        if self._window is not None and w > self._window:
            out = self._close(self._window)
        if self._window is None or w > self._window:
            self._window = w
        elif w < self._window:
            return out  # late sample for a window already scored
        job = record.job or self._node_job.get(record.node, "")
        acc = self._acc[job].get(record.node)
        if acc is None:
            acc = self._acc[job][record.node] = _Acc()
        sums, counts = acc.sums, acc.counts
        for g in record.gpus:
            util, power, clock, temp = g.util, g.power_w, g.sm_clock_mhz, g.temp_c
            if g.lost or util is None or power is None or clock is None or temp is None:
                continue  # a gauge NVML could not give (null): this reading is not compared, never guessed
            throttled = 1.0 if (g.throttle_reasons or 0) & THROTTLE_BAD_BITS else 0.0
            s = sums.get(g.index)
            if s is None:
                sums[g.index] = [float(util), float(power), float(clock), float(temp), throttled]
                counts[g.index] = 1
            else:  # the same float64 additions, in the same order, that numpy's += made
                s[0] += util
                s[1] += power
                s[2] += clock
                s[3] += temp
                s[4] += throttled
                counts[g.index] += 1
        return out

    def tick(self, now: float) -> list[Finding]:
        if self._window is not None and now >= (self._window + 2) * self.params.window_s:
            out = self._close(self._window)
            self._window = None
            return out
        return []

    def _close(self, window: int) -> list[Finding]:
        out: list[Finding] = []
        end_ts = (window + 1) * self.params.window_s
        for job, nodes in self._acc.items():
            out += self._score(job, nodes, end_ts)
        self._acc = defaultdict(dict)
        return out

    def _score(self, job: str, nodes: dict[str, _Acc], end_ts: float) -> list[Finding]:
        p = self.params
        if len(nodes) < p.min_peers:
            return []
        names, gpu_node, sums, counts = [], [], [], []
        for node in sorted(nodes):
            acc = nodes[node]
            if not acc.sums:
                continue  # every GPU of the machine lost: nothing to compare
            names.append(node)
            for gpu in sorted(acc.sums):
                gpu_node.append((node, gpu))
                sums.append(acc.sums[gpu])
                counts.append(acc.counts[gpu])
        if not sums:
            return []
        M = np.array(sums, dtype=float) / np.array(counts, dtype=float)[:, None]
        Z = np.column_stack([robust_z(M[:, j], rel_floor=p.rel_floor, abs_floor=_ABS_FLOOR[f])
                             for j, f in enumerate(PEER_FEATURES)])
        scores: dict[str, dict[str, float]] = {}
        worst_gpu: dict[str, dict[str, int]] = {}
        for (node, gpu), z in zip(gpu_node, Z, strict=True):
            s = scores.setdefault(node, dict.fromkeys(PEER_FEATURES, 0.0))
            wg = worst_gpu.setdefault(node, {})
            for f, v in zip(PEER_FEATURES, z, strict=True):
                if abs(v) > abs(s[f]):
                    s[f] = float(v)
                    wg[f] = gpu
        self.last_scores[job] = scores
        out = []
        need = max(1, math.ceil(p.continuity_s / p.window_s))
        for node in names:
            key = (job, node)
            top = max(PEER_FEATURES, key=lambda f: abs(scores[node][f]))
            if abs(scores[node][top]) < p.z_threshold:
                self._apart.pop(key, None)
                self._reported.discard(key)
                continue
            self._apart[key] = self._apart.get(key, 0) + 1
            if self._apart[key] < need or key in self._reported:
                continue
            self._reported.add(key)
            worst = worst_gpu[node].get(top)
            apart = {f: round(v, 2) for f, v in scores[node].items() if abs(v) >= p.z_threshold}
            out.append(Finding(
                ts=end_ts, kind="peer_outlier", category=_CATEGORY[top], severity="warning",
                action="run_diagnostics", confidence=0.6, source="model:peer", rule="peer.robust_z",
                text=(f"{node} GPU {worst}: {top} apart from its {len(names) - 1} peer machines "
                      f"(robust z {scores[node][top]:+.1f}) for {self._apart[key]} windows "
                      f"({self._apart[key] * p.window_s:.0f} s)"),
                node=node, job=job or None, gpu=worst,
                figures={"feature": top, "z": round(scores[node][top], 2), "apart": apart,
                         "windows": self._apart[key], "apart_s": self._apart[key] * p.window_s,
                         "peers": len(names) - 1}))
        return out
