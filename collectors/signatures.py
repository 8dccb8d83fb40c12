"""The signature catalogs and the one classifier every reader of a log line uses.

One catalog file per family lives in collectors/catalogs/: ``xid.toml`` (every
NVIDIA Xid code + the context numbers), ``sxid.toml`` (NVSwitch), ``kernel.toml``
and ``nccl.toml`` (what a record *is*: ``[[kind]]`` patterns the parsers use; what
it *means*: ordered ``[[rule]]`` entries with category, severity, action, the
reason and its source). The agent's ship filter (``is_ordinary``), ``faultlens
explain``, the batch path and the online engine (``to_finding``) all call
``classify`` here, so they cannot disagree; a bad entry fails at load naming file
and entry.

Context rules need what came before (one ``ClassifyContext`` per stream):
* the same application-class Xid on one GPU from several distinct processes ->
  GPU suspect (gpu_hardware, run_diagnostics), per NVIDIA's Xid 13/31 workflows;
* an Xid raised by driver tooling (modprobe, nvidia-smi...) -> driver;
* a derived Xid (43, 45, 154: ``[context] derived``) after a root Xid on the same
  GPU, or one whose text names its cause ("caused by previous Xid N"), carries the
  root's verdict and ranks below it; Xid 154 states the recovery the driver wants;
* a rule with ``repeat`` escalates when it fires ``count`` times within ``window_s``
  on one device (a corrected PCIe error once is noise, 20 a minute is a bad link);
  ``repeat.counts`` counts events by their header line, not each detail line they print.
Context only ever changes records of recognised kinds, which the agent always
ships, so its context-free ship filter agrees with the context-aware readers.

One module on purpose (a little over the project's ~500 lines): loading, context and
classification are the single place every reader of a line goes through.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from faultlens.config import read_catalog
from faultlens.errors import CatalogError
from faultlens.schema import Finding, KernelEvent, NcclEvent, StackDump, StepTiming
from faultlens.vocabulary import SEVERITY_RANK, Category, LineAction, Severity, values

CATALOGS = Path(__file__).resolve().parent / "catalogs"
CATEGORIES = values(Category)
LINE_ACTIONS = values(LineAction)
SEVERITIES = values(Severity)
FAMILIES = ("xid", "sxid", "kernel", "nccl", "nvsmi", "steps", "stacks")
_SEV_RANK = SEVERITY_RANK
_DEFAULT_CONFIDENCE = {"info": 0.5, "warning": 0.7, "critical": 0.95}
# Bytes that are not text: an undecodable byte (U+FFFD after decoding) or a control
# character. A line carrying one is bad input: kept and shipped, never counted away.
BAD_INPUT_RE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ufffd]")
PRINTED_SEVERITY_RE = re.compile(r"\s(Fatal|FATAL|Non-?[Ff]atal|Nonfatal|NONFATAL)\s")
# Records are judged by their first MATCH_LIMIT characters: a real record (a dump is judged
# by its report before the Call Trace) fits, and a crafted 10 MB line cannot make a `literal.*word` pattern quadratic
# (each occurrence of the literal rescans the rest of the line) and stall the agent.
MATCH_LIMIT = 4096


def bounded(text: str) -> str:
    """``text`` as the matchers see it: whole, or its first and last MATCH_LIMIT characters
    (the head holds a report's first line, the tail a traceback's final exception)."""
    return text if len(text) <= 2 * MATCH_LIMIT else text[:MATCH_LIMIT] + "\n" + text[-MATCH_LIMIT:]
CAUSED_BY_RE = re.compile(r"(?i)(?:caused by|due to|after|following) (?:a |the )?previous Xid[ :(]*(\d+)")


@dataclass(frozen=True, slots=True)
class Classification:
    """What one record means. ``rule`` is the catalog entry id (None: not recognised);
    ``family`` the catalog it comes from; ``reference`` where the reason comes from."""

    category: str
    severity: str
    action: str
    meaning: str
    rule: str | None
    xid: int | None = None
    fault: str = "unknown"  # the Finding kind (gpu_lost, ecc_uncorrectable, collective_timeout...)
    confidence: float = 0.5
    companion: bool = False  # reports on another record (Xid 45/154/63): ranked below it
    family: str = ""
    reference: str = ""

    @property
    def benign(self) -> bool:
        return self.action == "none" and self.severity == "info"

    def priority(self) -> tuple[int, int, int, int, int]:
        """Sort key: the most significant classification of a group is the max.

        Severity first; then a cause over a companion that reports on it; then the stronger action (a
        remap failure that retires the GPU over the DBE that asked for a reset, or over a GPU that did
        not come back up after it: the line that decides what happens to the machine); then a
        named category over none/unknown; then a machine fault over a software one
        (at equal severity the machine fault is the actionable root cause).
        """
        return (_SEV_RANK[self.severity], 0 if self.companion else 1, _ACTION_RANK.get(self.action, 0),
                0 if self.category in ("none", "unknown") else 1, 0 if self.category == "user_software" else 1)


# Per-line actions from the mildest to the strongest (most_significant: the stronger one speaks for a group).
_ACTION_RANK: dict[str, int] = {a: i for i, a in enumerate((
    LineAction.NONE, LineAction.NOTIFY, LineAction.ROLLBACK_CODE, LineAction.RESTART_JOB, LineAction.RESET_GPU,
    LineAction.RUN_DIAGNOSTICS, LineAction.EVICT_NODE))}

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
class Repeat:
    """A rule's escalation when it fires ``count`` times within ``window_s`` on one device."""

    count: int
    window_s: float
    result: Classification
    counts: re.Pattern[str] | None = None  # only lines matching it are one more event (a record's header)


