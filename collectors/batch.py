"""Read DESIGN.md's batch input directory into time-ordered records, with the collectors' parsers.

``read_batch_dir(path)`` parses job.json, nodes/<node>/gpu.jsonl, steps/*.jsonl,
nodes/<node>/kernel.log, nodes/<node>/nccl/*.log, stacks/<rank>.txt (and
stacks/<rank>.<child>.txt, a subprocess of that rank) and flight_recorder/* (PyTorch
NCCL Flight Recorder dumps, as summaries: faultlens.flightrec). A bad
line is counted and kept in ``errors`` as ``file:line: reason``, never silently
dropped; good lines still load. JSON lines go through orjson and the schema's
validation (its shape-table fast path); text logs through KernelParser and
NcclParser. Every list of the result is sorted by time.

Putting text logs on the job's clock (per node; ``BatchInput.clocks`` says what
was done). NVML samples and step timings carry unix times; text logs often do
not:

* Year. Syslog (``Nov 21 04:40:00``) and glog (``E1121 04:56:41``) prefixes have
  none. It is taken from the node's own absolute times (its first gpu.jsonl or
  steps record), else the job's, else the first ``YYYY-MM-DD`` stamp in the
  node's logs, else the log file's mtime. A year-less record that then lands
  more than half a year from the node's time is moved to the neighbouring year
  (a log that crosses New Year).
* Boot-relative kernel times (``dmesg``'s ``[ 1843.308145]``, /dev/kmsg's
  microseconds) need the node's boot time, which a batch directory does not
  record. (A live agent converts them with /proc/uptime: ``KernelParser(boot_time=...)``;
  it never comes through here.) Estimated, in this order:
  1. ``hardware``: a kernel record whose GPU event NVML also saw -- Xid 79 or
     "fallen off the bus" and the GPU turning ``lost``; Xid 48/94/95 and the
     DBE counter rising; Xid 63/64 and a row-remap flag (not Xid 74: NVLink
     counters rise long before it). Boot = time of the first gpu.jsonl sample
     showing the change minus the record's seconds since boot (good to one
     sample period).
  2. ``process_exit``: the OOM killer's record of pid P and the launcher's
     ``failed (exitcode: -9) ... (pid: P)`` line (torchrun notices within a
     second or so).
  3. ``stalled_task``: a hung-task record ("blocked for more than N seconds") on a
     node whose steps stopped at least N s before its samples did is put N s
     after the node's last step (the task has been blocked since the stall).
  4. ``first_record``: lacking any, the node's first kernel record is put at
     the node's first gpu.jsonl/steps time (the log is assumed to start with the
     job; a record written before the job starts is then placed too late).
  5. ``last_record``: when that would put the log's end more than an hour after
     the node's last gpu.jsonl/steps time (the log reaches back before the job,
     as a whole dmesg buffer does), its last record is put at that last time.
  Anchors 1 and 2 are tried from the latest such record back (3 from the first), and are only
  taken when they too keep the log's end within that hour.
  Every such record is marked ``fields["ts_estimated"] = True`` with
  ``fields["ts_anchor"]`` naming the method; diagnosis copies the mark into the
  evidence. A node with no absolute time at all keeps seconds since boot.
* Lines without a time. The parsers give such a line the time of the previous
  timed line in the same file. torchrun's own glog lines (``E1121
  04:56:41.732487 98927 torch/...``) are timed here. A record before the file's
  first timed line takes that line's time (``ts_anchor`` ``next_line``). In a
  file with no time at all (NCCL's own lines carry none, nor do tracebacks), an
  INFO line takes the node's first time (``node_first``: set-up chatter) and
  anything else, a WARN, an exception or a traceback, the node's last step time
  (``last_step``): the error that stopped or hung the ranks came when their steps
  stopped, not when the job began.
"""

from __future__ import annotations

import functools
import gc
import heapq
import math
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from operator import attrgetter
from pathlib import Path
from typing import Any

import orjson

from faultlens import decode, flightrec, schema
from faultlens.collectors.batch_clocks import (
    NodeClock,
    anchor_kernel,
    anchor_nccl,
    node_clock,
)
from faultlens.collectors.sources import log_parser
from faultlens.collectors.unparsed import (
    LONG_LINE,
    MAX_LINE_BYTES,
    SNIFF_BYTES,
    UnparsedLog,
    clip,
    guarded_parse,
    read_byte_lines,
    read_lines,
    reason_of,
    sniff_binary,
    to_int,
)
from faultlens.errors import SchemaError
from faultlens.schema import (
    GpuSample,
    JobTopology,
    KernelEvent,
    NcclEvent,
    StackDump,
    StepTiming,
)

