"""Putting a node's text logs on the job's clock (the batch reader's second pass).

Kernel and NCCL lines often carry no year (syslog), only seconds since boot (dmesg), or
no time at all (untimed NCCL lines). Each node gets a ``NodeClock``: the year from the
most trusted source at hand, the boot time from the hardware evidence in the GPU samples
or the process's own records; what is estimated is marked ``fields["ts_estimated"]``.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from faultlens import schema
from faultlens.schema import GpuSample, KernelEvent, NcclEvent

_PREFIX = r"^(?:\[\d+\]\s+)?(?:\[(?:default|rank|Rank )\d+\]:\s?)?(?:[a-z]+\s*:[a-z]+\s*: )?"
# A kernel record head in seconds since boot: dmesg's [ 1843.308145] or /dev/kmsg's "6,1234,1843308145,-;".
BOOT_RELATIVE_RE = re.compile(_PREFIX + r"(?:\[\s*\d+\.\d+\]|\d+,\d+,\d+,[^;]*;)")
# A record head with an absolute time of its own (ISO, ctime, syslog), which ends a boot-relative stretch.
ABSOLUTE_RE = re.compile(_PREFIX + r"(?:\[?\d{4}-\d\d-\d\d[T ]|\[[A-Z][a-z]{2} [A-Z][a-z]{2} |[A-Z][a-z]{2}\s+\d{1,2} \d\d:)")
YEAR_LESS_RE = re.compile(_PREFIX + r"(?:[A-Z][a-z]{2}\s+\d{1,2} \d\d:|\[[EWIFD]\d{4} |[EWIFD]\d{4} \d\d:)")
ISO_YEAR_RE = re.compile(rb"^(?:\[[^\]\n]{1,16}\]:?\s?)?\[?((?:19|20)\d\d)-\d\d-\d\d[T ]\d\d:\d\d:\d\d", re.M)
# torchrun / glog without brackets: "E1121 04:56:41.732487 98927 torch/distributed/...".
GLOG_RE = re.compile(_PREFIX + r"[EWIFD](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d+))?\s+\d+\s+\S+:\d+\]")
HALF_YEAR_S = 183 * 86400.0
LOG_END_SLACK_S = 3600.0  # a kernel log may run on a while after the job's last sample
# Kernel Xid -> the NVML change that the same GPU event shows (field, how it changes).
HARDWARE_ANCHORS: dict[int | str, tuple[tuple[str, str], ...]] = {
    79: (("lost", "on"),),
    "fell_off_bus": (("lost", "on"),),
    48: (("ecc_dbe", "rise"),),
    94: (("ecc_dbe", "rise"),),
    95: (("ecc_dbe", "rise"),),
    63: (("remap_pending", "on"), ("remap_failure", "on")),
    64: (("remap_failure", "on"), ("remap_pending", "on")),
}  # Xid 74 is left out: NVLink counters start rising well before the driver reports it
HUNG_TASK_RE = re.compile(r"blocked for more than (\d+) seconds")
EXIT_PID_RE = re.compile(r"exitcode: -?\d+\).*\(pid: (\d+)\)")


@dataclass
class NodeClock:
    """How one node's text logs were put on the job's clock."""

    year: int
    year_from: str  # explicit | gpu/steps | job | log | mtime | now
    first_ts: float | None = None  # the node's first gpu.jsonl/steps time
    last_ts: float | None = None  # ... and last
    last_step_ts: float | None = None  # the node's last step record (None: no steps)
    boot_time: float | None = None
    boot_from: str | None = None  # hardware | process_exit | stalled_task | first_record | last_record (None: not needed or no anchor)
    estimated: int = 0  # records marked ts_estimated


def _year_of(ts: float) -> int:
    return dt.datetime.fromtimestamp(ts, dt.UTC).year


def node_clock(year: int | None, first: float | None, job_first: float | None, log_files: list[Path]) -> NodeClock:
    if year is not None:
        return NodeClock(year, "explicit", first)
    if first is not None:
        return NodeClock(_year_of(first), "gpu/steps", first)
    if job_first is not None:
        return NodeClock(_year_of(job_first), "job", None)
    for f in log_files:
        with open(f, "rb") as fh:
            m = ISO_YEAR_RE.search(fh.read(1 << 20))
        if m:
            return NodeClock(int(m.group(1)), "log", None)
    if log_files:
        return NodeClock(_year_of(log_files[0].stat().st_mtime), "mtime", None)
    return NodeClock(dt.datetime.now(dt.UTC).year, "now", None)


def _near_year(ts: float, raw: str, clock: NodeClock) -> float:
    """A year-less time more than half a year from the node's time, moved to the neighbouring year."""
    ref = clock.first_ts
    if ref is None or clock.year_from == "explicit" or abs(ts - ref) <= HALF_YEAR_S or not YEAR_LESS_RE.match(raw):
        return ts
    t = dt.datetime.fromtimestamp(ts, dt.UTC)
    for y in (t.year - 1, t.year + 1):
        try:
            moved = t.replace(year=y).timestamp()
        except ValueError:  # 29 February
            continue
        if abs(moved - ref) <= HALF_YEAR_S:
            return moved
    return ts


