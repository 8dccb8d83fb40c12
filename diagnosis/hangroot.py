"""The root of a hang: which rank the others wait for, from what each stack is doing.

Stack aggregation (diagnosis/stacks.py) finds the ranks whose stacks differ, but in a
hang the stuck rank's peers differ too: its tensor-parallel peers wait for it in a
broadcast, its pipeline neighbours in p2p recv. Evicting the smallest group holding all
of them (ByteRobust's over-eviction) takes 2-4 healthy machines with the faulty one.

Here every frame of every rank's stack is classified from catalogs/frames.toml (comm,
device, input, storage, or plain Python); a rank's state is its training thread's
innermost classified frame. The root of a hang is a rank that is *not* waiting on
communication while ranks of its groups are; in a pipeline, the chain of p2p waits
(a stage in recv_forward waits on the stage before it) is followed to the stage the
others wait for. A dataloader worker or checkpoint subprocess stuck in a read or a
write (``py-spy dump --subprocesses``) counts for its rank. Evidence from outside the
stacks adds to a rank's score: a rank missing at the Flight Recorder wavefront of one
of its process groups (faultlens/flightrec.py), a GPU whose utilisation or power stands
apart from the job's during the hang, an explicit machine fault on its machine.

Scores are additive, per catalog weights, and shown per suspect with their reasons;
``single_out`` names the root machine(s) only when they stand clear of the rest.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from faultlens import flightrec
from faultlens.config import read_catalog
from faultlens.diagnosis.rules import CATALOGS
from faultlens.diagnosis.stacks import FRAME_RE, Thread, parse_processes, training_thread
from faultlens.errors import CatalogError
from faultlens.stream.topology import DIMS, Topology

FRAMES_CATALOG = CATALOGS / "frames.toml"
CATEGORIES = ("comm", "device", "input", "storage")
# not waiting on communication: waiting on something else, or not running at all (a stopped process)
STUCK = frozenset({"device", "input", "storage", "stopped"})
# A child process idle in its task queue is a healthy dataloader worker, not evidence.
IDLE_CHILD_RULES = frozenset({"input_queue", "dataloader"})


@dataclass(frozen=True)
class FrameRule:
    name: str
    category: str
    func: re.Pattern[str]
    file: re.Pattern[str] | None
    state: re.Pattern[str] | None = None  # py-spy's thread state ("idle", "active", "gil"): None is any


@dataclass(frozen=True)
class FrameCatalog:
    """frames.toml: frame rules (first match wins), pipeline directions, score weights."""

    rules: tuple[FrameRule, ...]
    directions: tuple[tuple[re.Pattern[str], str], ...]
    scores: Mapping[str, float]
    evidence: Mapping[str, Any] = field(default_factory=dict)

    def classify(self, frame: str, state: str = "") -> FrameRule | None:
        """The first rule matching one py-spy frame line (``func (file:line)``) of a thread in ``state``."""
        m = FRAME_RE.match("  " + frame)
        func, path = (m["func"], m["loc"]) if m else (frame, "")
        for rule in self.rules:
            if rule.func.search(func) and (rule.file is None or rule.file.search(path)) and (
                    rule.state is None or rule.state.search(state)):
                return rule
        return None

    def stopped(self, text: str) -> str | None:
        """The line saying the process is stopped (SIGSTOP, a hung machine) in a dump or its error, else None."""
        for pattern in self.evidence.get("stopped_patterns", ()):
            m = pattern.search(text)
            if m:
                line_start = text.rfind("\n", 0, m.start()) + 1
                line_end = text.find("\n", m.end())
                return text[line_start:line_end if line_end >= 0 else None].strip()[:200]
        return None

    def direction(self, frames: Iterable[str]) -> str | None:
        """Which pipeline neighbour a p2p wait points at: the outermost frame naming a direction."""
        found = None
        for frame in frames:  # innermost first: keep the last (outermost) match
            m = FRAME_RE.match("  " + frame)
            func = m["func"] if m else frame
            for pattern, points in self.directions:
                if pattern.search(func):
                    found = points
                    break
        return found


def _compile(pattern: str, where: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise CatalogError(f"{where}: bad regex {pattern!r}: {exc}", file=str(FRAMES_CATALOG)) from None


def parse_frames_catalog(data: Mapping[str, Any], source: str = str(FRAMES_CATALOG)) -> FrameCatalog:
    """Validate the frames catalog's data; errors name the entry."""
    rules = []
    for i, entry in enumerate(data.get("frame", [])):
        where = f"frame[{i}] {entry.get('name', '?')}"
        if entry.get("category") not in CATEGORIES:
            raise CatalogError(f"{where}: category must be one of {', '.join(CATEGORIES)}", file=source)
        if not entry.get("func"):
            raise CatalogError(f"{where}: func (a regex) is required", file=source)
        rules.append(FrameRule(str(entry.get("name", f"frame{i}")), entry["category"], _compile(entry["func"], where),
                               _compile(entry["file"], where) if entry.get("file") else None,
                               _compile(entry["state"], where) if entry.get("state") else None))
    directions = []
    for i, entry in enumerate(data.get("direction", [])):
        if entry.get("points") not in ("prev", "next"):
            raise CatalogError(f"direction[{i}]: points must be prev or next", file=source)
        directions.append((_compile(entry["func"], f"direction[{i}]"), str(entry["points"])))
    scores = {str(k): float(v) for k, v in (data.get("scores") or {}).items()}
    missing = {"outlier_stack", "no_answer", "not_waiting", "busy_python", "pipeline_points", "child_stuck",
               "flight_recorder", "flight_recorder_more", "gpu_outlier", "machine_fault", "root_min", "margin", "max_root_machines"} - set(scores)
    if missing:
        raise CatalogError(f"[scores] lacks {', '.join(sorted(missing))}", file=source)
    evidence = dict(data.get("evidence") or {})
    evidence.setdefault("machine_fault_kinds", [])
    evidence["stopped_patterns"] = tuple(_compile(str(x), f"[evidence] stopped_patterns[{i}]")
                                         for i, x in enumerate(evidence.get("stopped_patterns") or ()))
    for key, default in (("window_s", 900.0), ("gpu_util_gap", 40.0), ("gpu_power_ratio", 0.45), ("gpu_max_share", 0.1)):
        evidence[key] = float(evidence.get(key, default))
    return FrameCatalog(tuple(rules), tuple(directions), scores, evidence)


