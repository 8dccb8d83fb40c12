"""A scenario written as files: the batch directory (DESIGN.md, "Batch path") at once, or
bit by bit as a live job writes its logs (``LiveWriter``, for followers and the agent).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson

from faultlens.datasets.scenario import Event, Scenario


def write_batch_dir(scenario: Scenario, out_dir: str | Path) -> Path:
    """Write DESIGN.md's batch input directory (plus truth.json) for the scenario; returns the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.json").write_bytes(orjson.dumps(scenario.job_dict(), option=orjson.OPT_INDENT_2) + b"\n")
    (out / "truth.json").write_bytes(orjson.dumps(scenario.truth(), option=orjson.OPT_INDENT_2) + b"\n")
    for stream in scenario._streams():
        by_path: dict[str, list[str]] = {}
        for e in stream:
            by_path.setdefault(e.path, []).append(e.payload)
        for rel, payloads in by_path.items():
            path = out / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write("\n".join(payloads))
                f.write("\n")
    for node in scenario.cluster.node_names:  # every node has its files, even empty ones
        for rel in ("kernel.log", "gpu.jsonl"):
            (out / "nodes" / node / rel).touch()
    return out


class LiveWriter:
    """Appends a scenario's records to batch-directory files as simulated time advances.

    ``advance(until_ts)`` writes every record up to that simulated time. The
    lead's live mode drives it from a clock (``faultlens simulate --speed 20``)
    while the real agent follows the files. Reaching the end gives the same
    files as ``write_batch_dir`` (truth.json is written at the start).
    """

    def __init__(self, scenario: Scenario, out_dir: str | Path):
        self.scenario = scenario
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "job.json").write_bytes(orjson.dumps(scenario.job_dict(), option=orjson.OPT_INDENT_2) + b"\n")
        (self.out / "truth.json").write_bytes(orjson.dumps(scenario.truth(), option=orjson.OPT_INDENT_2) + b"\n")
        for node in scenario.cluster.node_names:
            (self.out / "nodes" / node / "nccl").mkdir(parents=True, exist_ok=True)
            for rel in ("kernel.log", "gpu.jsonl"):
                (self.out / "nodes" / node / rel).touch()
        self.now = scenario.start_ts - 1e9
        self._pending: Iterator[Event] = scenario.events()
        self._next: Event | None = next(self._pending, None)

    def advance(self, until_ts: float) -> int:
        """Write every record with ts <= until_ts; returns how many were written."""
        by_path: dict[str, list[str]] = {}
        n = 0
        while self._next is not None and self._next.ts <= until_ts:
            by_path.setdefault(self._next.path, []).append(self._next.payload)
            self._next = next(self._pending, None)
            n += 1
        for rel, payloads in by_path.items():
            path = self.out / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write("\n".join(payloads) + "\n")
        self.now = max(self.now, until_ts)
        return n

    @property
    def finished(self) -> bool:
        return self._next is None