@dataclass(frozen=True, slots=True)
class Rule:
    id: str
    kinds: frozenset[str]
    match: re.Pattern[str] | None
    result: Classification
    any: tuple[str, ...] = ()  # substring prefilter: the regex runs only if one occurs
    repeat: Repeat | None = None


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
    sxid: tuple[Rule, ...] = ()
    ordinary: dict[str, frozenset[str]] = field(default_factory=dict)  # family -> kinds that are everyday noise
    files: tuple[str, ...] = ()
    nvsmi: tuple[Rule, ...] = ()
    # kernel.toml [programs] ours: fnmatch patterns of the syslog/journal programs whose lines are judged as
    # kernel lines (GPU, fabric, storage, kernel, training); another program's line is kind "foreign"
    ours: tuple[str, ...] = ("*",)


def _result(entry: dict[str, Any], *, file: str, name: str, rule: str, xid: int | None = None,
            family: str = "") -> Classification:
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
    ref = entry.get("source", entry.get("source_url", ""))
    if not isinstance(ref, str) or not isinstance(entry.get("differs", ""), str):
        raise CatalogError("`source` and `differs` must be strings", file=file, entry=name)
    return Classification(entry["category"], entry["severity"], entry["action"], entry["meaning"], rule, xid,
                          str(entry.get("fault", "unknown")), float(conf), bool(entry.get("companion", False)),
                          family, ref)


def load_rules(path: Path, family: str | None = None) -> tuple[Rule, ...]:
    """An ordered rule catalog (the ``[[rule]]`` entries of kernel.toml, nccl.toml, sxid.toml)."""
    data = read_catalog(path)
    fam = family or path.stem
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
        result = _result(entry, file=str(path), name=rid, rule=rid, family=fam)
        rep = None
        if "repeat" in entry:
            r = entry["repeat"]
            if not isinstance(r, dict) or not isinstance(r.get("count"), int) or r["count"] < 2 \
                    or not isinstance(r.get("window_s"), (int, float)):
                raise CatalogError("`repeat` needs count (>= 2) and window_s", file=str(path), entry=rid)
            counts = None
            if "counts" in r:  # one event prints several lines (AER: a header, then its details): count headers
                try:
                    counts = re.compile(str(r["counts"]), re.IGNORECASE)
                except re.error as exc:
                    raise CatalogError(f"bad `repeat.counts` regex: {exc}", file=str(path), entry=rid) from None
            merged = {"category": result.category, "severity": result.severity, "action": result.action,
                      "fault": result.fault, "source": result.reference, **{k: v for k, v in r.items() if k != "counts"}}
            rep = Repeat(int(r["count"]), float(r["window_s"]),
                         _result(merged, file=str(path), name=f"{rid}.repeated", rule=f"{rid}.repeated", family=fam),
                         counts)
        rules.append(Rule(rid, frozenset(kinds), rx, result, tuple(subs), rep))
    if not rules:
        raise CatalogError("no [[rule]] entries", file=str(path))
    return tuple(rules)


