"""NVML counter rules: thresholds on GPU counters as catalog data (catalogs/counters.toml).

Counters are cumulative, so the rules compare each sample with what came
before for the same (node, GPU): a rise of the DBE count, a flag turning on,
a counter's rate per minute, throttle bits held for several samples with the
clock below the node's other GPUs. Each match is a machine-level ``Finding``.
Log lines (Xid, kernel, NCCL) are classified by diagnosis.classify; this
module only owns the counters.
"""

from __future__ import annotations

import copy
import statistics
from array import array
from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Any

import msgspec

from faultlens.config import read_catalog
from faultlens.errors import CatalogError
from faultlens.gpu_wire import column_spans
from faultlens.schema import Finding, GpuSample, GpuState
from faultlens.vocabulary import Category, LineAction, Severity, values

CATALOGS = Path(__file__).resolve().parent / "catalogs"
SEVERITIES = values(Severity)
LINE_ACTIONS = values(LineAction)
CATEGORIES = values(Category)
TESTS = ("increase", "flag", "rate", "bits", "equals")


@dataclass(frozen=True)
class CounterRule:
    name: str
    field: str
    test: str
    kind: str
    category: str
    severity: str
    action: str
    confidence: float
    text: str
    threshold: float = 1.0
    window_s: float = 60.0
    mask: int = 0
    sustain_samples: int = 1
    clock_drop_frac: float | None = None
    # For the flag rule on ``lost``: a GPU missing from this many of its node's samples in a
    # row counts as lost (nvidia-smi and dcgm-exporter leave out a GPU NVML cannot reach).
    vanished_samples: int = 0
    # For the equals test: the field's values that fire (NVML's GPU recovery action codes).
    values: tuple[int, ...] = ()


def load_counter_rules(path: Path | None = None) -> list[CounterRule]:
    """Load and validate counters.toml; a bad entry fails naming file and entry."""
    path = path or CATALOGS / "counters.toml"
    data = read_catalog(path)
    gpu_fields = set(GpuState.__struct_fields__)
    rules = []
    for i, entry in enumerate(data.get("rule", [])):
        name = str(entry.get("name", f"#{i}"))
        try:
            rule = CounterRule(**{**entry, **({"values": tuple(entry["values"])} if "values" in entry else {})})
        except TypeError as exc:
            raise CatalogError(str(exc), file=str(path), entry=name) from None
        problems = []
        if rule.field not in gpu_fields:
            problems.append(f"field {rule.field!r} is not a GPU counter")
        if rule.test not in TESTS:
            problems.append(f"test {rule.test!r} not in {TESTS}")
        if rule.severity not in SEVERITIES:
            problems.append(f"severity {rule.severity!r}")
        if rule.action not in LINE_ACTIONS:
            problems.append(f"action {rule.action!r}")
        if rule.category not in CATEGORIES:
            problems.append(f"category {rule.category!r}")
        if rule.test == "bits" and not rule.mask:
            problems.append("bits test needs a mask")
        if rule.test == "equals" and not (rule.values and all(isinstance(v, int) for v in rule.values)):
            problems.append("equals test needs integer values")
        if not 0.0 <= rule.confidence <= 1.0:
            problems.append("confidence outside [0, 1]")
        if problems:
            raise CatalogError("; ".join(problems), file=str(path), entry=name)
        rules.append(rule)
    if len({r.name for r in rules}) != len(rules):
        raise CatalogError("duplicate rule names", file=str(path))
    return rules


@dataclass
class _SteadyRun:
    """A node's samples since its counters last changed (CounterRules.steady): the times of its GPUs'
    rate windows, shared, instead of one (time, value) per GPU and rate field per sample.

    While a run lasts every GPU of the node is quiet, every rate window holds one value (the GPU's current
    one) and the samples' times do not go back: the windows' entries are (t, that value) for each t of
    ``ts``, which ``CounterRules.end_run`` writes back exactly as sample-by-sample updates would have."""

    key: tuple[Any, ...]  # the counters' bytes of the run's samples (CounterRules._key)
    ts: deque  # the rate windows' times, the last one the newest sample's
    last: Any  # the newest sample (faultlens.decode.GpuColumns, or a GpuSample: steady_sample): each GPU's
    # ``last`` when the run ends
    samples: int = 0  # samples taken into the run since it began


