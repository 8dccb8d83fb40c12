"""What a parsed log record means: category, severity, per-line action, meaning.

Collectors parse text into records with a ``kind``; this module maps a record to
a ``Classification`` using catalogs that are data (diagnosis/catalogs/):
``xid.toml`` (every NVIDIA Xid code, plus context numbers), ``kernel.toml`` and
``nccl.toml`` (ordered rules: kind + optional regex). They are compiled once;
a bad entry fails at load naming file and entry.

Context rules need what came before (a ``ClassifyContext``):
* the same application-class Xid on one GPU from several distinct processes ->
  GPU suspect (gpu_hardware, run_diagnostics), per NVIDIA's Xid 13/31 workflows;
* an Xid raised by driver tooling (modprobe, nvidia-smi...) -> driver;
* Xid 45 after another Xid on the same GPU inherits that Xid's category;
* Xid 154 states the recovery the driver wants -> that action.

``classify(record)`` and ``to_finding(record)`` are what diagnosis and
``faultlens explain`` call; pass one ``ClassifyContext`` per stream to get the
context rules (without one, each call starts from an empty context).
"""

from __future__ import annotations

import math
import re
import tomllib
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from faultlens.errors import CatalogError
from faultlens.stream.schema import Finding, KernelEvent, NcclEvent, StackDump, StepTiming
from faultlens.vocabulary import SEVERITY_RANK, Category, LineAction, Severity, values

CATALOGS = Path(__file__).resolve().parent / "catalogs"
CATEGORIES = values(Category)
LINE_ACTIONS = values(LineAction)
SEVERITIES = values(Severity)
_SEV_RANK = SEVERITY_RANK
_DEFAULT_CONFIDENCE = {"info": 0.5, "warning": 0.7, "critical": 0.95}


@dataclass(frozen=True, slots=True)
class Classification:
    """What one record means. ``rule`` is the catalog entry id (None: not recognised)."""

    category: str
    severity: str
    action: str
    meaning: str
    rule: str | None
    xid: int | None = None
    fault: str = "unknown"  # the Finding kind (gpu_lost, ecc_uncorrectable, collective_timeout...)
    confidence: float = 0.5
    companion: bool = False  # reports on another record (Xid 45/154/63): ranked below it

    @property
    def benign(self) -> bool:
        return self.action == "none" and self.severity == "info"

    def priority(self) -> tuple[int, int, int, int]:
        """Sort key: the most significant classification of a group is the max.

        Severity first; then a cause over a companion that reports on it; then a
        named category over none/unknown; then a machine fault over a software one
        (at equal severity the machine fault is the actionable root cause).
        """
        return (_SEV_RANK[self.severity], 0 if self.companion else 1,
                0 if self.category in ("none", "unknown") else 1, 0 if self.category == "user_software" else 1)


UNRECOGNISED = Classification("unknown", "info", "none", "Not recognised by any faultlens catalog.", None, fault="unknown")


def most_significant(items: Iterable[Classification]) -> Classification | None:
    """The classification that should speak for a group of lines (first of the highest priority)."""
    best = None
    for c in items:
        if best is None or c.priority() > best.priority():
            best = c
    return best


# --------------------------------------------------------------------------- catalogs


@dataclass(frozen=True, slots=True)
class Rule:
    id: str
    kinds: frozenset[str]
    match: re.Pattern[str] | None
    result: Classification
    any: tuple[str, ...] = ()  # substring prefilter: the regex runs only if one occurs


@dataclass(frozen=True, slots=True)
class XidEntry:
    code: int
    name: str
    result: Classification
    nvidia_category: str


@dataclass(frozen=True)
class Catalogs:
    xid: dict[int, XidEntry]
    kernel: tuple[Rule, ...]
    nccl: tuple[Rule, ...]
    context: dict[str, Any]