def load_xid(path: Path) -> tuple[dict[int, XidEntry], dict[str, Any]]:
    data = read_catalog(path)
    out = {}
    for code_s, entry in data.get("xid", {}).items():
        name = f"xid.{code_s}"
        if not code_s.isdigit():
            raise CatalogError("Xid code must be a number", file=str(path), entry=name)
        code = int(code_s)
        out[code] = XidEntry(code, str(entry.get("name", "")),
                             _result(entry, file=str(path), name=name, rule=name, xid=code, family="xid"),
                             str(entry.get("nvidia_category", "")))
    if not out:
        raise CatalogError("no [xid.N] entries", file=str(path))
    ctx = data.get("context", {})
    for key in ("recurring_distinct_pids", "companion_window_s", "recurrence_window_s", "driver_processes", "derived"):
        if key not in ctx:
            raise CatalogError(f"[context] lacks `{key}`", file=str(path), entry="context")
    for name, val in ctx.get("recovery_actions", {}).items():
        if not (isinstance(val, list) and len(val) in (2, 3) and val[0] in LINE_ACTIONS and val[1] in SEVERITIES
                and (len(val) == 2 or (isinstance(val[2], (int, float)) and 0 <= val[2] <= 1))):
            raise CatalogError("recovery action must be [action, severity] or [action, severity, confidence]",
                               file=str(path), entry=f"context.recovery_actions.{name}")
    for code, name in ctx.get("recovery_codes", {}).items():
        if not code.isdigit() or name not in ctx.get("recovery_actions", {}):
            raise CatalogError("recovery code must be a number naming a [context.recovery_actions] entry",
                               file=str(path), entry=f"context.recovery_codes.{code}")
    return out, ctx


def _ordinary_kinds(path: Path) -> frozenset[str]:
    kinds = read_catalog(path).get("ordinary", {}).get("kinds", ["other"])
    if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
        raise CatalogError("`kinds` must be a list of kind names", file=str(path), entry="ordinary")
    return frozenset(kinds)


def _our_programs(path: Path) -> tuple[str, ...]:
    ours = read_catalog(path).get("programs", {}).get("ours", ["*"])
    if not isinstance(ours, list) or not all(isinstance(k, str) and k for k in ours):
        raise CatalogError("`ours` must be a list of program name patterns", file=str(path), entry="programs")
    return tuple(x.lower() for x in ours)


@lru_cache(maxsize=4096)
def _is_ours(program: str, ours: tuple[str, ...]) -> bool:
    name = program.split("(", 1)[0].lower()  # "sshd(pam_unix)" is sshd's PAM module
    return any(fnmatch.fnmatchcase(name, pat) for pat in ours)


def load_catalogs(directory: Path | None = None) -> Catalogs:
    """Load and validate every signature catalog (fails naming file and entry)."""
    d = directory or CATALOGS
    xid, ctx = load_xid(d / "xid.toml")
    files = ("xid.toml", "sxid.toml", "kernel.toml", "nccl.toml", "nvsmi.toml")
    return Catalogs(xid, load_rules(d / "kernel.toml", "kernel"), load_rules(d / "nccl.toml", "nccl"), ctx,
                    load_rules(d / "sxid.toml", "sxid"),
                    {"kernel": _ordinary_kinds(d / "kernel.toml"), "nccl": _ordinary_kinds(d / "nccl.toml")},
                    tuple(str(d / f) for f in files), load_rules(d / "nvsmi.toml", "nvsmi"),
                    _our_programs(d / "kernel.toml"))