Progress = Callable[[str, int, int], None]  # (phase, done, total)

_ts = attrgetter("ts")




@dataclass
class BatchInput:
    job: JobTopology | None
    kernel: list[KernelEvent] = field(default_factory=list)
    nccl: list[NcclEvent] = field(default_factory=list)
    gpu: list[GpuSample] = field(default_factory=list)
    steps: list[StepTiming] = field(default_factory=list)
    stacks: list[StackDump] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    # "file:line: field: reason: value" for each field the decoder nulled (the record was kept)
    quarantine: list[str] = field(default_factory=list)
    clocks: dict[str, NodeClock] = field(default_factory=dict)
    # every line or file that gave no record, with its reason (collectors/unparsed.py; ``errors`` has them as text)
    unparsed: UnparsedLog = field(default_factory=UnparsedLog)
    # read_batch_dir(stream_gpu=True): each node's gpu.jsonl, read again record by record by ``records()``
    # instead of held in ``gpu`` (the NVML samples are most of a big job's input)
    gpu_files: list[GpuFile] = field(default_factory=list)

    def records(self, *, stacks: bool = True) -> Iterator[Any]:
        """Every record, merged in timestamp order (stable within a source); streamed GPU files are read
        as they merge, one sample per node in memory. ``stacks=False`` leaves the stack dumps out."""
        lists = (self.gpu, self.kernel, self.nccl, self.steps, self.stacks) if stacks else \
            (self.gpu, self.kernel, self.nccl, self.steps)
        # the GPU files where ``gpu`` would be: records of one time keep the order of the held read
        streams: list[Any] = [f.samples() for f in self.gpu_files if f.count]
        streams += [lst if _is_sorted(lst) else sorted(lst, key=_ts) for lst in lists if lst]
        yield from heapq.merge(*streams, key=_ts)

    def __len__(self) -> int:
        return (len(self.gpu) + sum(f.count for f in self.gpu_files) + len(self.kernel) + len(self.nccl)
                + len(self.steps) + len(self.stacks))


@dataclass
class GpuFile:
    """One node's gpu.jsonl, read once to count it (errors, quarantine, its times) and again when merged."""

    path: Path
    count: int
    ordered: bool

    def samples(self) -> Iterator[GpuSample]:
        """Its samples again, in time order; the lines refused the first time are skipped silently."""
        bad = _Bad([], UnparsedLog())
        if not self.ordered:
            yield from sorted(_json_lines(self.path, "gpu", bad), key=_ts)
            return
        yield from _iter_json_lines(self.path, "gpu", bad)


def _sorted_samples(path: Path) -> list[GpuSample]:
    """A streamed node's samples read again (its refused lines were counted the first time), in time order."""
    samples = _json_lines(path, "gpu", _Bad([], UnparsedLog()))
    samples.sort(key=_ts)
    return samples


def _is_sorted(lst: list[Any]) -> bool:
    return all(a.ts <= b.ts for a, b in pairwise(lst))


class _Bad:
    """The batch reader's one error path: ``errors`` (text, as before) and the UnparsedLog."""

    def __init__(self, errors: list[str], log: UnparsedLog):
        self.errors, self.log = errors, log

    def __call__(self, path: Path, no: int | None, reason: str, raw: str | bytes = "", text: str | None = None) -> None:
        """``text``: the reason as ``errors`` words it, when that differs (the decoder's errors name their kind)."""
        self.log.add(str(path), no, reason, raw)
        text = reason if text is None else text
        self.errors.append(f"{path}:{no}: {text}" if no is not None else f"{path}: {text}")


def _readable(path: Path, bad: _Bad) -> bool:
    """True for a regular file that can be opened; anything else (a symlink loop, a dangling link, a
    directory or FIFO where a file should be, no permission) is one unparsed entry with the reason."""
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            bad(path, None, "not a regular file (a directory, FIFO or device where a log file should be); skipped")
            return False
        with open(path, "rb"):
            pass
    except OSError as exc:
        bad(path, None, f"unreadable ({exc.strerror or type(exc).__name__}); skipped")
        return False
    return True


def _json_lines(path: Path, kind: str, bad: _Bad, quarantine: list[str] | None = None) -> list[Any]:
    """A JSON-lines file through the one decoder (faultlens/decode.py), a line at a time.

    Lines it refuses go to ``bad``; fields it nulled (N/A, a bad value) to ``quarantine``.
    """
    return list(_iter_json_lines(path, kind, bad, quarantine))