def _read(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise CatalogError("catalog file not found", file=str(path)) from None
    except tomllib.TOMLDecodeError as exc:
        raise CatalogError(f"not valid TOML: {exc}", file=str(path)) from None


def _result(entry: dict[str, Any], *, file: str, name: str, rule: str, xid: int | None = None) -> Classification:
    for key in ("category", "severity", "action", "meaning"):
        if not isinstance(entry.get(key), str):
            raise CatalogError(f"missing or non-string `{key}`", file=file, entry=name)
    if entry["category"] not in CATEGORIES:
        raise CatalogError(f"unknown category {entry['category']!r}", file=file, entry=name)
    if entry["severity"] not in SEVERITIES:
        raise CatalogError(f"unknown severity {entry['severity']!r}", file=file, entry=name)
    if entry["action"] not in LINE_ACTIONS:
        raise CatalogError(f"unknown action {entry['action']!r}", file=file, entry=name)
    conf = entry.get("confidence", _DEFAULT_CONFIDENCE[entry["severity"]])
    if not isinstance(conf, (int, float)) or not 0 <= conf <= 1:
        raise CatalogError("confidence must be a number in [0, 1]", file=file, entry=name)
    return Classification(entry["category"], entry["severity"], entry["action"], entry["meaning"], rule, xid,
                          str(entry.get("fault", "unknown")), float(conf), bool(entry.get("companion", False)))


def load_rules(path: Path) -> tuple[Rule, ...]:
    """An ordered rule catalog (kernel.toml, nccl.toml)."""
    data = _read(path)
    rules = []
    seen = set()
    for i, entry in enumerate(data.get("rule", [])):
        rid = entry.get("id")
        if not isinstance(rid, str) or not rid:
            raise CatalogError("rule has no id", file=str(path), entry=f"#{i}")
        if rid in seen:
            raise CatalogError("duplicate rule id", file=str(path), entry=rid)
        seen.add(rid)
        kinds = entry.get("kind")
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not kinds or not all(isinstance(k, str) for k in kinds):
            raise CatalogError("`kind` must be a string or a list of strings", file=str(path), entry=rid)
        rx = None
        if "match" in entry:
            try:
                rx = re.compile(entry["match"])
            except (re.error, TypeError) as exc:
                raise CatalogError(f"bad `match` regex: {exc}", file=str(path), entry=rid) from None
        subs = entry.get("any", [])
        if not isinstance(subs, list) or not all(isinstance(x, str) and x for x in subs):
            raise CatalogError("`any` must be a list of non-empty substrings", file=str(path), entry=rid)
        rules.append(Rule(rid, frozenset(kinds), rx, _result(entry, file=str(path), name=rid, rule=rid), tuple(subs)))
    if not rules:
        raise CatalogError("no [[rule]] entries", file=str(path))
    return tuple(rules)


def load_xid(path: Path) -> tuple[dict[int, XidEntry], dict[str, Any]]:
    data = _read(path)
    out = {}
    for code_s, entry in data.get("xid", {}).items():
        name = f"xid.{code_s}"
        if not code_s.isdigit():
            raise CatalogError("Xid code must be a number", file=str(path), entry=name)
        code = int(code_s)
        out[code] = XidEntry(code, str(entry.get("name", "")),
                             _result(entry, file=str(path), name=name, rule=name, xid=code),
                             str(entry.get("nvidia_category", "")))
    if not out:
        raise CatalogError("no [xid.N] entries", file=str(path))
    ctx = data.get("context", {})
    for key in ("recurring_distinct_pids", "companion_window_s", "recurrence_window_s", "driver_processes"):
        if key not in ctx:
            raise CatalogError(f"[context] lacks `{key}`", file=str(path), entry="context")
    for name, val in ctx.get("recovery_actions", {}).items():
        if not (isinstance(val, list) and len(val) == 2 and val[0] in LINE_ACTIONS and val[1] in SEVERITIES):
            raise CatalogError("recovery action must be [action, severity]", file=str(path), entry=f"context.recovery_actions.{name}")
    return out, ctx


def load_catalogs(directory: Path | None = None) -> Catalogs:
    """Load and validate every classification catalog (fails naming file and entry)."""
    d = directory or CATALOGS
    xid, ctx = load_xid(d / "xid.toml")
    return Catalogs(xid, load_rules(d / "kernel.toml"), load_rules(d / "nccl.toml"), ctx)


@lru_cache(maxsize=1)
def catalogs() -> Catalogs:
    """The shipped catalogs, loaded once per process."""
    return load_catalogs()


# --------------------------------------------------------------------------- context


@dataclass
class ClassifyContext:
    """What the context rules remember of earlier records (bounded)."""

    max_per_gpu: int = 256
    _xids: dict[tuple[str, str], deque] = field(default_factory=dict)

    def recent(self, node: str, pci: str) -> deque:
        key = (node, pci)
        q = self._xids.get(key)
        if q is None:
            q = self._xids[key] = deque(maxlen=self.max_per_gpu)
        return q


_BY_KIND: dict[tuple[int, str], tuple[tuple[Rule, ...], tuple[Rule, ...]]] = {}


def _rules_for(rules: tuple[Rule, ...], kind: str) -> tuple[Rule, ...]:
    """The rules of one kind, in catalog order (indexed once: most lines are of kind `other`)."""
    key = (id(rules), kind)
    got = _BY_KIND.get(key)
    if got is None or got[0] is not rules:  # `is`: an id may be reused by another catalog
        if len(_BY_KIND) > 4096:
            _BY_KIND.clear()
        got = _BY_KIND[key] = (rules, tuple(r for r in rules if kind in r.kinds))
    return got[1]


def _first_rule(rules: tuple[Rule, ...], kind: str, text: str) -> Classification | None:
    for r in _rules_for(rules, kind):
        if r.any:
            for sub in r.any:
                if sub in text:
                    break
            else:
                continue
        if r.match is None or r.match.search(text) is not None:
            return r.result
    return None


def _with(c: Classification, **changes: Any) -> Classification:
    from dataclasses import replace

    return replace(c, **changes)


def _classify_xid(rec: KernelEvent, cats: Catalogs, ctx: ClassifyContext | None) -> Classification:
    code = rec.xid if rec.xid is not None else -1
    entry = cats.xid.get(code)
    if entry is None:
        c = Classification("unknown", "warning", "notify", f"Xid {code} is not in NVIDIA's catalog known to faultlens; contact NVIDIA support if it repeats.",
                           "xid.unknown", code, "xid_unknown", 0.6)
    else:
        c = entry.result
    cx = cats.context
    process = str(rec.fields.get("process") or "")
    pci = rec.pci_bus or ""
    recent = ctx.recent(rec.node, pci) if ctx is not None else deque()
    window = float(cx["companion_window_s"])

    if process and process in cx["driver_processes"] and c.category in ("gpu_hardware", "user_software"):
        c = _with(c, category="driver", rule=f"xid.{code}.driver_process",
                  meaning=f"{c.meaning} Raised by driver tooling ({process}), not a workload: points at the driver/firmware.")
    elif entry is not None and entry.nvidia_category == "user_application" and entry.result.action == "restart_job" and rec.pid is not None:
        pids = {p for (t, x, p, _) in recent if x == code and p is not None and rec.ts - t <= float(cx["recurrence_window_s"])}
        pids.add(rec.pid)
        if len(pids) >= int(cx["recurring_distinct_pids"]):
            c = _with(c, category="gpu_hardware", severity="critical", action="run_diagnostics", rule=f"xid.{code}.recurring",
                      fault="gpu_hardware_error", confidence=0.8,
                      meaning=f"Xid {code} ({entry.name}) on the same GPU from {len(pids)} different processes: "
                              "the GPU, not the application, is the likely cause. Run diagnostics on it before reuse.")
    if code == 45:
        prior = next(((x, pc) for (t, x, _, pc) in reversed(recent) if x not in (45, 154) and abs(rec.ts - t) <= window), None)
        if prior is not None:
            x, pc = prior
            c = _with(c, category=pc.category, severity="info" if pc.severity == "info" else "warning", action="none",
                      rule="xid.45.after_xid", companion=True,
                      meaning=f"Preemptive cleanup of the GPU's channels after Xid {x} ({pc.category}); follow Xid {x}, not this line.")
    if code == 154:
        wanted = str(rec.fields.get("recovery_action") or "")
        mapped = cx.get("recovery_actions", {}).get(wanted)
        prior = next((pc for (t, x, _, pc) in reversed(recent) if x != 154 and abs(rec.ts - t) <= window), None)
        category = prior.category if prior is not None and prior.category not in ("none", "unknown") else "gpu_hardware"
        if mapped:
            c = _with(c, action=mapped[0], severity=mapped[1], category=category if mapped[0] != "none" else "none",
                      rule=f"xid.154.{mapped[0]}", companion=True,
                      meaning=f"The driver now requires: {wanted}. Follow it (the Xid before this line is the cause).")
        else:
            c = _with(c, category=category, companion=True)
    if ctx is not None:
        recent.append((rec.ts, code, rec.pid, c))
    return c


def classify(record: Any, context: ClassifyContext | None = None) -> Classification:
    """Map one record (KernelEvent, NcclEvent, StepTiming, StackDump) to what it means."""
    cats = catalogs()
    if isinstance(record, KernelEvent):
        if record.kind == "xid":
            return _classify_xid(record, cats, context)
        return _first_rule(cats.kernel, record.kind, record.message or record.raw) or UNRECOGNISED
    if isinstance(record, NcclEvent):
        return _first_rule(cats.nccl, record.kind, record.message or record.raw) or UNRECOGNISED
    if isinstance(record, StepTiming):
        return _classify_step(record)
    if isinstance(record, StackDump):
        if record.error:
            return Classification("unknown", "warning", "notify", f"No stack dump for this process: {record.error}.",
                                  "stacks.dump_failed", fault="stack_dump_failed", confidence=0.5)
        return Classification("none", "info", "none", "A stack dump of one process (all threads); compared across ranks by the stack aggregator.",
                              "stacks.dump", fault="stack_dump")
    return UNRECOGNISED


def _classify_step(rec: StepTiming) -> Classification:
    for name in ("loss", "grad_norm"):
        v = getattr(rec, name)
        if v is not None and not math.isfinite(v):
            return Classification("user_software", "warning", "run_diagnostics",
                                  f"The step's {name} is {v}: numerical divergence (NaN/Inf). If no rank or machine stands out, "
                                  "check data and hyper-parameters; a single rank producing it points at its GPU.",
                                  f"steps.nonfinite_{name}", fault="nan_loss", confidence=0.7)
    return Classification("none", "info", "none", "A training step's timing and workload.", "steps.timing", fault="step")


_SOURCES = {KernelEvent: "kernel", NcclEvent: "nccl", StepTiming: "steps", StackDump: "stacks"}


def to_finding(record: Any, context: ClassifyContext | None = None) -> Finding | None:
    """The record as diagnostic evidence, or None when it is a normal / benign line."""
    c = classify(record, context)
    if c.rule is None or c.benign or c.category == "none":
        return None
    figures: dict[str, Any] = {}
    for name in ("xid", "pci_bus", "pid", "op_type", "seq_num", "timeout_ms", "ran_for_ms", "exception", "host", "loss", "step"):
        v = getattr(record, name, None)
        if v is not None:
            figures[name] = v
    fields = getattr(record, "fields", None) or {}
    for name in ("sxid", "process", "recovery_action", "peer", "device_pci"):
        if name in fields:
            figures[name] = fields[name]
    text = getattr(record, "raw", None) or getattr(record, "text", "") or ""
    return Finding(
        ts=float(getattr(record, "ts", 0.0)),
        kind=c.fault,
        category=c.category,
        severity=c.severity,
        action=c.action,
        confidence=c.confidence,
        source=_SOURCES.get(type(record), "unknown"),
        rule=c.rule,
        text=text[:4000],
        node=getattr(record, "node", None) or None,
        job=getattr(record, "job", None),
        gpu=getattr(record, "gpu", None),
        rank=getattr(record, "rank", None),
        figures=figures,
    )