@lru_cache(maxsize=4)
def load_frames(path: str | None = None) -> FrameCatalog:
    """The frames catalog (cached; ``path`` for a test's own copy)."""
    p = Path(path) if path else FRAMES_CATALOG
    return parse_frames_catalog(read_catalog(p), str(p))


# --------------------------------------------------------------------------- one rank


@dataclass(frozen=True)
class RankState:
    """What one rank's dump says it is doing."""

    rank: int
    category: str  # comm | device | input | storage | python | stopped | missing
    rule: str = ""  # the frames.toml entry that decided it
    frame: str = ""  # the frame it matched
    points: str | None = None  # a p2p wait: "prev" or "next" pipeline stage
    children: tuple[str, ...] = ()  # subprocesses / side threads stuck in input, storage or device

    @property
    def waiting(self) -> bool:
        return self.category == "comm"

    def describe(self) -> str:
        if self.category == "missing":
            return self.frame or "no stack answered"
        what = {"comm": "waiting on communication", "device": "waiting on the GPU", "input": "waiting on input data",
                "storage": "in storage I/O", "python": "running Python, not waiting",
                "stopped": "its process is stopped (not scheduled: SIGSTOP, a hung machine)"}[self.category]
        return f"{what}: {self.frame}" if self.frame else what


def _innermost(thread: Thread, catalog: FrameCatalog) -> tuple[FrameRule | None, str]:
    for frame in thread.frames:
        rule = catalog.classify(frame, thread.state)
        if rule is not None:
            return rule, frame
    return None, thread.frames[0] if thread.frames else ""


