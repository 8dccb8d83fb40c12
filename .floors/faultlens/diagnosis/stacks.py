"""ByteRobust's stack-trace aggregation: find the odd ranks of a hung or slow job.

Under a single implicit fault most healthy ranks sit in identical stacks (every
data-parallel replica waiting in the same collective). So: parse each rank's
``py-spy dump``, pick its training thread, reduce it to a fingerprint with the
named regexes below (so addresses, pids and thread ids do not split groups),
group ranks by fingerprint, call the dominant groups healthy and the rest
outliers, and name the machines of the smallest parallel group holding every
outlier (over-eviction: quick isolation beats precise localisation).

Ranks that did not answer (no dump, or ``StackDump.error``) are outliers too:
a process stuck in the kernel is often the one py-spy cannot read.

Fail-slow mode (MFU decline): repeat every 10 s; each round flags the parallel
group holding the most outliers; after 5 rounds the group flagged most often is
the degrader.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from faultlens.diagnosis.topology import Demarcation, smallest_group
from faultlens.schema import StackDump
from faultlens.stream.topology import Topology

# --------------------------------------------------------------------------- parsing

PROCESS_RE = re.compile(r"^Process (?P<pid>\d+): (?P<cmd>.*)$")
THREAD_RE = re.compile(r'^Thread (?P<tid>0x[0-9a-fA-F]+|\d+) \((?P<state>[^)]*)\)(?:: "(?P<name>.*)")?\s*$')
FRAME_RE = re.compile(r"^\s+(?P<func>.+?) \((?P<loc>[^()]*?)(?::(?P<line>\d+))?\)\s*$")

# Named normalisation regexes (STYLE.md 12): each strips one kind of run-to-run noise.
NORMALISERS: dict[str, tuple[re.Pattern[str], str]] = {
    "address": (re.compile(r"0x[0-9a-fA-F]+"), "0x?"),
    "pid": (re.compile(r"\b(pid[=: ]\s*)\d+", re.IGNORECASE), r"\1?"),
    "thread_id": (re.compile(r"\b(Thread|tid[=: ])\s*\d+", re.IGNORECASE), r"\1 ?"),
    "rank_tag": (re.compile(r"\b(rank|RANK|PP|TP|DP)\s?\d+\b"), r"\1?"),
    "site_packages": (re.compile(r"^.*?/(?:site|dist)-packages/"), ""),
}
LINE_NUMBER_RE = re.compile(r":\d+\)$")
ADDRESS_ONLY_FRAME_RE = re.compile(r"^0x[0-9a-fA-F]+ \(")  # native frame without a symbol: ASLR noise
TRAINING_FRAME_RE = re.compile(r"\b(train|pretrain|train_step|forward|backward|optimizer|step|_exec_schedule|eval_batch)\b")


@dataclass(frozen=True)
class Thread:
    tid: str
    state: str
    name: str
    frames: tuple[str, ...]  # innermost first, as py-spy prints them ("func (file:line)")


def parse_pyspy(text: str) -> list[Thread]:
    """Threads of one ``py-spy dump`` text, every process's (lines that are not frames or headers are ignored)."""
    return [t for _, threads in parse_processes(text) for t in threads]


def parse_processes(text: str) -> list[tuple[str, list[Thread]]]:
    """(process header, its threads) of a ``py-spy dump`` text, in order.

    ``py-spy dump --subprocesses`` prints the rank's process first, then its children
    (dataloader workers, checkpoint writers), each under its own ``Process PID: CMD``
    line; a dump without such a line is one process with header "".
    """
    out: list[tuple[str, list[Thread]]] = []
    header = ""
    threads: list[Thread] = []
    tid = state = name = ""
    frames: list[str] | None = None

    def close_thread() -> None:
        if frames is not None:
            threads.append(Thread(tid, state, name, tuple(frames)))

    for raw in text.splitlines():
        line = raw.rstrip()
        stripped = line.strip()
        pm = PROCESS_RE.match(stripped) if stripped.startswith("Process ") else None
        if pm:
            close_thread()
            frames = None
            if threads or header:
                out.append((header, threads))
            header, threads = f"{pm['pid']} ({pm['cmd'][:80]})", []
            continue
        m = THREAD_RE.match(stripped) if stripped.startswith("Thread ") else None
        if m:
            close_thread()
            tid, state, name, frames = m["tid"], m["state"], m["name"] or "", []
            continue
        if frames is not None and line.startswith((" ", "\t")) and FRAME_RE.match(line):
            frames.append(stripped)
    close_thread()
    if threads or header:
        out.append((header, threads))
    return out