def _estimated(fields: dict[str, Any], anchor: str) -> dict[str, Any]:
    return {**fields, "ts_estimated": True, "ts_anchor": anchor}


def anchor_kernel(recs: list[KernelEvent], clock: NodeClock,
                  samples: list[GpuSample] | Callable[[], list[GpuSample]],
                  nccl: list[NcclEvent]) -> list[KernelEvent]:
    """Boot-relative records onto the node's clock (see the module doc); year-less ones to the right year;
    records before the file's first time (the parser gave them 0) to that first time. ``samples``: the node's
    NVML samples in time order, or a function that reads them (called only when a record needs them)."""
    relative: list[bool | None] = []  # None: no time seen yet in the file
    rel = None
    for r in recs:
        if BOOT_RELATIVE_RE.match(r.raw):
            rel = True
        elif ABSOLUTE_RE.match(r.raw):
            rel = False
        relative.append(rel)  # a record with no time of its own shares the previous record's clock
    out: list[KernelEvent] = []
    if any(relative):
        boot, how = _boot_time([r for r, x in zip(recs, relative, strict=True) if x], clock, samples, nccl)
        clock.boot_time, clock.boot_from = boot, how
    leading = 0
    for r, rel in zip(recs, relative, strict=True):
        if rel is None:
            leading += 1
        elif rel:
            if clock.boot_time is not None:
                r = schema.replace(r, ts=r.ts + clock.boot_time, fields=_estimated(r.fields, clock.boot_from or ""))
                clock.estimated += 1
        else:
            ts = _near_year(r.ts, r.raw, clock)
            if ts != r.ts:
                r = schema.replace(r, ts=ts)
        out.append(r)
    if leading:
        first = out[leading].ts if leading < len(out) else clock.first_ts
        if first is not None:
            how = "next_line" if leading < len(out) else "node_first"
            for i in range(leading):
                out[i] = schema.replace(out[i], ts=first, fields=_estimated(out[i].fields, how))
            clock.estimated += leading
    return out


def _boot_time(relative: list[KernelEvent], clock: NodeClock,
               samples: list[GpuSample] | Callable[[], list[GpuSample]],
               nccl: list[NcclEvent]) -> tuple[float | None, str | None]:
    """The node's estimated boot time and how it was found (see the module doc)."""
    if clock.first_ts is None:
        return None, None
    first_rel = min(r.ts for r in relative)
    last_rel = max(r.ts for r in relative)
    end = (clock.last_ts if clock.last_ts is not None else clock.first_ts) + LOG_END_SLACK_S

    def plausible(boot: float) -> bool:  # a log is read after it was written: nothing after the node's last time
        return boot + last_rel <= end

    for r in reversed(relative):  # the latest first: an old Xid from before the job has no NVML change here
        changes = HARDWARE_ANCHORS.get(r.xid) if r.xid is not None else HARDWARE_ANCHORS.get(r.kind)
        if not changes:
            continue
        if callable(samples):
            samples = samples()  # a streamed node's samples, read again only for a record they can anchor
        seen = _first_change(samples, changes, r.gpu)
        if seen is not None and plausible(seen - r.ts):
            return seen - r.ts, "hardware"
    exits: dict[int, float] = {}  # pid -> time the launcher reported the process gone
    for n in nccl:
        m = EXIT_PID_RE.search(n.raw) if "exitcode" in n.raw and not n.fields.get("ts_estimated") else None
        if m:
            exits.setdefault(int(m.group(1)), n.ts)
    for r in reversed(relative):
        if r.kind == "oom_kill" and r.pid in exits and plausible(exits[r.pid] - r.ts):
            return exits[r.pid] - r.ts, "process_exit"
    stalled = _stalled_task_boot(relative, clock)
    if stalled is not None and plausible(stalled):
        return stalled, "stalled_task"
    boot = clock.first_ts - first_rel
    if plausible(boot):
        return boot, "first_record"
    # The log reaches back before the job (a real dmesg holds everything since boot): end it at the node's last time.
    return end - LOG_END_SLACK_S - last_rel, "last_record"