def rank_state(rank: int, text: str, catalog: FrameCatalog, *, error: str | None = None) -> RankState:
    """Classify one rank's dump (its first process is the rank; later ones its subprocesses).

    A dump that failed because the process is stopped (py-spy: "Failed to suspend process ...
    unexpected waitpid result"; the agent: state T in /proc) is evidence, not missing data."""
    stopped = catalog.stopped(f"{error or ''}\n{text}")
    if stopped is not None:
        return RankState(rank, "stopped", "stopped_process", stopped)
    if error or not text.strip():
        return RankState(rank, "missing", frame=f"stack dump failed: {error}" if error else "empty stack dump")
    processes = parse_processes(text)
    if not processes or not any(t.frames for t in processes[0][1]):
        return RankState(rank, "missing", frame="no stack in the dump")
    main_threads = processes[0][1]
    thread = training_thread(main_threads)
    assert thread is not None
    rule, frame = _innermost(thread, catalog)
    category = rule.category if rule else "python"
    points = catalog.direction(thread.frames) if category == "comm" else None
    children: list[str] = []
    for t in main_threads:  # side threads of the rank (an async checkpoint writer)
        if t is thread:
            continue
        r, f = _innermost(t, catalog)
        if r is not None and r.category in ("storage", "device"):
            children.append(f"thread {t.name or t.tid} {r.category}: {f}")
    for header, threads in processes[1:]:
        for t in threads[:1] or ():
            r, f = _innermost(t, catalog)
            if r is not None and r.category in STUCK and r.name not in IDLE_CHILD_RULES:
                children.append(f"subprocess {header} {r.category}: {f}")
    return RankState(rank, category, rule.name if rule else "", frame, points, tuple(children[:4]))


# --------------------------------------------------------------------------- the job


@dataclass
class RootSuspect:
    """One machine's standing as the root of a hang: score (sum of its evidence) and why."""

    node: str
    score: float = 0.0
    ranks: list[int] = field(default_factory=list)
    gpus: list[int] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)


@dataclass
class RootRanking:
    """Every rank's state, the per-rank scores and the machines ranked by them."""

    states: dict[int, RankState]
    rank_scores: dict[int, float]
    rank_reasons: dict[int, list[str]]
    suspects: list[RootSuspect]  # best first
    roots: list[str]  # the machines singled out (empty: the evidence does not single any out)
    why_not: str = ""  # why nothing was singled out

    root_min: float = 0.6

    def best(self, n: int) -> list[str]:
        """Up to ``n`` best-ranked machines: those with a root's evidence, else those tied at the top score."""
        strong = [s.node for s in self.suspects if s.score >= self.root_min]
        if strong:
            return strong[:n]
        top = self.suspects[0].score if self.suspects else 0.0
        return [s.node for s in self.suspects if top > 0 and s.score >= top - 1e-9][:n]


def _groups_of(topo: Topology, rank: int) -> set[int]:
    out: set[int] = set()
    for d in DIMS:
        if getattr(topo, d) > 1:
            out.update(topo.group(rank, d))
    out.discard(rank)
    return out