def _iter_json_lines(path: Path, kind: str, bad: _Bad, quarantine: list[str] | None = None) -> Iterator[Any]:
    """_json_lines one record at a time."""
    try:
        with open(path, "rb") as fh:
            for no, line in enumerate(read_byte_lines(fh), 1):
                if not line.strip():
                    continue
                if len(line) > MAX_LINE_BYTES:
                    bad(path, no, f"{LONG_LINE} (over {MAX_LINE_BYTES:,} bytes; not parsed)", line)
                    continue
                issues: list[decode.FieldIssue] = []
                try:
                    rec = decode.decode(kind, line, issues=issues, bounds=decode.RECORDED_TIME)
                except SchemaError as exc:
                    bad(path, no, f"{exc.reason}: {exc.detail}" if exc.detail else exc.reason, line, str(exc))
                except Exception as exc:  # noqa: BLE001 - the decoder must not stop the directory
                    bad(path, no, reason_of(exc), line)
                else:
                    yield rec
                if issues and quarantine is not None:
                    quarantine.extend(f"{path}:{no}: {i.field}: {i.reason}: {i.value}" for i in issues if i.reason != decode.UNKNOWN_FIELD)
    except OSError as exc:
        bad(path, None, f"read failed ({exc.strerror or type(exc).__name__})")


def _text_lines(path: Path, bad: _Bad) -> list[str]:
    """A text file's lines (split on newlines only, as the file iterator does); bytes that are not
    UTF-8 replaced (and reported), a line over MAX_LINE_BYTES cut (the parse reports it), a binary
    file none (reported)."""
    lines: list[str] = []
    try:
        with open(path, "rb") as fh:
            why = sniff_binary(fh.peek(SNIFF_BYTES)[:SNIFF_BYTES])
            if why is not None:
                bad(path, None, why + "; skipped")
                return []
            lines.extend(read_lines(fh, lambda no, raw: bad(path, no, "not UTF-8 (kept with replacement characters)", raw)))
    except OSError as exc:
        bad(path, None, f"read failed ({exc.strerror or type(exc).__name__})")
    return lines


def read_job(path: Path) -> JobTopology:
    obj = orjson.loads(path.read_bytes())
    if not isinstance(obj, dict):
        raise SchemaError(f"expected a JSON object (job, tp, pp, dp, ranks), got a JSON {type(obj).__name__}")
    obj.setdefault("v", schema.SCHEMA_VERSION)
    obj.setdefault("ts", 0.0)
    return schema.from_dict("jobs", obj)


def fallback_job(steps: list[StepTiming], nodes: list[str], *, default: str) -> JobTopology:
    """The job a batch directory without a usable job.json describes: the job its step records name
    (the most common), its ranks placed where those records say (pure data parallel, GPUs unknown);
    with no step records, one rank per node directory."""
    names: dict[str, int] = {}
    placement: dict[int, str] = {}
    for s in steps:
        names[s.job] = names.get(s.job, 0) + 1
        placement.setdefault(s.rank, s.node)
    job_name = max(names.items(), key=lambda kv: kv[1])[0] if names else default
    if not placement:
        placement = dict(enumerate(sorted(nodes)))
    ranks = {str(r): {"node": n} for r, n in sorted(placement.items())}
    return schema.from_dict("jobs", {"v": schema.SCHEMA_VERSION, "ts": 0.0, "job": job_name, "tp": 1, "pp": 1,
                                     "dp": max(1, len(ranks)), "cp": 1, "order": "tp-cp-dp-pp", "ranks": ranks})


def read_batch_dir(path: str | Path, *, year: int | None = None, progress: Progress | None = None,
                   stream_gpu: bool = False) -> BatchInput:
    """Parse a batch directory (see DESIGN.md) into time-ordered records on the job's clock.

    ``year``: the year of year-less log times (default: from the node's records, see the module doc).
    ``progress(phase, done, total)`` is called as files are read. ``stream_gpu``: the NVML samples are
    not kept (``gpu`` stays empty): ``records()`` reads each node's gpu.jsonl again as it merges, so a
    big job's post-mortem holds one sample per node instead of all of them (``gpu_files``).
    """
    # Millions of new objects and no reference cycles: the cyclic collector would only rescan
    # the growing heap again and again (a third of the reading time on a 1,024-GPU hour).
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _read_batch_dir(Path(path), year, progress, stream_gpu)
    finally:
        if collecting:
            gc.enable()