def normalise_frame(frame: str, *, strip_line_numbers: bool = False) -> str | None:
    """One frame through the named normalisers; None for a frame that is pure noise."""
    if ADDRESS_ONLY_FRAME_RE.match(frame):
        return None
    out = frame
    m = FRAME_RE.match("  " + frame)
    if m:
        loc = m["loc"]
        pattern, repl = NORMALISERS["site_packages"]
        loc = pattern.sub(repl, loc)
        out = f"{m['func']} ({loc}{':' + m['line'] if m['line'] else ''})"
    for name, (pattern, repl) in NORMALISERS.items():
        if name != "site_packages":
            out = pattern.sub(repl, out)
    if strip_line_numbers:
        out = LINE_NUMBER_RE.sub(")", out)
    return out


def training_thread(threads: list[Thread]) -> Thread | None:
    """The thread that runs training: one with training frames (MainThread first), else MainThread."""
    if not threads:
        return None
    with_training = [t for t in threads if any(TRAINING_FRAME_RE.search(f) for f in t.frames)]
    main = [t for t in threads if t.name == "MainThread"]
    for pool in ([t for t in with_training if t.name == "MainThread"], with_training, main, threads):
        if pool:
            return pool[0]
    return None  # pragma: no cover


def fingerprint(text: str, *, strip_line_numbers: bool = False) -> str | None:
    """The normalised training-thread stack of one dump; None when there is no stack in it."""
    processes = parse_processes(text)  # the rank's own process; its subprocesses are read by diagnosis.hangroot
    thread = training_thread(processes[0][1]) if processes else None
    if thread is None or not thread.frames:
        return None
    frames = [normalise_frame(f, strip_line_numbers=strip_line_numbers) for f in thread.frames]
    return "\n".join(f for f in frames if f)


# --------------------------------------------------------------------------- aggregation


@dataclass
class StackVerdict:
    """The outcome of one aggregation round."""

    groups: list[tuple[str, list[int]]]  # (fingerprint, ranks), largest first
    healthy: list[int]
    outliers: list[int]  # ranks whose stack is not in a dominant group
    missing: list[int]  # ranks that did not answer (part of outliers)
    demarcation: Demarcation | None  # smallest parallel group holding all outliers
    reasons: dict[int, str] = field(default_factory=dict)
    narrowed: Demarcation | None = None  # the odd one out among the outliers (a unique, smallest stack group)

    @property
    def nodes(self) -> list[str]:
        return list(self.demarcation.nodes) if self.demarcation else []

    def top_frame(self, rank: int) -> str:
        for fp, ranks in self.groups:
            if rank in ranks:
                return fp.split("\n", 1)[0]
        return "(no stack)"


