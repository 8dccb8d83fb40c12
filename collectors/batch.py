"""Read DESIGN.md's batch input directory into records, with the collectors' parsers.

``read_batch_dir(path)`` parses job.json, nodes/<node>/kernel.log,
nodes/<node>/nccl/*.log, nodes/<node>/gpu.jsonl, steps/*.jsonl and
stacks/<rank>.txt. A bad line is counted and kept in ``errors`` as
``file:line: reason``, never silently dropped; good lines still load.
JSON lines go through orjson and the schema's validation; text logs go
through KernelParser/NcclParser, whose substring prefilters keep regexes off
lines that cannot match.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from faultlens.collectors.kernel import KernelParser
from faultlens.collectors.nccl import NcclParser
from faultlens.errors import SchemaError
from faultlens.stream import schema
from faultlens.stream.schema import (
    GpuSample,
    JobTopology,
    KernelEvent,
    NcclEvent,
    StackDump,
    StepTiming,
)


@dataclass
class BatchInput:
    job: JobTopology | None
    kernel: list[KernelEvent] = field(default_factory=list)
    nccl: list[NcclEvent] = field(default_factory=list)
    gpu: list[GpuSample] = field(default_factory=list)
    steps: list[StepTiming] = field(default_factory=list)
    stacks: list[StackDump] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def records(self) -> Iterator[Any]:
        """Every record, merged in timestamp order (stable within a source)."""
        streams = [sorted(lst, key=_ts) for lst in (self.gpu, self.kernel, self.nccl, self.steps, self.stacks) if lst]
        yield from heapq.merge(*streams, key=_ts)


def _ts(r: Any) -> float:
    return r.ts


def _json_lines(path: Path, kind: str, errors: list[str]) -> Iterator[Any]:
    with open(path, "rb") as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = orjson.loads(line)
                if isinstance(obj, dict) and "v" not in obj:
                    obj["v"] = schema.SCHEMA_VERSION
                yield schema.from_dict(kind, obj)
            except orjson.JSONDecodeError as exc:
                errors.append(f"{path}:{no}: malformed_json: {exc}")
            except SchemaError as exc:
                errors.append(f"{path}:{no}: {exc}")


def _text_lines(path: Path, errors: list[str]) -> Iterator[str]:
    with open(path, "rb") as f:
        for no, raw in enumerate(f, 1):
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError:
                errors.append(f"{path}:{no}: not UTF-8 (kept with replacement characters)")
                yield raw.decode("utf-8", "replace")


def read_job(path: Path) -> JobTopology:
    obj = orjson.loads(path.read_bytes())
    obj.setdefault("v", schema.SCHEMA_VERSION)
    obj.setdefault("ts", 0.0)
    return schema.from_dict("jobs", obj)


def read_batch_dir(path: str | Path, *, year: int | None = None) -> BatchInput:
    """Parse a batch directory (see DESIGN.md) into records."""
    root = Path(path)
    errors: list[str] = []
    job = None
    jp = root / "job.json"
    if jp.is_file():
        try:
            job = read_job(jp)
        except (orjson.JSONDecodeError, SchemaError) as exc:
            errors.append(f"{jp}:1: {exc}")
    else:
        errors.append(f"{jp}: missing")
    job_id = job.job if job else None
    gpu_maps: dict[str, dict[str, int]] = {}
    out = BatchInput(job, errors=errors)
    nodes = sorted(p for p in (root / "nodes").iterdir() if p.is_dir()) if (root / "nodes").is_dir() else []
    for nd in nodes:
        node = nd.name
        g = nd / "gpu.jsonl"
        if g.is_file():
            for rec in _json_lines(g, "gpu", errors):
                out.gpu.append(rec)
                if node not in gpu_maps:
                    gpu_maps[node] = {s.pci_bus: s.index for s in rec.gpus if s.pci_bus}
        k = nd / "kernel.log"
        if k.is_file():
            kp = KernelParser(node, year=year, gpu_map=gpu_maps.get(node))
            out.kernel.extend(kp.parse(_text_lines(k, errors)))
        for f in sorted((nd / "nccl").glob("*.log")) if (nd / "nccl").is_dir() else []:
            np_ = NcclParser(node, job=job_id, year=year)
            out.nccl.extend(np_.parse(_text_lines(f, errors)))
    for f in sorted((root / "steps").glob("*.jsonl")) if (root / "steps").is_dir() else []:
        out.steps.extend(_json_lines(f, "steps", errors))
    sd = root / "stacks"
    if sd.is_dir():
        placement = job.ranks if job else {}
        for f in sorted(sd.glob("*.txt")):
            rank = int(f.stem) if f.stem.isdigit() else None
            if rank is None:
                errors.append(f"{f}: file name is not a rank number")
            node = str(placement.get(str(rank), {}).get("node", "")) if rank is not None else ""
            text = f.read_text(errors="replace")
            out.stacks.append(StackDump(ts=f.stat().st_mtime, job=job_id or "", node=node, rank=rank, pid=None, text=text))
    return out