@lru_cache(maxsize=1)
def catalogs() -> Catalogs:
    """The shipped catalogs, loaded once per process."""
    return load_catalogs()


def all_rules(cats: Catalogs | None = None) -> tuple[Rule, ...]:
    """Every rule of every rule family (sxid, kernel, nccl, nvsmi), in catalog order."""
    c = cats or catalogs()
    return c.sxid + c.kernel + c.nccl + c.nvsmi


def classify_nvsmi(text: str) -> Classification:
    """One normalised nvidia-smi / DCGM line (collectors/nvsmi_text.py) -> what it means."""
    r = first_rule(catalogs().nvsmi, "nvsmi", text)
    return UNRECOGNISED if r is None else r.result


# --------------------------------------------------------------------------- context


@dataclass
class ClassifyContext:
    """What the context rules remember of earlier records (bounded)."""

    max_per_gpu: int = 256
    max_keys: int = 65536
    _xids: dict[tuple[str, str], deque] = field(default_factory=dict)
    _repeats: dict[tuple[str, str, str], deque] = field(default_factory=dict)

    def recent(self, node: str, pci: str) -> deque:
        key = (node, pci)
        q = self._xids.get(key)
        if q is None:
            if len(self._xids) >= self.max_keys:
                self._xids.clear()
            q = self._xids[key] = deque(maxlen=self.max_per_gpu)
        return q

    def fired(self, key: tuple[str, str, str], ts: float, window_s: float, times: int = 1) -> int:
        """Record ``times`` firings of a rule at ``ts``; how many fell within ``window_s``."""
        q = self._repeats.get(key)
        if q is None:
            if len(self._repeats) >= self.max_keys:
                self._repeats.clear()
            q = self._repeats[key] = deque(maxlen=self.max_per_gpu)
        for _ in range(min(times, self.max_per_gpu)):
            q.append(ts)
        while q and ts - q[0] > window_s:
            q.popleft()
        return len(q)


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


def first_rule(rules: tuple[Rule, ...], kind: str, text: str) -> Rule | None:
    """The first rule of ``kind`` whose prefilter and regex match ``text`` (``bounded``)."""
    text = bounded(text)
    for r in _rules_for(rules, kind):
        if r.any:
            for sub in r.any:
                if sub in text:
                    break
            else:
                continue
        if r.match is None or r.match.search(text) is not None:
            return r
    return None


def _with(c: Classification, **changes: Any) -> Classification:
    return replace(c, **changes)


def _unknown_xid(code: int) -> Classification:
    return Classification("unknown", "warning", "notify",
                          f"Xid {code}, not in the catalog: faultlens does not know this code (newer driver, or a "
                          "vendor-specific one). Look it up in NVIDIA's Xid catalog; contact NVIDIA support if it repeats.",
                          "xid.unknown", code, "xid_unknown", 0.6, family="xid",
                          reference="https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html")


