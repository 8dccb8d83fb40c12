"""Remediation policy (catalogs/policy.toml): which incident kind a record signals, and what to do.

Two halves, both data:

* ``SignalMatcher``: a raw record (kernel/NCCL line) or a finding (counter rule,
  detector) -> a ``Signal`` of one incident kind with a role and a confidence.
  Matching uses the parser's fields (Xid, record kind) and a regex on the raw
  text, so it does not depend on how a line was explained.
* ``Policy.decide``: an incident -> a ``Decision`` (action type, nodes, reason,
  confidence), ByteRobust's routing: an explicit machine fault with high
  confidence is evicted at once; network alerts are tolerated until repeated
  (two within five minutes); the same Python exception on most ranks is rolled
  back, never evicted; a hang is demarcated from stacks; NaN loss with no
  culprit goes to stop-time diagnostics; anything uncertain is a notification.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from faultlens.config import read_catalog
from faultlens.diagnosis.decision import Decision, Hold
from faultlens.diagnosis.incidents import OpenIncident, Signal
from faultlens.diagnosis.jobwide import JobWideRule, load_jobwide
from faultlens.diagnosis.rules import CATALOGS
from faultlens.errors import CatalogError
from faultlens.schema import ACTION_TYPES, Finding, KernelEvent, NcclEvent
from faultlens.vocabulary import ActionType, LineAction, Severity

# A route's action: an action type, "stacks" (the hang workflow), "none", or "signature": the action
# of the catalog entry that explained the incident's line (explain's per-line verdict), mapped below.
SIGNATURE = "signature"
ROUTE_ACTIONS = (*ACTION_TYPES, "stacks", "none", SIGNATURE)
# A per-line action (what explain says to do about a line) as what the runner is told to do. Resetting a
# GPU needs the node drained first: stop-time checks on it. Rolling back code is never decided from one
# kernel line: a person looks.
SIGNATURE_ACTION: dict[str, ActionType] = {
    LineAction.EVICT_NODE: ActionType.EVICT_NODES,
    LineAction.RUN_DIAGNOSTICS: ActionType.RUN_DIAGNOSTICS,
    LineAction.RESET_GPU: ActionType.RUN_DIAGNOSTICS,
    LineAction.RESTART_JOB: ActionType.RESTART_JOB,
    LineAction.ROLLBACK_CODE: ActionType.NOTIFY,
    LineAction.NOTIFY: ActionType.NOTIFY,
    LineAction.NONE: ActionType.NOTIFY,
}
ROLES = ("cause", "alert", "symptom", "job", "info", "note")  # note: diagnosis.notes
SOURCES = ("kernel", "nccl", "gpu", "steps", "stacks", "model")


@dataclass(frozen=True)
class SignalRule:
    name: str
    source: str
    role: str
    confidence: float
    kind: str | None = None
    xid: tuple[int, ...] = ()
    record_kind: tuple[str, ...] = ()
    finding_kind: tuple[str, ...] = ()
    pattern: re.Pattern[str] | None = None
    # a finding's own per-line action and rule become the incident's (as a log line's do): its action below
    # the eviction floor is stop-time checks, not notify (NVML's GPU recovery action field)
    line_action: bool = False


@dataclass(frozen=True)
class Route:
    kind: str
    action: str
    min_confidence: float = 0.0
    repeat: int = 1
    window_s: float = 300.0
    min_rank_fraction: float = 0.5
    # the action when the job's hang is rooted by its stacks on this incident's machine (diagnosis.workflows.hang)
    rooted_action: str | None = None


@dataclass
class PolicyCatalog:
    signals: list[SignalRule]
    routes: dict[str, Route]
    steps: dict[str, float] = field(default_factory=dict)
    jobwide: list[JobWideRule] = field(default_factory=list)
    nan_patterns: re.Pattern[str] | None = None  # log lines that say a rank's loss/gradients went bad
    # [recovery]: an incident an Xid of after_xids opened waits wait_s for the driver's stated recovery (Xid 154)
    recovery_wait_s: float = 0.0
    recovery_after_xids: frozenset[int] = frozenset()


def load_policy(path: Path | None = None, *, network_alerts_to_evict: int | None = None,
                network_window_s: float | None = None) -> PolicyCatalog:
    """Load policy.toml; a bad entry fails naming file and entry."""
    path = path or CATALOGS / "policy.toml"
    data = read_catalog(path)
    signals = []
    for i, entry in enumerate(data.get("signal", [])):
        name = str(entry.get("name", f"#{i}"))
        e = dict(entry)
        try:
            pattern = re.compile(e.pop("pattern"), re.IGNORECASE) if "pattern" in e else None
            for k in ("xid", "record_kind", "finding_kind"):
                if k in e:
                    e[k] = tuple(e[k])
            rule = SignalRule(pattern=pattern, **e)
        except (TypeError, re.error) as exc:
            raise CatalogError(str(exc), file=str(path), entry=name) from None
        if rule.source not in SOURCES:
            raise CatalogError(f"source {rule.source!r} not in {SOURCES}", file=str(path), entry=name)
        if rule.role not in ROLES:
            raise CatalogError(f"role {rule.role!r} not in {ROLES}", file=str(path), entry=name)
        if rule.kind is None and not rule.finding_kind:
            raise CatalogError("a signal needs kind (or finding_kind to keep the finding's kind)", file=str(path), entry=name)
        signals.append(rule)
    routes = {}
    for kind, entry in data.get("route", {}).items():
        try:
            route = Route(kind=kind, **entry)
        except TypeError as exc:
            raise CatalogError(str(exc), file=str(path), entry=f"route.{kind}") from None
        if route.action not in ROUTE_ACTIONS:
            raise CatalogError(f"action {route.action!r} not in {ROUTE_ACTIONS}", file=str(path), entry=f"route.{kind}")
        if route.rooted_action is not None and route.rooted_action not in ACTION_TYPES:
            raise CatalogError(f"rooted_action {route.rooted_action!r} not in {ACTION_TYPES}", file=str(path),
                               entry=f"route.{kind}")
        routes[kind] = route
    for s in signals:
        if s.kind and s.kind not in routes and s.role not in ("info", "note"):
            raise CatalogError(f"kind {s.kind!r} has no [route.{s.kind}]", file=str(path), entry=s.name)
    if "ib_link" in routes and (network_alerts_to_evict is not None or network_window_s is not None):
        r = routes["ib_link"]
        routes["ib_link"] = replace(r, repeat=network_alerts_to_evict if network_alerts_to_evict is not None else r.repeat,
                                    window_s=network_window_s if network_window_s is not None else r.window_s)
    jobwide = load_jobwide(list(data.get("jobwide", [])), path)
    for jw in jobwide:
        if jw.kind not in routes:
            raise CatalogError(f"kind {jw.kind!r} has no [route.{jw.kind}]", file=str(path), entry=jw.name)
    nan_patterns = None
    if data.get("nan", {}).get("patterns"):
        try:
            nan_patterns = re.compile("|".join(f"(?:{p})" for p in data["nan"]["patterns"]), re.IGNORECASE)
        except re.error as exc:
            raise CatalogError(str(exc), file=str(path), entry="nan.patterns") from None
    rec = data.get("recovery", {})
    try:
        wait_s, after = float(rec.get("wait_s", 0.0)), frozenset(int(x) for x in rec.get("after_xids", ()))
    except (TypeError, ValueError) as exc:
        raise CatalogError(str(exc), file=str(path), entry="recovery") from None
    return PolicyCatalog(signals, routes, dict(data.get("steps", {})), jobwide, nan_patterns, wait_s, after)


# Per-line actions that say: act on this machine (an eviction below its confidence becomes stop-time checks).
_MACHINE_LINE_ACTIONS = frozenset({LineAction.EVICT_NODE, LineAction.RUN_DIAGNOSTICS, LineAction.RESET_GPU})
# Per-line actions that make an unmatched kernel line an incident of its own (notify-only lines do not).
_KERNEL_ACTIONABLE = frozenset({LineAction.EVICT_NODE, LineAction.RUN_DIAGNOSTICS, LineAction.RESET_GPU,
                                LineAction.RESTART_JOB})


def unmatched_but_actionable(record: KernelEvent | NcclEvent, finding: Finding) -> bool:
    """A line no policy signal took that still asks for an action: any actionable kernel signature, a
    critical eviction from an NCCL/torch line."""
    if isinstance(record, KernelEvent):
        return finding.action in _KERNEL_ACTIONABLE
    return finding.severity == Severity.CRITICAL and finding.action == LineAction.EVICT_NODE


class SignalMatcher:
    """Resolves records and findings to incident signals (first matching rule wins)."""

    def __init__(self, rules: list[SignalRule]):
        self.rules = rules

    def match_record(self, record: KernelEvent | NcclEvent, job: str, *, finding: Finding | None = None,
                     rank: int | None = None) -> Signal | None:
        source = "kernel" if isinstance(record, KernelEvent) else "nccl"
        xid = getattr(record, "xid", None)
        for rule in self.rules:
            if rule.source != source:
                continue
            if rule.xid and xid not in rule.xid:
                continue
            if rule.record_kind and record.kind not in rule.record_kind:
                continue
            if rule.pattern is not None and not rule.pattern.search(record.raw):
                continue
            # finding_kind on a log record: the classifier's verdict (faultlens.collectors.signatures), the same
            # one explain and the agent's ship filter use, instead of a second reading of the text
            if rule.finding_kind and (finding is None or finding.kind not in rule.finding_kind):
                continue
            if not (rule.xid or rule.record_kind or rule.pattern or rule.finding_kind):
                continue
            return Signal(
                ts=record.ts, job=job, kind=rule.kind or record.kind, role=rule.role,
                confidence=rule.confidence if rule.confidence >= 0 or finding is None else finding.confidence,
                rule=f"policy:{rule.name}", source=source, text=record.raw, node=record.node,
                rank=rank if rank is not None else record.rank, gpu=getattr(record, "gpu", None),
                category=finding.category if finding else None,
                severity=finding.severity if finding else "critical",
                figures={"xid": xid} if xid is not None else {},
                action=finding.action if finding else None, signature=finding.rule if finding else None,
            )
        return None

    def match_finding(self, finding: Finding, job: str) -> Signal | None:
        source = "model" if finding.source.startswith("model") else finding.source
        for rule in self.rules:
            if rule.source != source or not rule.finding_kind or finding.kind not in rule.finding_kind:
                continue
            return Signal(
                ts=finding.ts, job=finding.job or job, kind=rule.kind or finding.kind, role=rule.role,
                confidence=finding.confidence if rule.confidence < 0 else rule.confidence,
                rule=finding.rule, source=finding.source, text=finding.text, node=finding.node, rank=finding.rank,
                gpu=finding.gpu, category=finding.category, severity=finding.severity, figures=dict(finding.figures),
                action=finding.action if rule.line_action else None,
                signature=finding.rule if rule.line_action else None,
            )
        return None


class Policy:
    """Routes an incident to a decision; returns None while the route is still waiting (a Hold says why)."""

    def __init__(self, catalog: PolicyCatalog):
        self.catalog = catalog

    def route(self, kind: str) -> Route:
        return self.catalog.routes.get(kind) or self.catalog.routes.get("unclassified") or Route(kind, "notify")

    def decide(self, inc: OpenIncident, now: float, *, world_size: int | None = None,
               final: bool = False) -> Decision | Hold | None:
        route = self.route(inc.kind)
        by_signature = route.action == SIGNATURE
        if by_signature:
            route = self._signature_route(inc, route)
        suspects = inc.top_suspects()
        top_nodes = _top_nodes(suspects)
        conf = inc.confidence
        if route.action == "none":
            return None
        if route.action == "stacks":
            return None  # the engine runs the stack workflow and calls decide_hang
        if inc.kind == "user_exception" or route.action == "rollback_code":
            return self._decide_exception(inc, route, world_size)
        if route.repeat > 1:
            alerts = inc.alerts_within(now, route.window_s)
            if alerts < route.repeat:
                return None  # tolerated until repeated (NICs and switches flap and recover)
            return Decision("evict_nodes", top_nodes, f"{alerts} network alerts within {route.window_s:.0f} s on "
                            f"{', '.join(top_nodes)}", conf)
        if route.action == "evict_nodes":
            if conf < route.min_confidence and top_nodes and inc.state.line_action in _MACHINE_LINE_ACTIONS:
                if not final and self._awaits_recovery(inc, now):  # the input's end: nothing more will come
                    return Hold(f"waiting {self.catalog.recovery_wait_s:.0f} s for the driver's stated recovery (Xid 154)")
                # One verdict: the line's catalog entry says act on this machine; below the confidence to
                # evict, the machine is drained for stop-time checks (what explain's reset_gpu means here).
                return Decision("run_diagnostics", top_nodes, f"{inc.kind} below the confidence to evict "
                                f"({conf:.2f} < {route.min_confidence:.2f}); signature {inc.state.signature} says "
                                f"{inc.state.line_action}: stop-time diagnostics on {', '.join(top_nodes)}", conf)
            if conf < route.min_confidence or not top_nodes:
                return Decision("notify", top_nodes, f"{inc.kind} below the confidence to evict "
                                f"({conf:.2f} < {route.min_confidence:.2f})", conf)
            what = f"{inc.kind}: signature {inc.state.signature}" if by_signature else inc.kind
            return Decision("evict_nodes", top_nodes, f"explicit machine fault ({what}) on {', '.join(top_nodes)}", conf)
        if conf < route.min_confidence:
            return Decision("notify", top_nodes, f"{inc.kind} uncertain ({conf:.2f})", conf)
        reasons: dict[str, str] = {
            ActionType.RESTART_JOB: f"{inc.kind}: transient or process-level fault, restart in place",
            ActionType.RUN_DIAGNOSTICS: f"{inc.kind}: no clear culprit, run stop-time diagnostics",
            ActionType.NOTIFY: f"{inc.kind}: a person should look",
        }
        reason = reasons.get(route.action, inc.kind)
        if by_signature:
            reason += f" (signature {inc.state.signature} says {inc.state.line_action})"
        return Decision(route.action, top_nodes, reason, conf)

    def _awaits_recovery(self, inc: OpenIncident, now: float) -> bool:
        """An Xid the driver follows with its stated recovery (Xid 154 within the second: 109, 119, 120, 62...)
        opened this incident: the 154 decides it (a reboot evicts, a reset drains for checks), so the
        weaker decision waits ``[recovery] wait_s`` for it instead of going first."""
        sig = inc.state.signature or ""
        if not sig.startswith("xid.") or now - inc.opened_ts >= self.catalog.recovery_wait_s:
            return False
        code = sig.split(".")[1]
        return code.isdigit() and int(code) in self.catalog.recovery_after_xids

    @staticmethod
    def _signature_route(inc: OpenIncident, route: Route) -> Route:
        """Route action "signature": the incident's line's catalog entry says what to do (the strongest
        per-line action among its lines); the route's confidence floor still applies, then the guard."""
        action = SIGNATURE_ACTION.get(inc.state.line_action or LineAction.NOTIFY, ActionType.NOTIFY)
        return Route(kind=route.kind, action=action, min_confidence=route.min_confidence,
                     window_s=route.window_s, min_rank_fraction=route.min_rank_fraction)

    def _decide_exception(self, inc: OpenIncident, route: Route, world_size: int | None) -> Decision | None:
        ranks: dict[str, set[int]] = inc.state.exception_ranks
        if not ranks:
            return None
        text, holders = max(ranks.items(), key=lambda kv: len(kv[1]))
        # The share among the ranks that raised a user-code exception at all (policy.toml): launchers
        # kill the other ranks once one fails, so a real log holds a traceback from one rank per
        # node, or from one rank only, far more often than from every rank of the job.
        reporting = set().union(*ranks.values())
        fraction = len(holders) / max(len(reporting), 1)
        if fraction >= route.min_rank_fraction:
            of_world = f" of {world_size}" if world_size else ""
            return Decision("rollback_code", (), f"the same exception on {len(holders)}{of_world} rank(s), "
                            f"{len(holders)}/{len(reporting)} of those that raised one: {text[:200]} "
                            "(user code, never evict)", max(route.min_confidence, min(0.99, fraction)))
        return None

    def decide_nan(self, inc: OpenIncident, culprits: dict[str, str], job_nodes: list[str]) -> Decision:
        """NaN/Inf loss: stop-time checks on the machine that went first (or has ECC/Xid evidence), else
        on every machine of the job (possible silent data corruption); never no action."""
        if culprits:
            nodes = tuple(sorted(culprits))
            why = "; ".join(f"{n}: {r}" for n, r in sorted(culprits.items()))
            return Decision("run_diagnostics", nodes, f"NaN/Inf loss with a machine to suspect ({why}): stop-time "
                            "checks on it (possible silent data corruption)", max(inc.confidence, 0.8))
        why = inc.state.nan_search or "no rank went bad first and no ECC/Xid evidence in the window"
        return Decision("run_diagnostics", tuple(job_nodes), f"NaN/Inf loss and no machine to blame ({why}): "
                        f"stop-time checks on the job's {len(job_nodes)} machine(s) before blaming the code",
                        max(inc.confidence, 0.6), blame=False)

    def decide_hang(self, inc: OpenIncident, verdict: Any | None, *, stacks_expected: bool,
                    max_nodes: int | None = None, lagging_nodes: tuple[str, ...] = ()) -> Decision:
        """After stacks were aggregated (or none came): evict the demarcated group, else diagnose.

        When the group holding every outlier is larger than ``max_nodes`` (what the guard rails would
        allow), the odd one out among the outliers (a stack no other rank shares) is evicted instead.
        """
        if verdict is not None and verdict.demarcation is not None:
            d = verdict.demarcation
            narrowed = ""
            if max_nodes is not None and len(d.nodes) > max_nodes and verdict.narrowed is not None \
                    and len(verdict.narrowed.nodes) <= max_nodes:
                narrowed = (f" (the whole {d.label} group is {len(d.nodes)} machines, over the blast radius; "
                            f"narrowed to the odd stack's {verdict.narrowed.label} group)")
                d = verdict.narrowed
            return Decision("evict_nodes", tuple(d.nodes),
                            f"stack aggregation: outlier ranks {_ranges(verdict.outliers)} lie in one "
                            f"{verdict.demarcation.label} group; over-evicting {len(d.nodes)} machine(s){narrowed}", 0.9,
                            plan={"group": d.label, "group_ranks": list(d.ranks), "outliers": verdict.outliers,
                                  "missing": verdict.missing})
        if verdict is not None and not verdict.outliers:
            return Decision("notify", (), "hang, but every rank shows the same stack: no machine to blame", 0.5)
        if verdict is not None:
            return Decision("run_diagnostics", (), f"hang with {len(verdict.outliers)} outlier ranks in no single "
                            "parallel group: stop-time diagnostics", 0.5)
        why = "no stacks were collected" if stacks_expected else "no stacks in the input"
        if lagging_nodes:
            return Decision("run_diagnostics", lagging_nodes, f"hang ({why}); the ranks that stopped first are on "
                            f"{', '.join(lagging_nodes)}: stop-time diagnostics there", 0.5)
        return Decision("run_diagnostics", (), f"hang ({why}): stop-time diagnostics rather than a guess", 0.5)


def _top_nodes(suspects: list[dict[str, Any]]) -> tuple[str, ...]:
    if not suspects:
        return ()
    best = suspects[0]["score"]
    return tuple(s["node"] for s in suspects if s["score"] >= best - 1e-9)


def _ranges(ranks: list[int]) -> str:
    if not ranks:
        return "-"
    out: list[str] = []
    start = prev = ranks[0]
    for r in ranks[1:]:
        if r != prev + 1:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = r
        prev = r
    out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(out)