def _pipeline_terminals(states: Mapping[int, RankState], topo: Topology) -> dict[int, int]:
    """Ranks at the end of p2p wait chains -> how many waiting ranks' chains end there."""
    ends: dict[int, int] = {}
    if topo.pp <= 1:
        return ends
    for r, st in states.items():
        if not (st.waiting and st.points):
            continue
        cur, seen = r, {r}
        while True:
            cs = states.get(cur)
            if cs is None or not (cs.waiting and cs.points):
                break
            group = topo.group(cur, "pp")
            idx = group.index(cur)
            nxt_idx = idx - 1 if cs.points == "prev" else idx + 1
            if not 0 <= nxt_idx < len(group) or group[nxt_idx] in seen:
                cur = -1
                break
            cur = group[nxt_idx]
            seen.add(cur)
        if cur < 0 or cur == r:
            continue
        end = states.get(cur)
        targets = [cur]
        if end is not None and end.waiting and topo.tp > 1:
            # the stage it reached waits itself, in its tensor-parallel group: the stuck rank is there
            targets = [p for p in topo.group(cur, "tp") if states.get(p) is not None and not states[p].waiting]
        for t in targets:
            ends[t] = ends.get(t, 0) + 1
    return ends


def rank_roots(states: Mapping[int, RankState], topo: Topology, *, majority: Iterable[int] = (),
               flight: Mapping[int, list[str]] | None = None, gpu: Mapping[int, str] | None = None,
               machine: Mapping[str, str] | None = None, allowed: int = 1,
               catalog: FrameCatalog | None = None) -> RootRanking:
    """Score every rank as the root of the hang and rank the machines.

    ``states``: rank -> RankState (every expected rank, "missing" where none answered);
    ``majority``: the ranks of the dominant stack group (never roots by their stack);
    ``flight``: rank -> why the Flight Recorder names it (one line per process group); ``gpu``: rank -> its GPU's oddity
    during the hang; ``machine``: node -> an explicit fault line on it in the window;
    ``allowed``: the most machines the guard rails let one eviction take.
    """
    cat = catalog or load_frames()
    w = cat.scores
    flight, gpu, machine = flight or {}, gpu or {}, machine or {}
    majority_set = set(majority)
    world = max(1, len(states))
    n_missing = sum(1 for s in states.values() if s.category == "missing")
    n_waiting = sum(1 for s in states.values() if s.waiting)
    # a whole job (or most of it) that did not answer says nothing about one machine; one machine of two
    # that did not answer while the other's ranks wait on it does
    missing_counts = n_missing <= 0.5 * world
    scores: dict[int, float] = {}
    reasons: dict[int, list[str]] = {}

    def add(rank: int, weight: float, why: str) -> None:
        scores[rank] = scores.get(rank, 0.0) + weight
        reasons.setdefault(rank, []).append(why)

    if n_waiting:
        for r, st in states.items():
            if r in majority_set:
                continue
            if st.waiting:
                add(r, 0.5 * w["outlier_stack"], f"rank {r} {st.describe()} (a stack the majority does not share)")
                continue
            if st.category == "missing":
                if missing_counts:
                    add(r, w["outlier_stack"] + w["no_answer"], f"rank {r} did not answer the stack dump ({st.frame})")
                continue
            peers = _groups_of(topo, r)
            waiting_peers = sum(1 for p in peers if states.get(p) is not None and states[p].waiting)
            add(r, w["outlier_stack"], f"rank {r} {st.describe()}")
            if waiting_peers:
                weight = w["not_waiting"] if st.category in STUCK else w["busy_python"]
                add(r, weight, f"not waiting on communication while {waiting_peers} rank(s) of its groups wait")
            if st.children:
                add(r, w["child_stuck"], "; ".join(st.children[:2]))
        for r, n in _pipeline_terminals(states, topo).items():
            add(r, w["pipeline_points"], f"the p2p waits of {n} pipeline rank(s) lead to rank {r}'s stage")
    for r, whys in flight.items():
        known = states.get(r)
        if known is not None and known.category in ("missing", "stopped"):
            # its silence in the Flight Recorder is the silence the stack dump already counted: not twice
            whys = [x for x in whys if flightrec.NO_DUMP not in x]
            if not whys:
                continue
        add(r, w["flight_recorder"] + w["flight_recorder_more"] * (len(whys) - 1), "; ".join(whys[:2]))
    for r, why in gpu.items():
        add(r, w["gpu_outlier"], why)
    by_node: dict[str, RootSuspect] = {}
    for r, sc in scores.items():
        node, g = topo.placement.get(r, (None, None))
        if node is None:
            continue
        s = by_node.setdefault(node, RootSuspect(node))
        if sc > s.score:
            s.score = sc
        s.ranks.append(r)
        if g is not None and g not in s.gpus:
            s.gpus.append(g)
    for r in sorted(scores, key=lambda r: -scores[r]):
        node = topo.placement.get(r, (None, None))[0]
        if node is not None:
            s = by_node[node]
            s.reasons.extend(x for x in reasons[r] if x not in s.reasons and len(s.reasons) < 6)
    for node, why in machine.items():
        s = by_node.setdefault(node, RootSuspect(node))
        s.score += w["machine_fault"]
        s.reasons.insert(0, why)
    for s in by_node.values():
        s.score = round(min(0.99, s.score), 4)
        s.ranks.sort()
    ranked = sorted(by_node.values(), key=lambda s: (-s.score, s.node))
    roots, why_not = single_out(ranked, cat, allowed)
    return RootRanking(dict(states), scores, reasons, ranked, roots, why_not, w["root_min"])