def _classify_xid(rec: KernelEvent, cats: Catalogs, ctx: ClassifyContext | None) -> Classification:
    code = rec.xid if rec.xid is not None else -1
    entry = cats.xid.get(code)
    c = _unknown_xid(code) if entry is None else entry.result
    cx = cats.context
    process = str(rec.fields.get("process") or "")
    pci = rec.pci_bus or ""
    recent = ctx.recent(rec.node, pci) if ctx is not None else deque()
    window = float(cx["companion_window_s"])
    derived = set(cx["derived"])

    if process and process in cx["driver_processes"] and c.category in (Category.GPU_HARDWARE, Category.USER_SOFTWARE):
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
    printed = cx.get("printed_severity")
    if printed and code in printed.get("codes", ()) and not (c.rule or "").endswith(".driver_process"):
        sev = PRINTED_SEVERITY_RE.search((rec.message or "")[:MATCH_LIMIT])
        if sev is not None:
            fatal = sev.group(1).lower() == "fatal"
            act, severity = printed["fatal" if fatal else "nonfatal"]
            c = _with(c, action=act, severity=severity, rule=f"xid.{code}.{'fatal' if fatal else 'nonfatal'}",
                      meaning=f"{c.meaning} The driver printed this one as {'Fatal' if fatal else 'Nonfatal'}.")
    named = CAUSED_BY_RE.search((rec.message or "")[:MATCH_LIMIT])
    if code in derived or named is not None:
        root: tuple[int, Classification] | None = None
        seen_root = True
        if named is not None and int(named.group(1)) != code:
            rc = int(named.group(1))
            prior = next((pc for (t, x, _, pc) in reversed(recent) if x == rc and abs(rec.ts - t) <= window), None)
            seen_root = prior is not None
            re_ = cats.xid.get(rc)
            root = (rc, prior if prior is not None else (re_.result if re_ is not None else _unknown_xid(rc)))
        else:
            root = next(((x, pc) for (t, x, _, pc) in reversed(recent) if x not in derived and abs(rec.ts - t) <= window), None)
        wanted, mapped = recovery_of(rec.fields.get("recovery_action"), rec.fields.get("recovery_code"), cx) \
            if code == 154 else ("", None)
        if mapped:  # the driver states what it needs: that is the action, the root gives the category
            category = root[1].category if root is not None and root[1].category not in ("none", "unknown") else "gpu_hardware"
            acts = mapped[0] != "none"
            c = _with(c, action=mapped[0], severity=mapped[1], category=category if acts else "none",
                      rule=f"xid.154.{mapped[0]}", companion=True,
                      fault="driver_recovery" if acts else c.fault,
                      confidence=float(mapped[2]) if len(mapped) > 2 else c.confidence,
                      meaning=f"The driver now requires: {wanted}. Follow it (NVIDIA's own verdict for this GPU)"
                              + (f"; Xid {root[0]} before this line is the cause." if root else "."))
        elif root is not None and named is not None and not seen_root:
            # the line names its root but the root was not seen here (another log, rotated away):
            # nothing else speaks for it, so this line carries the root's whole verdict
            x, pc = root
            c = _with(c, category=pc.category, severity="warning" if pc.severity == "critical" else pc.severity,
                      action=pc.action, rule=f"xid.{code}.caused_by", companion=False, fault=pc.fault,
                      meaning=f"Derived from Xid {x} ({pc.rule}), which this line names as its cause and which is not in "
                              f"this log: Xid {x}'s verdict applies ({pc.category}, {pc.action}).")
        elif root is not None:
            x, pc = root
            c = _with(c, category=pc.category, severity="info" if pc.severity == "info" else "warning", action="none",
                      rule=f"xid.{code}.after_xid", companion=True, fault=pc.fault,
                      meaning=f"Derived from Xid {x} ({pc.rule}: {pc.category}, {pc.action}): the driver reports on "
                              f"Xid {x}'s fault here; follow Xid {x}'s verdict, not this line.")
        elif code == 154:
            c = _with(c, category="gpu_hardware", companion=True)
    if ctx is not None:
        recent.append((rec.ts, code, rec.pid, c))
    return c


def recovery_of(wording: Any, code: Any, context: dict[str, Any] | None = None) -> tuple[str, list[Any] | None]:
    """The driver's stated GPU recovery (Xid 154's wording, or its code: the line's hex value, NVML's GPU
    recovery action field) -> (its name, [line action, severity, confidence?] from xid.toml), or ("", None)."""
    cx = context if context is not None else catalogs().context
    actions = cx.get("recovery_actions", {})
    name = str(wording or "").strip()
    if name not in actions and code is not None:
        try:
            name = str(cx.get("recovery_codes", {}).get(str(int(code)), name))
        except (TypeError, ValueError):
            pass
    mapped = actions.get(name)
    return (name, mapped) if mapped else ("", None)