def _stalled_task_boot(relative: list[KernelEvent], clock: NodeClock) -> float | None:
    """The boot time that puts the node's first hung-task line ("blocked for more than N seconds") N seconds
    after its last step, when its steps stopped at least N seconds before its samples did: the job stalled on
    this node, and khungtaskd reports a task blocked since then (issue 35: placed at the job's start instead,
    a hung task read before the stall it reports was decided alone)."""
    if clock.last_step_ts is None or clock.last_ts is None:
        return None
    for r in relative:
        m = HUNG_TASK_RE.search(r.raw) if r.kind == "hung_task" else None
        if m is not None:
            blocked_s = float(m.group(1))
            return clock.last_step_ts + blocked_s - r.ts if clock.last_ts >= clock.last_step_ts + blocked_s else None
    return None


def _first_change(samples: list[GpuSample], changes: tuple[tuple[str, str], ...], gpu: int | None) -> float | None:
    """Time of the first sample where one of ``changes`` shows on ``gpu`` (any GPU of the node when None)."""
    prev: dict[int, Any] = {}
    for s in samples:
        for g in s.gpus:
            if gpu is not None and g.index != gpu:
                continue
            now = tuple(getattr(g, f) for f, _ in changes)
            before = prev.get(g.index)
            prev[g.index] = now
            for i, (_, how) in enumerate(changes):
                if how == "on" and now[i] and (before is None or not before[i]):
                    return s.ts
                if how == "rise" and before is not None and now[i] > before[i]:
                    return s.ts
    return None


def _glog_ts(raw: str, clock: NodeClock) -> float | None:
    m = GLOG_RE.match(raw)
    if m is None:
        return None
    try:
        t = dt.datetime(clock.year, int(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4)),
                        int(m.group(5)), tzinfo=dt.UTC)
    except ValueError:
        return None
    ts = t.timestamp() + (float("0." + m.group(6)) if m.group(6) else 0.0)
    return _near_year(ts, raw, clock)


def anchor_nccl(recs: list[NcclEvent], clock: NodeClock) -> list[NcclEvent]:
    """glog lines timed here; records the parser could not time (NaN) take a neighbour's time."""
    out: list[NcclEvent] = []
    untimed: list[int] = []  # positions in out before the file's first time
    last: float | None = None
    for r in recs:
        ts = _glog_ts(r.raw, clock)
        if ts is not None:
            if ts != r.ts:
                r = schema.replace(r, ts=ts)
        elif r.ts != r.ts:  # NaN: no timed line before it in the file
            if last is None:
                untimed.append(len(out))
                out.append(r)
                continue
            r = schema.replace(r, ts=last, fields=_estimated(r.fields, "previous_line"))
            clock.estimated += 1
        else:
            ts = _near_year(r.ts, r.raw, clock)
            if ts != r.ts:
                r = schema.replace(r, ts=ts)
        if untimed:
            for i in untimed:
                out[i] = schema.replace(out[i], ts=r.ts, fields=_estimated(out[i].fields, "next_line"))
                clock.estimated += 1
            untimed = []
        last = r.ts
        out.append(r)
    if untimed:
        fallback = clock.first_ts if clock.first_ts is not None else 0.0
        for i in untimed:
            if out[i].level != "INFO" and clock.last_step_ts is not None:
                ts, how = clock.last_step_ts, "last_step"
            else:
                ts, how = fallback, "node_first"
            out[i] = schema.replace(out[i], ts=ts, fields=_estimated(out[i].fields, how))
            clock.estimated += 1
    return out