def single_out(ranked: list[RootSuspect], catalog: FrameCatalog, allowed: int) -> tuple[list[str], str]:
    """The root machines when the evidence singles them out: at least ``root_min``, within ``margin`` of the
    best, every other machine ``margin`` below them, and few enough (``max_root_machines``, the guard's limit)."""
    w = catalog.scores
    if not ranked or ranked[0].score < w["root_min"]:
        return [], "no machine has evidence of its own beyond a differing stack"
    top = ranked[0].score
    roots = [s for s in ranked if s.score >= w["root_min"] and s.score >= top - w["margin"] - 1e-9]
    rest = ranked[len(roots)] if len(roots) < len(ranked) else None
    if rest is not None and rest.score > roots[-1].score - w["margin"] + 1e-9:
        return [], (f"{rest.node} ({rest.score:.2f}) is too close to {roots[-1].node} ({roots[-1].score:.2f}) "
                    "to tell them apart")
    limit = min(int(w["max_root_machines"]), max(1, allowed))
    if len(roots) > limit:
        return [], f"{len(roots)} machines have the same evidence (more than {limit})"
    return [s.node for s in roots], ""


# --------------------------------------------------------------------------- GPUs during the hang


def gpu_outliers(means: Mapping[tuple[str, int], tuple[float, float]], topo: Topology, *,
                 util_gap: float = 40.0, power_ratio: float = 0.45, max_share: float = 0.1) -> dict[int, str]:
    """Ranks whose GPU stood apart during the hang: util ``util_gap`` points from the job's median, or power
    off by ``power_ratio`` of the median. ``means``: (node, gpu) -> (mean util, mean power) since the hang.
    More odd GPUs than ``max_share`` of the job: a job-wide pattern, not one GPU."""
    if len(means) < 4:
        return {}
    utils = [u for u, _ in means.values() if u >= 0]
    powers = [p for _, p in means.values() if p > 0]
    mu = statistics.median(utils) if utils else None
    mp = statistics.median(powers) if powers else None
    where = {(n, g): r for r, (n, g) in topo.placement.items()}
    odd: dict[int, str] = {}
    for key, (u, p) in means.items():
        rank = where.get(key)
        if rank is None:
            continue
        if mu is not None and u >= 0 and abs(u - mu) >= util_gap:
            odd[rank] = f"GPU {key[1]} of {key[0]} at {u:.0f}% utilisation while the job's GPUs sit at {mu:.0f}%"
        elif mp is not None and p > 0 and abs(p - mp) >= power_ratio * mp:
            odd[rank] = f"GPU {key[1]} of {key[0]} draws {p:.0f} W while the job's GPUs draw {mp:.0f} W"
    if len(odd) > max(1, int(max_share * len(means))):
        return {}
    return odd