@dataclass
class _GpuMemory:
    last: GpuState | None = None
    edge: tuple[Any, ...] | None = None  # last's values of the fields the increase/flag/bits rules read
    quiet: bool = False  # at the last full evaluation no bits rule saw one of its bits set
    history: dict[str, deque] = field(default_factory=dict)  # field -> deque[(ts, value)]
    streak: dict[str, int] = field(default_factory=dict)  # rule -> consecutive matches
    active: set[str] = field(default_factory=set)  # rules currently firing (edge detection)
    last_fired: dict[str, float] = field(default_factory=dict)


class CounterRules:
    """Stateful evaluator: ``observe(sample) -> [Finding]``.

    Most samples change no counter, and the rules are written so that such a
    sample costs little while every result stays what a full evaluation gives:
    while a GPU's ``increase`` (threshold > 0), ``flag`` and ``bits`` fields hold
    the values of its previous sample and no throttle bit of a ``bits`` rule was
    set then, those rules can neither fire nor change state, so the sample only
    goes through the ``rate`` rules (whose time windows see every sample). Peer
    clocks are only gathered when throttle bits are set.

    Online, GPU samples come columnar (faultlens.decode.GpuColumns) and most of them repeat their node's
    previous counters byte for byte: ``steady`` takes such a sample with one comparison of bytes and one
    time appended for the whole node (a ``_SteadyRun``), and builds no GpuState; the first sample that
    differs ends the run (``end_run``) and goes through ``observe`` as before. The findings are the ones
    sample-by-sample evaluation gives (tests/test_diag_rules.py compares them).
    """

    def __init__(self, rules: list[CounterRule] | None = None):
        self.rules = rules if rules is not None else load_counter_rules()
        self._gpus: dict[tuple[str, int], _GpuMemory] = {}
        self._rates = [r for r in self.rules if r.test == "rate"]
        self._bits = [r for r in self.rules if r.test == "bits"]
        fields = sorted({r.field for r in self.rules if r.test != "rate"})
        self._edge_of = (lambda g: ()) if not fields else (lambda g, get=attrgetter(*fields): (get(g),))
        # A steady sample may skip every rule but the rate ones only if none of those fires on an unchanged value.
        self._steady_ok = all(r.threshold > 0 for r in self.rules if r.test in ("increase", "rate"))
        self._vanish = max((r.vanished_samples for r in self.rules if r.field == "lost"), default=0)
        self._present: dict[str, dict[int, int]] = {}  # node -> GPU index -> samples in a row it was missing
        self._runs: dict[str, _SteadyRun] = {}  # node -> its steady run (see the class docstring)
        self._run_times: list[float] = []  # _begin_run's result: the rate windows' shared times
        # What a run compares: the GPU index and every field a rule reads. Runs need rate rules on distinct
        # fields with one window (their histories then hold the same times) and the steady path at all.
        self._key_fields = tuple(sorted({"index", *(r.field for r in self.rules)}))
        self._sample_key = attrgetter(*self._key_fields)  # the same fields read from a GpuState (steady_sample)
        windows = {r.window_s for r in self._rates}
        self._runs_ok = self._steady_ok and len({r.field for r in self._rates}) == len(self._rates) and len(windows) <= 1
        self._window = windows.pop() if windows else 0.0
        self._spans: dict[tuple[str, int], tuple[tuple[int, int], ...]] = {}
        # A checkpoint's rows of the per-GPU memory (memory_rows), kept until their node is read again:
        # a node in a steady run is written from here, not encoded again.
        self._rows: dict[tuple[str, int], list[Any]] = {}
        self._touched: set[str] = set()

    # ------------------------------------------------------------------ steady runs

    def _key(self, columns: Any) -> tuple[str, bytes]:
        """What must repeat for a sample to be steady: its column layout and the bytes of the key fields."""
        layout = (columns.cols, columns.n)
        spans = self._spans.get(layout)
        data = columns.data
        if spans is None:

            where = column_spans(columns.cols, columns.n)
            merged: list[list[int]] = []
            for a, b in sorted(where[f] for f in self._key_fields if f in where):
                if merged and merged[-1][1] == a:
                    merged[-1][1] = b
                else:
                    merged.append([a, b])
            spans = tuple((a, b) for a, b in merged)
            if len(self._spans) < 256:
                self._spans[layout] = spans
        if len(spans) == 1:
            a, b = spans[0]
            return columns.cols, data[a:b]
        return columns.cols, b"".join([data[a:b] for a, b in spans])

    def steady(self, columns: Any) -> bool:
        """True: ``columns`` (faultlens.decode.GpuColumns) repeats the counters of its node's steady run and
        is taken into it (no rule can fire on it, and none did). False: ``observe(columns.record())``
        must read it (no run, a counter or the GPU set changed, or time went back)."""
        run = self._runs.get(columns.node)
        if run is None:
            return False
        ts = columns.ts
        times = run.ts
        if ts < times[-1] or self._key(columns) != run.key:
            self.end_run(columns.node)
            return False
        times.append(ts)
        window = self._window
        while len(times) > 2 and ts - times[1] >= window:
            times.popleft()
        run.last = columns
        run.samples += 1
        return True

    def steady_sample(self, sample: GpuSample) -> bool:
        """``steady`` for a sample already read as its record (the batch path: GpuSample, not columns):
        True when its GPUs repeat the key fields of the node's run (a run begun by ``begin_sample_run``)."""
        run = self._runs.get(sample.node)
        if run is None:
            return False
        ts = sample.ts
        times = run.ts
        if ts < times[-1] or tuple(map(self._sample_key, sample.gpus)) != run.key:
            self.end_run(sample.node)
            return False
        times.append(ts)
        window = self._window
        while len(times) > 2 and ts - times[1] >= window:
            times.popleft()
        run.last = sample
        run.samples += 1
        return True

    def begin_sample_run(self, sample: GpuSample) -> bool:
        """``begin_run`` for a GpuSample (``steady_sample`` then takes the ones that repeat it). Only where no
        checkpoint is written (the batch engine): a checkpoint stores runs of columns."""
        if not sample.gpus or not self._begin_run(sample, len(sample.gpus)):
            return False
        self._runs[sample.node] = _SteadyRun(tuple(map(self._sample_key, sample.gpus)), deque(self._run_times), sample)
        self._touched.add(sample.node)
        return True

    def begin_run(self, columns: Any, sample: GpuSample) -> bool:
        """After ``observe(sample)`` of ``columns.record()``: start the node's steady run when every GPU is
        quiet and each rate window holds the GPU's current value only, at the same times for every GPU."""
        if not self._begin_run(sample, columns.n):
            return False
        self._runs[sample.node] = _SteadyRun(self._key(columns), deque(self._run_times), columns)
        self._touched.add(sample.node)
        return True

    def _begin_run(self, sample: GpuSample, n: int) -> bool:
        """Whether the node's run may begin after ``sample`` (of ``n`` GPUs); if so the GPUs' rate windows
        are emptied and their shared times left in ``_run_times``."""
        node = sample.node
        if not self._runs_ok or node in self._runs:
            return False
        gpus = sample.gpus
        indexes = {g.index for g in gpus}
        if not gpus or len(indexes) != len(gpus) or len(gpus) != n:
            return False
        if self._vanish and set(self._present.get(node, {})) != indexes:
            return False  # a GPU that vanished is being counted: each sample matters until it is lost
        times: list[float] | None = None
        memory = self._gpus
        for g in gpus:
            mem = memory.get((node, g.index))
            if mem is None or not mem.quiet or mem.last is not g:
                return False
            for rule in self._rates:
                hist = mem.history.get(rule.field)
                if not hist:
                    return False
                value = getattr(g, rule.field)
                if any(v != value for _, v in hist):
                    return False
                at = [t for t, _ in hist]
                if times is None:
                    times = at
                elif at != times:
                    return False
        if times is None:
            return False
        for g in gpus:
            for rule in self._rates:
                memory[(node, g.index)].history[rule.field].clear()
        self._run_times = times
        return True

    def end_run(self, node: str) -> None:
        """The node's rate windows and last samples back in each GPU's memory, as sample-by-sample
        updates would have left them (the same times, trimmed the same way: the times never went back)."""
        run = self._runs.pop(node, None)
        if run is None:
            return
        self._touched.add(node)
        gpus: list[Any]
        if isinstance(run.last, GpuSample) or run.samples:  # a run of GpuSamples, or of columns since it began
            gpus = run.last.gpus if isinstance(run.last, GpuSample) else run.last.record().gpus
            for g in gpus:
                self._gpus[(node, g.index)].last = g
        else:  # no sample since the run began: each GPU's last is the one that began it
            index = array("q")
            index.frombytes(run.last.column("index"))
            gpus = [self._gpus[(node, i)].last for i in index]
        times = list(run.ts)
        newest = times[-1]
        for g in gpus:
            history = self._gpus[(node, g.index)].history
            for rule in self._rates:
                value = getattr(g, rule.field)
                hist = deque((t, value) for t in times)
                while len(hist) > 2 and newest - hist[1][0] >= rule.window_s:
                    hist.popleft()
                history[rule.field] = hist

    # ------------------------------------------------------------------ evaluation

    # ------------------------------------------------------------------ checkpoints

    def fork(self) -> CounterRules:
        """A copy sharing the compiled rules, with memory and caches of its own to be filled (a job's engine)."""
        new = copy.copy(self)
        new._rows, new._touched = {}, set()
        return new

    def memory_rows(self) -> list[list[Any]]:
        """The per-GPU memory as plain rows (diagnosis.online.state writes them into a checkpoint; the
        generic codec took ~30 us a GPU): ``[node, index, last, quiet, [[field, times, values]...],
        [[rule, streak]...], [active rule...], [[rule, last fired]...]]``. A node not read since the last
        call keeps its rows (a steady run changes none)."""
        rows, touched = self._rows, self._touched
        out = []
        for key, mem in self._gpus.items():
            row = rows.get(key)
            if row is None or key[0] in touched:
                row = rows[key] = [
                    key[0], key[1], msgspec.to_builtins(mem.last) if mem.last is not None else None, mem.quiet,
                    [[f, [t for t, _ in h], [v for _, v in h]] for f, h in mem.history.items()],
                    [[k, v] for k, v in mem.streak.items()], sorted(mem.active),
                    [[k, v] for k, v in mem.last_fired.items()]]
            out.append(row)
        touched.clear()
        return out

    def load_memory_rows(self, rows: Any) -> dict[tuple[str, int], _GpuMemory]:
        """memory_rows read back, every value checked (a changelog's bytes are anyone's): ValueError names
        what is wrong. ``last`` is read by msgspec as a GpuState; ``edge`` is made from it again."""
        if not isinstance(rows, list):
            raise ValueError("GPU memory: not a list of rows")
        self._rows, self._touched = {}, set()  # rows of the memory this replaces
        out: dict[tuple[str, int], _GpuMemory] = {}
        for row in rows:
            if not isinstance(row, list) or len(row) != 8:
                raise ValueError("GPU memory: a row that is not 8 values")
            node, index, last, quiet, history, streak, active, fired = row
            if type(node) is not str or type(index) is not int or type(quiet) is not bool:
                raise ValueError(f"GPU memory: bad node, index or quiet in {row[:4]!r}"[:300])
            gpu = msgspec.convert(last, GpuState) if last is not None else None
            mem = _GpuMemory(last=gpu, edge=self._edge_of(gpu) if gpu is not None else None, quiet=quiet,
                             history={f: deque(zip(ts, vs, strict=True)) for f, ts, vs in _triples(history)},
                             streak=dict(_pairs(streak, int)), active=set(_names(active)),
                             last_fired=dict(_pairs(fired, (int, float))))
            out[(node, index)] = mem
        return out

    # ------------------------------------------------------------------ evaluation

    def observe(self, sample: GpuSample) -> list[Finding]:
        if self._runs and sample.node in self._runs:
            self.end_run(sample.node)
        self._touched.add(sample.node)
        out: list[Finding] = []
        gpus = self._with_vanished(sample) if self._vanish else sample.gpus
        ts = sample.ts
        node = sample.node
        memory = self._gpus
        steady_ok = self._steady_ok
        for g in gpus:
            key = (node, g.index)
            mem = memory.get(key)
            if mem is None:
                mem = memory[key] = _GpuMemory()
            edge = self._edge_of(g)
            if mem.quiet and steady_ok and edge == mem.edge:
                # The steady path, inlined (most samples): _rate's window step, and its full test only
                # when the value rose over the window.
                history = mem.history
                for rule in self._rates:
                    value = getattr(g, rule.field)
                    hist = history.get(rule.field)
                    if hist is None:
                        hit = self._rate(rule, value, mem, ts, steady=True)
                    else:
                        hist.append((ts, value))
                        window = rule.window_s
                        while len(hist) > 2 and ts - hist[1][0] >= window:
                            hist.popleft()
                        if value == hist[0][1]:
                            continue  # no rise over the window: a rate of 0 is below any threshold > 0
                        hit = self._rate_after_window(rule, value, mem, ts)
                    if hit is not None:
                        out.append(self._finding(rule, hit, sample, g))
            else:
                for rule in self.rules:
                    hit = self._check(rule, g, mem, ts, gpus)
                    if hit is not None:
                        out.append(self._finding(rule, hit, sample, g))
                mem.quiet = not any(int(getattr(g, r.field)) & r.mask for r in self._bits)
            mem.last = g
            mem.edge = edge
        return out

    def _with_vanished(self, sample: GpuSample) -> list[GpuState]:
        """The sample's GPUs plus, as lost, each GPU the node reported before and has left out of
        ``vanished_samples`` samples in a row (a sample with no GPU at all says nothing)."""
        gpus = sample.gpus
        if not gpus:
            return gpus
        seen = self._present.setdefault(sample.node, {})
        here = {g.index for g in gpus}
        extra: list[GpuState] = []
        for index in list(seen):
            if index in here:
                continue
            seen[index] += 1
            if seen[index] >= self._vanish:
                mem = self._gpus.get((sample.node, index))
                last = mem.last if mem is not None else None
                # Its counters as last seen (a GPU that comes back must not read as a jump from 0), now lost.
                extra.append(msgspec.structs.replace(last, lost=True) if last is not None
                             else GpuState(index=index, lost=True))
        for index in here:
            seen[index] = 0
        return gpus + extra if extra else gpus

    @staticmethod
    def _finding(rule: CounterRule, hit: tuple[dict[str, Any], dict[str, Any]], sample: GpuSample,
                 g: GpuState) -> Finding:
        figures, text_vars = hit
        return Finding(
            ts=sample.ts, kind=rule.kind, category=rule.category, severity=rule.severity,
            action=rule.action, confidence=rule.confidence, source="gpu", rule=f"counters:{rule.name}",
            text=_fmt(rule.text, gpu=g.index, **text_vars), node=sample.node, job=sample.job,
            gpu=g.index, figures=figures,
        )

    @staticmethod
    def _rate(rule: CounterRule, value: Any, mem: _GpuMemory, ts: float, *,
              steady: bool = False) -> tuple[dict[str, Any], dict[str, Any]] | None:
        hist = mem.history.get(rule.field)
        if hist is None:
            hist = mem.history[rule.field] = deque()
        hist.append((ts, value))
        while len(hist) > 2 and ts - hist[1][0] >= rule.window_s:
            hist.popleft()
        if steady and value == hist[0][1]:
            return None  # no rise over the window: a rate of 0 is below any threshold > 0
        return CounterRules._rate_after_window(rule, value, mem, ts)

    @staticmethod
    def _rate_after_window(rule: CounterRule, value: Any, mem: _GpuMemory,
                           ts: float) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """_rate once ``value`` is in the window's history: the rate over it, against the threshold."""
        t0, v0 = mem.history[rule.field][0]
        span = ts - t0
        if span < rule.window_s * 0.5 or span <= 0:
            return None
        rate = (value - v0) * 60.0 / span
        if rate < rule.threshold:
            return None
        if ts - mem.last_fired.get(rule.name, -1e18) < rule.window_s:
            return None
        mem.last_fired[rule.name] = ts
        return {rule.field: value, "rate_per_min": round(rate, 2), "window_s": span}, {"rate": rate, "value": value}

    def _check(self, rule: CounterRule, g: GpuState, mem: _GpuMemory, ts: float,
               gpus: list[GpuState]) -> tuple[dict[str, Any], dict[str, Any]] | None:
        value = getattr(g, rule.field)
        if rule.test == "rate":
            return self._rate(rule, value, mem, ts)
        if rule.test == "bits":
            set_bits = int(value) & rule.mask
            if not set_bits:
                mem.streak[rule.name] = 0
                mem.active.discard(rule.name)
                return None
            # A clock the GPU could not report (null) is no peer and no evidence of a drop.
            peer_clocks = [o.sm_clock_mhz for o in gpus
                           if o.index != g.index and not o.lost and o.sm_clock_mhz is not None]
            peer_clock = statistics.median(peer_clocks) if peer_clocks else 0.0
            clock_ok = True
            if rule.clock_drop_frac is not None:
                own = g.sm_clock_mhz
                clock_ok = own is not None and peer_clock > 0 and own <= peer_clock * (1.0 - rule.clock_drop_frac)
            if clock_ok:
                mem.streak[rule.name] = mem.streak.get(rule.name, 0) + 1
            else:
                mem.streak[rule.name] = 0
                mem.active.discard(rule.name)
                return None
            if mem.streak[rule.name] >= rule.sustain_samples and rule.name not in mem.active:
                mem.active.add(rule.name)
                figures = {"throttle_reasons": int(value), "sm_clock_mhz": g.sm_clock_mhz,
                           "peer_sm_clock_mhz": peer_clock, "temp_c": g.temp_c, "samples": mem.streak[rule.name]}
                return figures, {"clock": g.sm_clock_mhz, "peer_clock": peer_clock, "value": value}
            return None
        if rule.test == "increase":
            if mem.last is None:
                return None
            delta = value - getattr(mem.last, rule.field)
            if delta >= rule.threshold:
                return {rule.field: value, "delta": delta}, {"delta": delta, "value": value}
            return None
        if rule.test in ("flag", "equals"):
            firing = value in rule.values if rule.test == "equals" else bool(value)
            was = rule.name in mem.active
            mem.active.discard(rule.name)
            if firing:
                mem.active.add(rule.name)
            if firing and not was:
                return {rule.field: True}, {"value": value}
            return None
        return None  # pragma: no cover - validated at load


