"""IncidentBook: signals correlated in time and by topology into per-job incidents.

A signal is one piece of evidence already resolved to an incident kind (see
policy.SignalMatcher). Signals of one kind on one node join that node's open
incident while they keep coming (bursts.BurstGrouper); a root cause mutes its
symptoms (inhibit.Inhibitor), and the muted item is recorded on the incident
that explains it, with the rule. An incident carries its category, suspects
with scores and reasons, evidence (raw lines, counters, figures, with source and
time), confidence, status and the ids of the actions taken.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from faultlens.diagnosis.bursts import Burst, BurstGrouper
from faultlens.diagnosis.decision import Decision
from faultlens.diagnosis.inhibit import Cause, Inhibitor
from faultlens.schema import Incident
from faultlens.vocabulary import INCIDENT_CATEGORY, INCIDENT_TITLE, LineAction

KIND_CATEGORY = INCIDENT_CATEGORY
# Muted symptoms kept on an incident: one entry per (kind, node, rule) with its count, the first few
# of them; later distinct ones are folded into one entry per kind (node "*"), so the list stays bounded
# however long the symptoms keep coming (a hang re-checked every tick, watchdogs from every rank).
MAX_MUTED_ENTRIES = 8
RECOVERED_KIND = "ib_link_recovered"  # policy.toml ib_link_up_kind: the link is back
KIND_TITLE = INCIDENT_TITLE
MAX_EVIDENCE = 40
# Per-line actions from the mildest to the strongest: an incident remembers the strongest its lines carried.
SEVERITY_ORDER = {"info": 0, "warning": 1, "critical": 2}
LINE_ACTION_ORDER = (LineAction.NONE, LineAction.NOTIFY, LineAction.ROLLBACK_CODE, LineAction.RESTART_JOB,
                     LineAction.RESET_GPU, LineAction.RUN_DIAGNOSTICS, LineAction.EVICT_NODE)


def stronger_line_action(a: str | None, b: str | None) -> str | None:
    """The stronger of two per-line actions (None and unknown values are weakest)."""
    rank: dict[str, int] = {v: i for i, v in enumerate(LINE_ACTION_ORDER)}
    return max((x for x in (a, b) if x is not None), key=lambda x: rank.get(x, -1), default=None)


@dataclass
class Signal:
    """One piece of evidence resolved to an incident kind."""

    ts: float
    job: str
    kind: str
    role: str  # cause | alert | symptom | job | info
    confidence: float
    rule: str
    source: str
    text: str
    node: str | None = None
    rank: int | None = None
    gpu: int | None = None
    category: str | None = None
    severity: str = "critical"
    figures: dict[str, Any] = field(default_factory=dict)
    # the per-line action of the signature the record matched (explain's verdict), when a line made it
    action: str | None = None
    signature: str | None = None  # that signature's rule id

    def evidence(self) -> dict[str, Any]:
        ev: dict[str, Any] = {"ts": self.ts, "source": self.source, "rule": self.rule, "text": self.text[:2000]}
        if self.node is not None:
            ev["node"] = self.node
        if self.rank is not None:
            ev["rank"] = self.rank
        if self.gpu is not None:
            ev["gpu"] = self.gpu
        if self.figures:
            ev["figures"] = self.figures
        return ev


def _decision_dict(d: Any) -> dict[str, Any] | None:
    if d is None:
        return None
    return {"type": str(d.type), "nodes": list(d.nodes), "reason": d.reason, "confidence": d.confidence, "plan": d.plan,
            "blame": d.blame}


@dataclass
class IncidentState:
    """The policy's working memory on one incident (typed; ``to_dict``/``from_dict`` for checkpoints).

    Every field is plain data so that an online instance can checkpoint an incident
    to its changelog topic and a new owner can restore it (issue 17).
    """

    # user_exception: normalised exception text -> the ranks that raised it
    exception_ranks: dict[str, set[int]] = field(default_factory=dict)
    # a notify decision held back while a stronger signal may still arrive (a policy.Decision)
    notify: Any = None
    # what the incident waits on before close_idle may resolve it (e.g. "hang": the stack workflow)
    pending: str | None = None
    # hang, online: the dump_stacks command sent and when
    command: str | None = None
    requested_ts: float | None = None
    # inhibition rules whose "corroborate" effect raised this incident's confidence
    corroborated_by: list[str] = field(default_factory=list)
    # a job-level incident that was acted on and now explains symptoms
    is_cause: bool = False
    # job-wide incident (diagnosis.jobwide): the nodes that reported the shared signal
    affected_nodes: list[str] = field(default_factory=list)
    # the incident this one was folded into (a node's share of a job-wide event)
    folded_into: str | None = None
    # nan_loss: the machine-search result ("culprit" | "no_culprit"), once decided
    nan_search: str | None = None
    # why no decision was taken yet (policy.Hold), shown in the summary while the incident waits
    waiting: str | None = None
    # the strongest per-line action of the signatures behind the incident's lines, and that signature
    # (route action "signature": an unclassified incident takes what its line's catalog entry says)
    line_action: str | None = None
    signature: str | None = None
    # the guard refused the remedy decided (cap, breaker, storm, confidence): the incident stays open with
    # this reason until a remedy goes out or a person closes it, never "mitigated" by the notify it got
    refused: str | None = None
    # the strongest severity of the signals behind the incident (a line's catalog severity, a counter's)
    severity: str | None = None
    # network alert: when the link came back up (a tolerated flap, resolved until it repeats)
    recovered_ts: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"exception_ranks": {k: sorted(v) for k, v in self.exception_ranks.items()},
                "notify": _decision_dict(self.notify), "pending": self.pending, "command": self.command,
                "requested_ts": self.requested_ts, "corroborated_by": list(self.corroborated_by),
                "is_cause": self.is_cause, "affected_nodes": list(self.affected_nodes),
                "folded_into": self.folded_into, "nan_search": self.nan_search, "waiting": self.waiting,
                "line_action": self.line_action, "signature": self.signature, "refused": self.refused,
                "severity": self.severity, "recovered_ts": self.recovered_ts}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> IncidentState:
        notify = d.get("notify")
        if notify is not None:

            notify = Decision(notify["type"], tuple(notify["nodes"]), notify["reason"], float(notify["confidence"]),
                              notify.get("plan"), bool(notify.get("blame", True)))
        return cls(exception_ranks={k: set(v) for k, v in (d.get("exception_ranks") or {}).items()},
                   notify=notify, pending=d.get("pending"), command=d.get("command"),
                   requested_ts=d.get("requested_ts"), corroborated_by=list(d.get("corroborated_by") or []),
                   is_cause=bool(d.get("is_cause", False)), affected_nodes=list(d.get("affected_nodes") or []),
                   folded_into=d.get("folded_into"), nan_search=d.get("nan_search"), waiting=d.get("waiting"),
                   line_action=d.get("line_action"), signature=d.get("signature"), refused=d.get("refused"),
                   severity=d.get("severity"), recovered_ts=d.get("recovered_ts"))


@dataclass
class OpenIncident:
    """An incident being worked on (mutable); ``record()`` is its published form."""

    id: str
    job: str
    kind: str
    node: str | None
    opened_ts: float
    updated_ts: float
    role: str
    status: str = "open"
    confidence: float = 0.0
    suspects: dict[str, dict[str, Any]] = field(default_factory=dict)
    evidence: list[dict[str, Any]] = field(default_factory=list)
    evidence_count: int = 0
    muted: list[dict[str, Any]] = field(default_factory=list)
    # what the guard did not let out as decided: the newest few [{ts, reason, type, nodes, text}], and counts
    suppressed: list[dict[str, Any]] = field(default_factory=list)
    suppressed_counts: dict[str, int] = field(default_factory=dict)
    actions: list[str] = field(default_factory=list)
    decided: set[str] = field(default_factory=set)  # action types already taken
    summary: str = ""
    bursts: list[Burst] = field(default_factory=list)
    state: IncidentState = field(default_factory=IncidentState)  # policy's working memory
    dirty: bool = True
    published: tuple[Any, ...] | None = None  # material state last published
    published_ts: float = float("-inf")

    def material(self) -> tuple[Any, ...]:
        """What a consumer must hear about at once; more evidence alone can wait."""
        return (self.status, self.kind, self.role, round(self.confidence, 2), tuple(self.actions), len(self.muted),
                sum(self.suppressed_counts.values()), tuple((s["node"], s["score"]) for s in self.top_suspects()))

    @property
    def category(self) -> str:
        return KIND_CATEGORY.get(self.kind, "unknown")

    def note_muted(self, kind: str, item: str, by_rule: str, ts: float, *, node: str | None = None,
                   rank: int | None = None) -> None:
        """Keep one muted symptom: counted by kind, the first few distinct ones shown (bounded)."""
        for m in self.muted:
            if m.get("kind") == kind and m.get("by_rule") == by_rule and m.get("node") in (node, "*"):
                m["count"] = int(m.get("count", 1)) + 1
                m["last_ts"] = ts
                return
        if len(self.muted) >= MAX_MUTED_ENTRIES:
            node, rank, item = "*", None, f"{kind}: further muted symptoms of this kind"
        self.muted.append({"item": item, "by_rule": by_rule, "ts": ts, "node": node, "rank": rank, "kind": kind,
                           "count": 1})
        self.dirty = True

    def muted_counts(self) -> dict[str, int]:
        """How many symptoms of each kind this incident explains."""
        counts: dict[str, int] = {}
        for m in self.muted:
            k = str(m.get("kind") or str(m.get("item", "")).split(":", 1)[0])
            counts[k] = counts.get(k, 0) + int(m.get("count", 1))
        return counts

    def alerts_within(self, now: float, window_s: float) -> int:
        return sum(1 for b in self.bursts for t in b.alerts if now - window_s <= t <= now)

    def suspect(self, node: str, score: float, reason: str, *, gpu: int | None = None, rank: int | None = None,
                prior_blames: int = 0) -> None:
        """Name ``node`` a suspect. ``prior_blames``: incidents it was blamed for before this one, as
        known when it is first named here (later this incident's own blame would count too)."""
        s = self.suspects.setdefault(node, {"node": node, "score": 0.0, "reasons": [], "gpus": [], "ranks": [],
                                            "prior_blames": prior_blames})
        s["score"] = round(max(s["score"], score), 4)
        if reason and reason not in s["reasons"] and len(s["reasons"]) < 8:
            s["reasons"].append(reason)
        if gpu is not None and gpu not in s["gpus"]:
            s["gpus"].append(gpu)
        if rank is not None and rank not in s["ranks"] and len(s["ranks"]) < 64:
            s["ranks"].append(rank)
        self.dirty = True

    def add_evidence(self, signal: Signal) -> None:
        self.evidence_count += 1
        if len(self.evidence) < MAX_EVIDENCE:
            self.evidence.append(signal.evidence())
        self.updated_ts = max(self.updated_ts, signal.ts)
        self.dirty = True

    def record_suppression(self, reason: str, text: str, *, ts: float, type_: str, nodes: tuple[str, ...] | list[str],
                           keep: int = 20) -> None:
        """The guard did not let an action out as decided: counted by reason, the newest ``keep`` listed."""
        self.suppressed_counts[reason] = self.suppressed_counts.get(reason, 0) + 1
        self.suppressed.append({"ts": ts, "reason": reason, "type": str(type_), "nodes": list(nodes)[:16],
                                "text": text[:500]})
        del self.suppressed[:-max(1, keep)]
        self.dirty = True

    def top_suspects(self) -> list[dict[str, Any]]:
        return sorted(self.suspects.values(), key=lambda s: (-s["score"], s["node"]))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable form (a checkpoint); ``from_dict`` restores it."""
        return {"id": self.id, "job": self.job, "kind": self.kind, "node": self.node, "opened_ts": self.opened_ts,
                "updated_ts": self.updated_ts, "role": self.role, "status": self.status, "confidence": self.confidence,
                "suspects": {k: dict(v) for k, v in self.suspects.items()}, "evidence": list(self.evidence),
                "evidence_count": self.evidence_count, "muted": list(self.muted), "actions": list(self.actions),
                "suppressed": list(self.suppressed), "suppressed_counts": dict(self.suppressed_counts),
                "decided": sorted(self.decided), "summary": self.summary, "state": self.state.to_dict(),
                "bursts": [{"key": list(b.key), "first_ts": b.first_ts, "last_ts": b.last_ts, "count": b.count,
                            "sources": dict(b.sources), "alerts": list(b.alerts)} for b in self.bursts]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OpenIncident:
        bursts = [Burst(tuple(b["key"]), b["first_ts"], b["last_ts"], b.get("count", 0),  # type: ignore[arg-type]
                        dict(b.get("sources") or {}), list(b.get("alerts") or [])) for b in d.get("bursts") or []]
        return cls(id=d["id"], job=d["job"], kind=d["kind"], node=d.get("node"), opened_ts=d["opened_ts"],
                   updated_ts=d["updated_ts"], role=d["role"], status=d.get("status", "open"),
                   confidence=float(d.get("confidence", 0.0)), suspects={k: dict(v) for k, v in (d.get("suspects") or {}).items()},
                   evidence=list(d.get("evidence") or []), evidence_count=int(d.get("evidence_count", 0)),
                   muted=list(d.get("muted") or []), actions=list(d.get("actions") or []),
                   suppressed=list(d.get("suppressed") or []), suppressed_counts=dict(d.get("suppressed_counts") or {}),
                   decided=set(d.get("decided") or []), summary=d.get("summary", ""),
                   bursts=bursts, state=IncidentState.from_dict(d.get("state") or {}))

    def severity(self) -> str:
        """critical for a machine fault whose signals say so or that was acted on; else warning (one verdict:
        a line explain calls a warning, such as a link flap that recovered, is not the fleet's worst incident)."""
        if self.role not in ("cause", "alert"):
            return "warning"
        acted = bool(self.actions) and bool(self.decided - {"notify"})
        return "critical" if acted or self.state.severity in (None, "critical") else "warning"

    def record(self) -> Incident:
        suspects = []
        for s in self.top_suspects():
            reason = "; ".join(s["reasons"])
            if s.get("prior_blames"):
                reason += f" (blamed in {s['prior_blames']} earlier incident(s))"
            entry = {"node": s["node"], "score": s["score"], "reason": reason}
            if s["gpus"]:
                entry["gpu"] = s["gpus"][0]
                if len(s["gpus"]) > 1:  # a machine blamed on several GPUs (a hang's root ranks): all of them
                    entry["gpus"] = sorted(s["gpus"])[:64]
            if s["ranks"]:
                entry["ranks"] = sorted(s["ranks"])
            suspects.append(entry)
        where = f" on {self.node}" if self.node else ""
        return Incident(
            id=self.id, job=self.job, opened_ts=self.opened_ts, updated_ts=self.updated_ts, status=self.status,
            category=self.category, kind=self.kind, title=KIND_TITLE.get(self.kind, self.kind) + where,
            severity=self.severity(), confidence=round(self.confidence, 4),
            suspects=suspects, evidence=list(self.evidence), muted=list(self.muted), actions=list(self.actions),
            suppressed=list(self.suppressed), suppressed_counts=dict(self.suppressed_counts), summary=self.summary or f"{self.evidence_count} signal(s)",
        )


def incident_id(job: str, kind: str, node: str | None, ts: float) -> str:
    digest = hashlib.sha1(f"{job}|{kind}|{node}|{ts:.3f}".encode()).hexdigest()[:10]
    return f"inc-{digest}"


class IncidentBook:
    """Per-job incidents: burst grouping, inhibition, suspects and evidence."""

    def __init__(self, *, burst_gap_s: float, inhibitor: Inhibitor, prior_blames: Any = None,
                 join_window_s: dict[str, float] | None = None, update_interval_s: float = 60.0):
        self.bursts = BurstGrouper(burst_gap_s)
        self.update_interval_s = update_interval_s
        self.join_window_s = join_window_s or {}  # per kind: how long an incident stays joinable (network window)
        self.inhibitor = inhibitor
        self.prior_blames = prior_blames  # callable node -> int (node health memory), or None
        self.incidents: dict[str, OpenIncident] = {}
        self._by_key: dict[tuple[str, str | None, str], str] = {}
        self.muted_count = 0

    def open_incidents(self, job: str | None = None) -> list[OpenIncident]:
        return [i for i in self.incidents.values() if i.status == "open" and (job is None or i.job == job)]

    def add(self, signal: Signal) -> OpenIncident | None:
        """File one signal; returns the incident it joined or opened, None when muted."""
        node_key = signal.node if signal.role in ("cause", "alert", "symptom", "info") else None
        if signal.role == "job":
            node_key = None
        key = (signal.job, node_key, signal.kind)
        existing_id = self._by_key.get(key)
        existing = self.incidents.get(existing_id) if existing_id else None
        if signal.kind == RECOVERED_KIND:
            self._recovered(signal)
            return None
        if existing is not None and existing.state.recovered_ts is not None and existing.status == "resolved" \
                and signal.role == "alert" \
                and not existing.actions and signal.ts - existing.updated_ts <= self.join_gap(signal.kind):
            # it flaps again (a link event; its peers' NCCL errors are symptoms, they do not reopen it)
            existing.status, existing.state.recovered_ts, existing.dirty = "open", None, True
            if existing.role in ("cause", "alert"):
                self.inhibitor.note_cause(Cause(existing.kind, existing.job, existing.node, signal.ts, existing.id))
        if existing is not None and existing.state.recovered_ts is not None and existing.status == "resolved" \
                and signal.role == "symptom" and signal.ts - existing.updated_ts <= self.join_gap(signal.kind):
            existing.add_evidence(signal)  # a peer's NCCL error on a flap that recovered: evidence, not a new fault
            existing.dirty = True
            return existing
        if existing is not None and existing.status == "open" and signal.ts - existing.updated_ts <= self.join_gap(signal.kind):
            burst, _ = self.bursts.add(signal.job, node_key, signal.kind, signal.ts, signal.rule, alert=signal.role == "alert")
            if burst not in existing.bursts:
                existing.bursts.append(burst)
            self._absorb(existing, signal)
            return existing
        muted = self.inhibitor.muted_by(signal.kind, signal.role, signal.job, signal.node, signal.ts)
        began = signal.figures.get("stall_began_ts")
        if muted is None and isinstance(began, (int, float)) and began < signal.ts:
            # A symptom printed a timeout after its stall began (a watchdog's Timeout(ms)) is muted by the fault
            # that was present when the stall began, not only by one present when it was printed.
            muted = self.inhibitor.muted_by(signal.kind, signal.role, signal.job, signal.node, float(began))
        if muted is not None:
            rule, cause = muted
            host = self.incidents.get(cause.incident_id)
            if self.inhibitor.effect(rule) == "corroborate" and host is not None and host.status == "open":
                before = host.confidence
                self._absorb(host, signal)
                host.confidence = max(host.confidence, 1.0 - (1.0 - before) * (1.0 - signal.confidence))
                host.state.corroborated_by.append(rule)
                return host
            self.muted_count += 1
            if host is not None:
                host.note_muted(signal.kind, f"{signal.kind}: {signal.text[:300]}", rule, signal.ts,
                                node=signal.node, rank=signal.rank)
            return None
        if signal.role == "info":
            return None
        burst, _ = self.bursts.add(signal.job, node_key, signal.kind, signal.ts, signal.rule, alert=signal.role == "alert")
        inc = OpenIncident(id=incident_id(signal.job, signal.kind, node_key, signal.ts), job=signal.job, kind=signal.kind,
                           node=node_key, opened_ts=signal.ts, updated_ts=signal.ts, role=signal.role, bursts=[burst])
        self.incidents[inc.id] = inc
        self._by_key[key] = inc.id
        self._absorb(inc, signal)
        if signal.role == "job":
            # A job-wide event explains per-machine symptoms from its onset, before it is decided:
            # inhibit rules name it "<kind>_onset" (a NaN on every rank mutes fail-slow verdicts of its window)
            self.inhibitor.note_cause(Cause(f"{signal.kind}_onset", signal.job, None, signal.ts, inc.id))
            self._mute_existing(inc, any_role=True)
        if signal.role in ("cause", "alert"):
            self.inhibitor.note_cause(Cause(signal.kind, signal.job, signal.node, signal.ts, inc.id))
            if signal.role == "alert" or inc.state.severity not in (None, "critical"):
                # weak until acted on (confirm_cause): a warning only asks a person to look, and a network
                # alert is tolerated until it repeats (it may come back up in seconds): neither explains a hang yet
                self.inhibitor.weaken(inc.id)
            self._mute_existing(inc)
        return inc

    def _absorb(self, inc: OpenIncident, signal: Signal) -> None:
        inc.add_evidence(signal)
        if SEVERITY_ORDER.get(signal.severity, 2) > SEVERITY_ORDER.get(inc.state.severity or "", -1):
            inc.state.severity = signal.severity
            if signal.severity == "critical" and inc.role == "cause" and inc.state.recovered_ts is None:
                self.inhibitor.strengthen(inc.id)
        if signal.action is not None:
            strongest = stronger_line_action(inc.state.line_action, signal.action)
            if strongest != inc.state.line_action:
                inc.state.line_action, inc.state.signature = strongest, signal.signature
        if signal.role in ("cause", "alert"):
            inc.confidence = max(inc.confidence, signal.confidence)
        elif inc.role not in ("cause", "alert"):
            inc.confidence = max(inc.confidence, signal.confidence)
        if signal.node is not None and signal.role != "job":
            score = signal.confidence
            known = inc.suspects.get(signal.node)
            if known is not None:
                prior = int(known.get("prior_blames") or 0)
            else:
                prior = self.prior_blames(signal.node) if self.prior_blames else 0
            reason = f"{signal.rule}: {signal.text.strip().splitlines()[0][:160] if signal.text.strip() else signal.kind}"
            if prior:
                score = min(1.0, score + 0.02 * prior)
            inc.suspect(signal.node, score, reason, gpu=signal.gpu, rank=signal.rank, prior_blames=prior)

    def _recovered(self, signal: Signal) -> None:
        """The link came back up: its open alert incident (nothing acted on yet) is a tolerated warning,
        resolved; a second down within the network window reopens it and counts as a repeat."""
        for inc in self.open_incidents(signal.job):
            if inc.kind != "ib_link" or inc.node != signal.node or inc.actions or signal.ts < inc.opened_ts:
                continue
            inc.state.recovered_ts = signal.ts
            inc.state.severity = "warning"
            inc.status, inc.dirty = "resolved", True
            self.inhibitor.weaken(inc.id)  # a tolerated flap explains no later hang or error
            inc.summary = (f"network alert not repeated: tolerated (link back up {signal.ts - inc.updated_ts:.0f} s "
                           "later)")

    def promote_cause(self, inc: OpenIncident) -> None:
        """A job-level incident that was acted on (user exception -> rollback) now explains symptoms too."""
        if inc.state.is_cause or inc.role in ("cause", "alert"):
            return
        inc.state.is_cause = True
        self.inhibitor.note_cause(Cause(inc.kind, inc.job, inc.node, inc.opened_ts, inc.id))
        self._mute_existing(inc)

    def confirm_cause(self, inc: OpenIncident) -> None:
        """A machine fault acted on beyond a notification (a warning-level hung task sent to diagnostics) is
        no longer weak: it explains the job's hang too, also one opened before it."""
        if inc.role in ("cause", "alert") and inc.state.recovered_ts is None:
            self.inhibitor.strengthen(inc.id)
            self._mute_existing(inc)

    def note_action_cause(self, inc: OpenIncident, action: str) -> None:
        """An action taken on ``inc`` explains symptoms of its own (inhibit.toml names the action type as a
        source kind: a job restarted for a crash explains the silence of its steps)."""
        self.inhibitor.note_cause(Cause(action, inc.job, inc.node, inc.opened_ts, inc.id))
        self._mute_existing(inc)

    def _mute_existing(self, cause_inc: OpenIncident, *, any_role: bool = False) -> None:
        """A new cause mutes open symptom incidents of its job that nothing has acted on yet (with ``any_role``,
        also machine verdicts a rule names: a job-wide event's onset mutes the fail-slow verdicts of its window)."""
        for other in self.open_incidents(cause_inc.job):
            if other is cause_inc or other.actions or other.state.is_cause or (
                    not any_role and other.role in ("cause", "alert")):
                continue
            muted = self.inhibitor.muted_by(other.kind, other.role, other.job, other.node, other.opened_ts,
                                            exclude_incident=other.id)
            if muted is not None and muted[1].incident_id == cause_inc.id:
                other.status = "resolved"
                other.summary = f"muted by {muted[0]}: explained by incident {cause_inc.id} ({cause_inc.kind})"
                other.dirty = True
                cause_inc.note_muted(other.kind, f"incident {other.id} ({other.kind})", muted[0], other.opened_ts,
                                     node=other.node)
                self.muted_count += 1

    def job_incident(self, job: str, kind: str, ts: float, *, role: str = "job", confidence: float = 0.5,
                     text: str = "", rule: str = "engine", source: str = "steps",
                     figures: dict[str, Any] | None = None) -> OpenIncident | None:
        """Open (or join) a job-level incident such as a hang; None when muted."""
        return self.add(Signal(ts=ts, job=job, kind=kind, role=role, confidence=confidence, rule=rule,
                               source=source, text=text or kind, figures=figures or {}))

    def join_gap(self, kind: str) -> float:
        return max(self.bursts.gap_s, self.join_window_s.get(kind, 0.0))

    def dirty(self) -> list[OpenIncident]:
        """Incidents to publish: a material change at once, new evidence alone at most
        every ``update_interval_s`` of record time (a hang's watchdog lines from every
        rank would otherwise re-publish the incident once a second)."""
        out = []
        for i in self.incidents.values():
            if not i.dirty:
                continue
            material = i.material()
            if material != i.published or i.updated_ts - i.published_ts >= self.update_interval_s:
                i.dirty = False
                i.published, i.published_ts = material, i.updated_ts
                out.append(i)
        return out

    def close_idle(self, now: float) -> list[OpenIncident]:
        """Incidents whose bursts all went quiet: resolved unless the policy still waits on them."""
        self.bursts.close_idle(now)
        closed = []
        for inc in self.open_incidents():
            if inc.state.pending or inc.state.refused or now - inc.updated_ts <= self.join_gap(inc.kind):
                continue  # a refused remedy stays open with its reason: a person decides
            if not inc.actions and inc.kind == "ib_link":
                inc.summary = inc.summary or "network alert not repeated: tolerated (link flap recovered)"
                self.inhibitor.weaken(inc.id)
            inc.status = "mitigated" if inc.actions else "resolved"
            inc.dirty = True
            closed.append(inc)
        return closed