class StackAggregator:
    """Groups ranks by normalised stack and demarcates the outliers on the job's topology."""

    def __init__(self, *, strip_line_numbers: bool = False, dominant_ratio: float = 0.5,
                 max_outlier_fraction: float = 0.5):
        self.strip_line_numbers = strip_line_numbers
        self.dominant_ratio = dominant_ratio  # a group this large relative to the largest is healthy
        self.max_outlier_fraction = max_outlier_fraction  # more outliers than this: no single culprit

    def aggregate(self, dumps: Iterable[StackDump], topology: Topology,
                  expected_ranks: Iterable[int] | None = None) -> StackVerdict:
        by_rank: dict[int, StackDump] = {}
        for d in dumps:
            if d.rank is not None:
                prev = by_rank.get(d.rank)
                if prev is None or d.ts >= prev.ts:
                    by_rank[d.rank] = d
        expected = sorted(expected_ranks) if expected_ranks is not None else list(range(topology.world_size))
        prints: dict[int, str] = {}
        reasons: dict[int, str] = {}
        missing = []
        for r in expected:
            got = by_rank.get(r)
            fp = None if got is None or got.error else fingerprint(got.text, strip_line_numbers=self.strip_line_numbers)
            if fp is None:
                missing.append(r)
                reasons[r] = "no stack answered" if got is None else (
                    f"stack dump failed: {got.error}" if got.error else "empty stack dump")
            else:
                prints[r] = fp
        grouped: dict[str, list[int]] = {}
        for r, fp in prints.items():
            grouped.setdefault(fp, []).append(r)
        groups = sorted(grouped.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
        healthy: list[int] = []
        outliers = list(missing)
        if groups:
            largest = len(groups[0][1])
            for fp, ranks in groups:
                if len(ranks) >= self.dominant_ratio * largest and len(ranks) > 1 or fp == groups[0][0]:
                    healthy.extend(ranks)
                else:
                    outliers.extend(ranks)
                    for r in ranks:
                        reasons[r] = f"stack differs from the majority: {fp.split(chr(10), 1)[0]}"
        outliers.sort()
        demarcation = narrowed = None
        if outliers and len(outliers) <= self.max_outlier_fraction * max(1, len(expected)):
            demarcation = smallest_group(topology, outliers)
            # Peers of a stuck rank wait on it (recv/send) and so differ too; the stuck one usually sits alone in
            # a stack nobody else shares. Used when the whole group is more than the guard rails allow.
            outlier_groups = [rs for fp, rs in groups if rs[0] in outliers] + ([missing] if missing else [])
            if len(outlier_groups) > 1:
                sizes = sorted(len(g) for g in outlier_groups)
                odd = min(outlier_groups, key=len)
                if sizes[0] < sizes[1]:
                    narrowed = smallest_group(topology, odd)
        return StackVerdict(groups, sorted(healthy), outliers, sorted(missing), demarcation, reasons, narrowed)


class FailSlowRounds:
    """ByteRobust's fail-slow localisation: flag the group with most outliers per round; vote over rounds."""

    def __init__(self, topology: Topology, *, rounds: int = 5, dims: tuple[str, ...] = ("tp", "cp", "dp", "pp")):
        self.topology = topology
        self.rounds = rounds
        self.dims = tuple(d for d in dims if getattr(topology, d) > 1) or ("tp",)
        self.flags: Counter[tuple[str, tuple[int, ...]]] = Counter()
        self.done = 0

    def add_round(self, verdict: StackVerdict) -> tuple[str, tuple[int, ...]] | None:
        """Record one round; returns the flagged (dim, group) or None when no rank stood out."""
        self.done += 1
        if not verdict.outliers:
            return None
        outliers = set(verdict.outliers)
        best: tuple[int, int, str, tuple[int, ...]] | None = None
        for dim in self.dims:
            seen = set()
            for r in outliers:
                g = self.topology.group(r, dim)
                if g in seen:
                    continue
                seen.add(g)
                key = (len(outliers & set(g)), -len(g), dim, g)
                if best is None or key[:2] > best[:2]:
                    best = key
        assert best is not None
        flagged = (best[2], best[3])
        self.flags[flagged] += 1
        return flagged

    @property
    def complete(self) -> bool:
        return self.done >= self.rounds

    def degrader(self) -> Demarcation | None:
        """After the rounds: the group flagged most often (ties: the smaller group)."""
        if not self.flags:
            return None
        (dim, g), _ = max(self.flags.items(), key=lambda kv: (kv[1], -len(kv[0][1])))
        nodes = tuple(self.topology.nodes_of(g)) if self.topology.placement else ()
        return Demarcation((dim,), g, nodes)