def _names(value: Any) -> list[str]:
    if not isinstance(value, list) or not all(type(x) is str for x in value):
        raise ValueError("GPU memory: rule names that are not strings")
    return value


def _pairs(value: Any, kind: Any) -> list[tuple[str, Any]]:
    if not isinstance(value, list) or not all(isinstance(p, list) and len(p) == 2 and type(p[0]) is str
                                              and type(p[1]) in ((kind,) if isinstance(kind, type) else kind)
                                              for p in value):
        raise ValueError("GPU memory: rule figures that are not [name, number] pairs")
    return [(p[0], p[1]) for p in value]


def _triples(value: Any) -> list[tuple[str, list[float], list[Any]]]:
    number = (int, float)
    ok = isinstance(value, list) and all(
        isinstance(x, list) and len(x) == 3 and type(x[0]) is str and isinstance(x[1], list)
        and isinstance(x[2], list) and len(x[1]) == len(x[2]) and all(type(t) in number for t in x[1])
        and all(v is None or type(v) in number for v in x[2]) for x in value)
    if not ok:
        raise ValueError("GPU memory: rate windows that are not [field, times, values]")
    return [(x[0], x[1], x[2]) for x in value]


def _fmt(template: str, **values: Any) -> str:
    try:
        return template.format(**values)
    except (KeyError, ValueError, IndexError):
        return template