def _apply_repeat(rule: Rule, rec: Any, ctx: ClassifyContext | None) -> Classification:
    rep = rule.repeat
    if rep is None or ctx is None:
        return rule.result
    fields = getattr(rec, "fields", None) or {}
    device = str(getattr(rec, "pci_bus", None) or fields.get("device_pci") or fields.get("device") or "")
    times = int(fields.get("repeated") or 1)
    if rep.counts is not None and not rep.counts.search(str(getattr(rec, "raw", "") or "")):
        times = 0  # a detail line of an event already counted: it reads the count, adds nothing
    n = ctx.fired((getattr(rec, "node", "") or "", rule.id, device), float(getattr(rec, "ts", 0.0) or 0.0),
                  rep.window_s, times)
    if n >= rep.count:
        return _with(rep.result, meaning=f"{rep.result.meaning} ({n} within {rep.window_s:.0f} s on "
                                         f"{device or 'this node'}.)")
    return rule.result


def classify(record: object, context: ClassifyContext | None = None) -> Classification:
    """Map one record (KernelEvent, NcclEvent, StepTiming, StackDump) to what it means."""
    cats = catalogs()
    if isinstance(record, KernelEvent):
        if record.kind == "xid":
            return _classify_xid(record, cats, context)
        text = record.message or record.raw
        rules = cats.sxid if record.kind == "sxid" else cats.kernel
        kind = record.kind
        program = record.fields.get("program") if kind == "other" else None
        if program and not _is_ours(str(program), cats.ours):
            kind = "foreign"  # another program's line (sshd, cron, ftpd...): info unless a rule of kind foreign says more
        r = first_rule(rules, kind, text)
        return UNRECOGNISED if r is None else _apply_repeat(r, record, context)
    if isinstance(record, NcclEvent):
        r = first_rule(cats.nccl, record.kind, record.message or record.raw)
        return UNRECOGNISED if r is None else _apply_repeat(r, record, context)
    if isinstance(record, StepTiming):
        return _classify_step(record)
    if isinstance(record, StackDump):
        if record.error:
            return Classification("unknown", "warning", "notify", f"No stack dump for this process: {record.error}.",
                                  "stacks.dump_failed", fault="stack_dump_failed", confidence=0.5, family="stacks")
        return Classification("none", "info", "none", "A stack dump of one process (all threads); compared across ranks by the stack aggregator.",
                              "stacks.dump", fault="stack_dump", family="stacks")
    return UNRECOGNISED


def is_ordinary(record: KernelEvent | NcclEvent) -> bool:
    """The agent's ship filter: an everyday record it counts instead of shipping.

    Ordinary = a kind the family's ``[ordinary]`` lists, no bad bytes, and the
    classifier finds nothing in it (benign). Context cannot change such a record's
    verdict (context rules act on recognised kinds only), so no context is needed.
    """
    cats = catalogs()
    fam = "kernel" if isinstance(record, KernelEvent) else "nccl"
    if record.kind not in cats.ordinary.get(fam, frozenset({"other"})):
        return False
    if BAD_INPUT_RE.search(record.raw) is not None:
        return False
    return classify(record).benign


def _classify_step(rec: StepTiming) -> Classification:
    for name in ("loss", "grad_norm"):
        v = getattr(rec, name)
        if v is not None and not math.isfinite(v):
            return Classification("user_software", "warning", "run_diagnostics",
                                  f"The step's {name} is {v}: numerical divergence (NaN/Inf). If no rank or machine stands out, "
                                  "check data and hyper-parameters; a single rank producing it points at its GPU.",
                                  f"steps.nonfinite_{name}", fault="nan_loss", confidence=0.7, family="steps")
    return Classification("none", "info", "none", "A training step's timing and workload.", "steps.timing", fault="step",
                          family="steps")


_SOURCES: dict[type, str] = {KernelEvent: "kernel", NcclEvent: "nccl", StepTiming: "steps", StackDump: "stacks"}


def to_finding(record: object, context: ClassifyContext | None = None) -> Finding | None:
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
    for name in ("sxid", "process", "recovery_action", "recovery_code", "peer", "device_pci", "repeated"):
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