def _read_batch_dir(root: Path, year: int | None, progress: Progress | None, stream_gpu: bool = False) -> BatchInput:
    errors: list[str] = []
    log = UnparsedLog()
    bad = _Bad(errors, log)
    job = None
    jp = root / "job.json"
    if os.path.lexists(jp):
        if _readable(jp, bad):
            try:
                job = read_job(jp)
            except orjson.JSONDecodeError as exc:
                bad(jp, 1, f"not JSON ({exc}); read without it: one job from the step records")
            except SchemaError as exc:  # "bad_type: tp: bad_type: ..." -> key 'tp' of job.json
                key = exc.detail.split(":", 1)[0] if exc.detail else ""
                bad(jp, 1, f"key {key!r}: {exc.reason} ({exc.detail}); read without it: one job from the step "
                    "records" if key else f"{exc}; read without it: one job from the step records")
            except Exception as exc:  # noqa: BLE001 - a job.json of the wrong shape: read the rest without it
                bad(jp, 1, reason_of(exc))
    else:
        errors.append(f"{jp}: missing")
    job_id = job.job if job else None
    out = BatchInput(job, errors=errors, unparsed=log)
    nodes = sorted(p for p in _listdir(root / "nodes", bad) if p.is_dir())
    step_files = sorted(p for p in _listdir(root / "steps", bad) if p.name.endswith(".jsonl") and _readable(p, bad))
    total = 2 * len(nodes) + len(step_files)
    done = 0

    def tick(phase: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(phase, done, total)

    # 1. Absolute times first: NVML samples and step timings.
    gpu_by_node: dict[str, list[GpuSample]] = {}
    gpu_meta: dict[str, tuple[float, float, dict[str, int]]] = {}  # streamed: node -> first, last ts, PCI -> GPU
    for nd in nodes:
        g = nd / "gpu.jsonl"
        if os.path.lexists(g) and _readable(g, bad):
            samples = _json_lines(g, "gpu", bad, out.quarantine)
            ordered = _is_sorted(samples)
            if not ordered:
                samples.sort(key=_ts)
            if stream_gpu:
                out.gpu_files.append(GpuFile(g, len(samples), ordered))
                if samples:
                    gpu_meta[nd.name] = (samples[0].ts, samples[-1].ts,
                                         {s.pci_bus: s.index for s in samples[0].gpus if s.pci_bus})
                del samples
            else:
                gpu_by_node[nd.name] = samples
                out.gpu.extend(samples)
        tick("gpu")
    for f in step_files:
        out.steps.extend(_json_lines(f, "steps", bad, out.quarantine))
        tick("steps")
    if not _is_sorted(out.gpu):
        out.gpu.sort(key=_ts)
    if not _is_sorted(out.steps):
        out.steps.sort(key=_ts)
    if job is None:
        # No usable job.json (its error is in ``errors``): one job all the same, so that one fault is one
        # incident, not one under the steps' job name and another under "unknown" for the kernel lines.
        job = out.job = fallback_job(out.steps, [nd.name for nd in nodes], default=root.name)
        job_id = job.job
    first_ts: dict[str, float] = {}
    last_ts: dict[str, float] = {}
    for node, samples in gpu_by_node.items():
        if samples:
            first_ts[node], last_ts[node] = samples[0].ts, samples[-1].ts
    for node, (first, last, _) in gpu_meta.items():
        first_ts[node], last_ts[node] = first, last
    last_step_ts: dict[str, float] = {}
    for s in out.steps:  # time-ordered: the first seen is the earliest
        first_ts.setdefault(s.node, s.ts)
        if s.ts > last_ts.get(s.node, -math.inf):
            last_ts[s.node] = s.ts
        if s.ts > last_step_ts.get(s.node, -math.inf):
            last_step_ts[s.node] = s.ts
    job_first = min(first_ts.values()) if first_ts else None

    # 2. Text logs, per node, anchored on the node's clock.
    for nd in nodes:
        node = nd.name
        samples = gpu_by_node.get(node, [])
        gpu_map = {s.pci_bus: s.index for s in samples[0].gpus if s.pci_bus} if samples else None
        if node in gpu_meta:
            gpu_map = gpu_meta[node][2]
        k = nd / "kernel.log"
        has_kernel = os.path.lexists(k) and _readable(k, bad)
        log_files = ([k] if has_kernel else []) + sorted(
            p for p in _listdir(nd / "nccl", bad) if p.name.endswith(".log") and _readable(p, bad))
        clock = node_clock(year, first_ts.get(node), job_first, log_files)
        clock.last_ts = last_ts.get(node)
        clock.last_step_ts = last_step_ts.get(node)
        out.clocks[node] = clock
        node_nccl: list[NcclEvent] = []
        for f in log_files[1 if has_kernel else 0:]:
            np_ = log_parser("nccl").make(node, job=job_id, year=clock.year, default_ts=math.nan)
            recs_n = list(guarded_parse(np_, _text_lines(f, bad), str(f), log, errors))
            node_nccl.extend(_guarded_anchor(anchor_nccl, (recs_n, clock), recs_n, f, bad))
        out.nccl.extend(node_nccl)
        if has_kernel:
            kp = log_parser("kernel").make(node, year=clock.year, gpu_map=gpu_map)
            klines = _text_lines(k, bad)
            anchors: list[GpuSample] | Callable[[], list[GpuSample]] = samples
            if node in gpu_meta:
                # boot-relative times: the node's samples anchor them (a GPU event NVML saw too), read again only
                # when a record needs them (a third read of every streamed node was ~5% of a big post-mortem)
                anchors = functools.partial(_sorted_samples, nd / "gpu.jsonl")
            recs = list(guarded_parse(kp, klines, str(k), log, errors))
            out.kernel.extend(_guarded_anchor(anchor_kernel, (recs, clock, anchors, node_nccl), recs, k, bad))
        tick("logs")
    out.kernel.sort(key=_ts)
    out.nccl.sort(key=_ts)

    sd = root / "stacks"
    placement = job.ranks if job and isinstance(job.ranks, dict) else {}

    def node_of(rank: int | None) -> str:
        where = placement.get(str(rank), {}) if rank is not None else {}
        return str(where.get("node", "")) if isinstance(where, dict) else ""

    # <rank>.txt is the rank's process; <rank>.<anything>.txt a subprocess of it (a dataloader worker,
    # a checkpoint writer), appended to the rank's dump as py-spy --subprocesses prints them.
    by_rank: dict[int | None, list[tuple[float, str]]] = {}
    for f in sorted((p for p in _listdir(sd, bad) if p.name.endswith(".txt") and _readable(p, bad)),
                    key=lambda p: (p.name.count("."), p.name)):
        rank = to_int(f.name.split(".", 1)[0])
        if rank is None:
            bad(f, None, "file name is not a rank number")
        lines = _text_lines(f, bad)
        if not lines and f.stat().st_size:
            continue  # binary or unreadable: reported
        text = "\n".join(clip(ln, MAX_LINE_BYTES) for ln in lines)
        if f.name.count(".") > 1 and not text.lstrip().startswith("Process "):
            text = f"Process 0: {f.name}\n" + text
        by_rank.setdefault(rank, []).append((f.stat().st_mtime, text))
    for rank, parts in by_rank.items():
        out.stacks.append(StackDump(ts=parts[0][0], job=job_id or "", node=node_of(rank), rank=rank, pid=None,
                                    text="\n".join(t for _, t in parts)))
    out.stacks.extend(_flight_recorder(root / "flight_recorder", job_id or "", node_of, bad))
    out.stacks.sort(key=_ts)
    return out


def _flight_recorder(d: Path, job_id: str, node_of: Callable[[int | None], str], bad: _Bad) -> list[StackDump]:
    """DIR/flight_recorder/*: each readable dump as a StackDump carrying its summary (faultlens.flightrec)."""
    out = []
    for f in sorted(p for p in _listdir(d, bad) if _readable(p, bad)):
        try:
            data = f.read_bytes()
            summary = flightrec.summarise(flightrec.loads(data), flightrec.rank_from_name(f.name))
        except (OSError, flightrec.FlightRecorderError) as exc:
            bad(f, None, f"not a usable Flight Recorder dump: {exc}")
            continue
        rank = summary.get("rank")
        if not isinstance(rank, int):
            bad(f, None, "Flight Recorder dump without a rank (none in the file name or the dump)")
            continue
        out.append(StackDump(ts=f.stat().st_mtime, job=job_id, node=node_of(rank), rank=rank, pid=None,
                             text=flightrec.summary_text(summary)))
    return out


def _listdir(d: Path, bad: _Bad) -> list[Path]:
    """The entries of ``d`` ([] when it is not a directory; reported when it cannot be listed)."""
    if not d.is_dir():
        return []
    try:
        return list(d.iterdir())
    except OSError as exc:
        bad(d, None, f"cannot list ({exc.strerror or type(exc).__name__}); skipped")
        return []


def _guarded_anchor(fn: Callable[..., list[Any]], args: tuple[Any, ...], recs: list[Any], path: Path, bad: _Bad) -> list[Any]:
    """Putting a file's records on the job's clock never stops the directory: on a failure the
    records keep the times their lines gave (reported once for the file)."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001
        bad(path, None, f"records kept with their own times; clock estimate failed: {reason_of(exc)}")
        return recs
