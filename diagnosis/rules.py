"""NVML counter rules: thresholds on GPU counters as catalog data (catalogs/counters.toml).

Counters are cumulative, so the rules compare each sample with what came
before for the same (node, GPU): a rise of the DBE count, a flag turning on,
a counter's rate per minute, throttle bits held for several samples with the
clock below the node's other GPUs. Each match is a machine-level ``Finding``.
Log lines (Xid, kernel, NCCL) are classified by diagnosis.classify; this
module only owns the counters.
"""

from __future__ import annotations

import statistics
import tomllib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from faultlens.errors import CatalogError
from faultlens.stream.schema import Finding, GpuSample, GpuState

CATALOGS = Path(__file__).resolve().parent / "catalogs"
SEVERITIES = ("info", "warning", "critical")
LINE_ACTIONS = ("none", "restart_job", "reset_gpu", "evict_node", "rollback_code", "run_diagnostics", "notify")
CATEGORIES = ("gpu_hardware", "gpu_memory", "nvlink", "pcie", "network", "host", "driver", "user_software",
              "thermal_power", "storage", "none", "unknown")
TESTS = ("increase", "flag", "rate", "bits")


def load_toml(path: Path) -> dict[str, Any]:
    """Read a catalog file; a syntax error names the file."""
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise CatalogError("catalog file not found", file=str(path)) from None
    except tomllib.TOMLDecodeError as exc:
        raise CatalogError(f"not valid TOML: {exc}", file=str(path)) from None


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


def load_counter_rules(path: Path | None = None) -> list[CounterRule]:
    """Load and validate counters.toml; a bad entry fails naming file and entry."""
    path = path or CATALOGS / "counters.toml"
    data = load_toml(path)
    gpu_fields = set(GpuState.__dataclass_fields__)
    rules = []
    for i, entry in enumerate(data.get("rule", [])):
        name = str(entry.get("name", f"#{i}"))
        try:
            rule = CounterRule(**entry)
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
        if not 0.0 <= rule.confidence <= 1.0:
            problems.append("confidence outside [0, 1]")
        if problems:
            raise CatalogError("; ".join(problems), file=str(path), entry=name)
        rules.append(rule)
    if len({r.name for r in rules}) != len(rules):
        raise CatalogError("duplicate rule names", file=str(path))
    return rules


@dataclass
class _GpuMemory:
    last: GpuState | None = None
    history: dict[str, deque] = field(default_factory=dict)  # field -> deque[(ts, value)]
    streak: dict[str, int] = field(default_factory=dict)  # rule -> consecutive matches
    active: set[str] = field(default_factory=set)  # rules currently firing (edge detection)
    last_fired: dict[str, float] = field(default_factory=dict)


class CounterRules:
    """Stateful evaluator: ``observe(sample) -> [Finding]``."""

    def __init__(self, rules: list[CounterRule] | None = None):
        self.rules = rules if rules is not None else load_counter_rules()
        self._gpus: dict[tuple[str, int], _GpuMemory] = {}

    def observe(self, sample: GpuSample) -> list[Finding]:
        out: list[Finding] = []
        for g in sample.gpus:
            mem = self._gpus.setdefault((sample.node, g.index), _GpuMemory())
            peers = [o.sm_clock_mhz for o in sample.gpus if o.index != g.index and not o.lost]
            for rule in self.rules:
                hit = self._check(rule, g, mem, sample.ts, peers)
                if hit is not None:
                    figures, text_vars = hit
                    out.append(Finding(
                        ts=sample.ts, kind=rule.kind, category=rule.category, severity=rule.severity,
                        action=rule.action, confidence=rule.confidence, source="gpu", rule=f"counters:{rule.name}",
                        text=_fmt(rule.text, gpu=g.index, **text_vars), node=sample.node, job=sample.job,
                        gpu=g.index, figures=figures,
                    ))
            mem.last = g
        return out

    def _check(self, rule: CounterRule, g: GpuState, mem: _GpuMemory, ts: float,
               peer_clocks: list[float]) -> tuple[dict[str, Any], dict[str, Any]] | None:
        value = getattr(g, rule.field)
        if rule.test == "increase":
            if mem.last is None:
                return None
            delta = value - getattr(mem.last, rule.field)
            if delta >= rule.threshold:
                return {rule.field: value, "delta": delta}, {"delta": delta, "value": value}
            return None
        if rule.test == "flag":
            firing = bool(value)
            was = rule.name in mem.active
            mem.active.discard(rule.name)
            if firing:
                mem.active.add(rule.name)
            if firing and not was:
                return {rule.field: True}, {"value": value}
            return None
        if rule.test == "rate":
            hist = mem.history.setdefault(rule.field, deque())
            hist.append((ts, value))
            while len(hist) > 2 and ts - hist[1][0] >= rule.window_s:
                hist.popleft()
            t0, v0 = hist[0]
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
        if rule.test == "bits":
            set_bits = int(value) & rule.mask
            peer_clock = statistics.median(peer_clocks) if peer_clocks else 0.0
            clock_ok = True
            if rule.clock_drop_frac is not None:
                clock_ok = peer_clock > 0 and g.sm_clock_mhz <= peer_clock * (1.0 - rule.clock_drop_frac)
            if set_bits and clock_ok:
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
        return None  # pragma: no cover - validated at load


def _fmt(template: str, **values: Any) -> str:
    try:
        return template.format(**values)
    except (KeyError, ValueError, IndexError):
        return template
