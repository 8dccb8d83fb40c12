"""Training rows for the fault classifier: one per machine per window, labelled.

Two label sources, one row builder (``features.WindowFeatures``, the same code
that scores online):

* ``scenario_rows``: a simulator scenario's records with its truth.json
  (``classifier.window_label``);
* ``incident_rows``: labelled incidents from the lake (``root_cause`` set by a
  person in the explorer): the windows of the incident's job around its
  opening, its suspects labelled with the root cause, the other machines
  healthy.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from faultlens.models.classifier import HEALTHY, window_label
from faultlens.models.features import FEATURES, WindowFeatures
from faultlens.stream.schema import StepTiming
from faultlens.stream.topology import Topology


@dataclass
class Rows:
    """Feature rows with labels; ``groups`` names the scenario each row came from.

    ``left_out`` counts, per fault kind, the machine-windows no label can be right
    for (catalogs/labels.toml: the fault's evidence is not in the window, or shows
    outside the fault); they are neither trained on nor in ``arrays()``. Every row
    also keeps its strict label (truth's onset and time coverage alone, no
    evidence rule): ``arrays(strict=True)`` gives all rows with those, so that a
    benchmark can show both.
    """

    X: dict[str, list[float]] = field(default_factory=lambda: {f: [] for f in FEATURES})
    y: list[str] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    y_strict: list[str] = field(default_factory=list)
    left_out: Counter[str] = field(default_factory=Counter)
    left_out_X: dict[str, list[float]] = field(default_factory=lambda: {f: [] for f in FEATURES})
    left_out_strict: list[str] = field(default_factory=list)

    def add(self, row: dict[str, float], label: str | None, group: str, strict: str | None = None,
            kind: str = "?") -> None:
        """One machine-window; ``label`` None leaves it out (counted under ``kind``)."""
        if label is None:
            for f in FEATURES:
                self.left_out_X[f].append(row[f])
            self.left_out_strict.append(strict or HEALTHY)
            self.left_out[kind] += 1
            return
        for f in FEATURES:
            self.X[f].append(row[f])
        self.y.append(label)
        self.groups.append(group)
        self.y_strict.append(strict or label)

    def extend(self, other: Rows) -> None:
        for f in FEATURES:
            self.X[f].extend(other.X[f])
            self.left_out_X[f].extend(other.left_out_X[f])
        self.y.extend(other.y)
        self.groups.extend(other.groups)
        self.y_strict.extend(other.y_strict)
        self.left_out.update(other.left_out)
        self.left_out_strict.extend(other.left_out_strict)

    def arrays(self, *, strict: bool = False) -> tuple[dict[str, np.ndarray], np.ndarray]:
        if strict:
            return ({f: np.asarray(v + self.left_out_X[f], dtype=float) for f, v in self.X.items()},
                    np.asarray(self.y_strict + self.left_out_strict))
        return {f: np.asarray(v, dtype=float) for f, v in self.X.items()}, np.asarray(self.y)

    def __len__(self) -> int:
        return len(self.y)


def windows(records: Iterable[Any], start_ts: float, end_ts: float, window_s: float) -> Iterable[tuple[float, list]]:
    """(window start, records in it) for consecutive windows of [start_ts, end_ts)."""
    recs = sorted((r for r in records if getattr(r, "ts", None) is not None), key=lambda r: r.ts)
    n = max(1, math.ceil((end_ts - start_ts) / window_s))
    i = 0
    for k in range(n):
        lo, hi = start_ts + k * window_s, start_ts + (k + 1) * window_s
        chunk = []
        while i < len(recs) and recs[i].ts < hi:
            if recs[i].ts >= lo:
                chunk.append(recs[i])
            i += 1
        yield lo, chunk


def scenario_rows(records: Iterable[Any], topology: Topology, truth: dict[str, Any], *,
                  window_s: float = 60.0, seed: int = 0) -> Rows:
    """Labelled rows of one scenario (records + truth.json)."""
    wf = WindowFeatures(seed=seed)
    wf.set_topology(topology)
    start = float(truth["start_ts"])
    end = start + float(truth["duration_s"])
    rows = Rows()
    group = f"{truth.get('scenario', '?')}:{truth.get('seed', '?')}"
    kind = "/".join(sorted({f["kind"] for f in truth.get("faults", [])})) or HEALTHY
    for lo, chunk in windows(records, start, end, window_s):
        feats = wf.window(chunk, topology.nodes, end_ts=lo + window_s)
        starts = step_starts(chunk, topology.job or None)
        for node in sorted(feats):
            label = window_label(truth, node, lo, lo + window_s, linger_s=wf.lookback_s, row=feats[node],
                                 step_starts=starts)
            strict = window_label(truth, node, lo, lo + window_s, linger_s=wf.lookback_s)
            rows.add(feats[node], label, group, strict, kind)
    return rows


def step_starts(records: Iterable[Any], job: str | None) -> list[float]:
    """When each of the job's steps (any job's: None) that ended in ``records`` started.

    A step belongs to what was going on when it started: its batch (long sequences)
    was drawn then.
    """
    starts: dict[int, float] = {}
    for r in records:
        if isinstance(r, StepTiming) and (job is None or r.job == job):
            t = r.ts - r.duration_s
            if r.step not in starts or t < starts[r.step]:
                starts[r.step] = t
    return sorted(starts.values())


def incident_rows(records: Iterable[Any], topology: Topology, incident: dict[str, Any], *,
                  window_s: float = 60.0, before_s: float = 600.0, after_s: float = 300.0) -> Rows:
    """Rows around a labelled incident: suspects carry ``root_cause`` from its opening on."""
    label = str(incident["root_cause"])
    opened = float(incident["opened_ts"])
    suspects = {s.get("node") for s in incident.get("suspects") or [] if isinstance(s, dict)}
    truth = {"start_ts": opened - before_s, "duration_s": before_s + after_s, "scenario": incident.get("id"),
             "faults": [{"kind": label, "nodes": sorted(n for n in suspects if n), "onset_ts": opened,
                         "end_ts": None}] if label != HEALTHY else []}
    return scenario_rows(records, topology, truth, window_s=window_s)
