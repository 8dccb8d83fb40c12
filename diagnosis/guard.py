"""Guard rails on automatic actions (faultlens.config.GuardConfig).

Between a policy's decision and the runner stand, in order:

1. no empty target: a node-targeted action (evict_nodes, run_diagnostics) that
   names no machine becomes a job-level one (``job_level``);
2. de-duplication: the same (job, type, nodes) within ``dedup_window_s``;
3. for evictions, a confidence floor (``min_confidence_evict``);
4. for evictions, the caps of the guard log (diagnosis.guardlog), shared by every
   decision, job and instance: per job per hour, fleet per hour, the storm
   detector, and the breakers that only a person resets.

A refused eviction becomes a ``notify`` that says why; a duplicate goes out not
at all. Either way the verdict lists each suppression with its reason (one of
``guardlog.SUPPRESSION_REASONS``), and the engine records it on the incident.

An eviction refused by a cap or a breaker is claimed again once a person has reset
the breaker (``faultlens guard reset``) while its incident is still open
(``retry_after_reset``): once per refusal, under a claim id of its own, judged by the
caps again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from faultlens.config import GuardConfig
from faultlens.diagnosis.decision import Decision
from faultlens.diagnosis.guardlog import GuardLog
from faultlens.vocabulary import ActionType

NODE_TARGETED = frozenset({ActionType.EVICT_NODES, ActionType.RUN_DIAGNOSTICS})
# Refusals a person's reset answers (a breaker was open or tripped by them); a storm is the fabric,
# a low confidence is the evidence: a reset changes neither.
RETRY_AFTER_RESET = frozenset({"breaker", "job_cap", "fleet_cap"})


@dataclass
class GuardVerdict:
    decision: Decision | None  # None: suppressed (duplicate)
    notes: list[str] = field(default_factory=list)
    storm: bool = False
    suppressed: list[tuple[str, str]] = field(default_factory=list)  # (reason, text)
    asked: Decision | None = None  # the decision as judged (made job-level when it named no machine)


def job_level(decision: Decision) -> Decision:
    """A node-targeted decision with no nodes, made job-level (docs/actions.md: those need >= 1 node).

    run_diagnostics on nobody (a hang no evidence pins): restart the job on its machines with
    stop-time diagnostics requested (plan ``{"diagnostics_requested": true}``); evict_nodes of
    nobody: a notify, since there is nothing to evict."""
    if decision.nodes or decision.type not in NODE_TARGETED:
        return decision
    if decision.type == ActionType.RUN_DIAGNOSTICS:
        return Decision("restart_job", (), f"{decision.reason} -- no machine named: restart the job on its "
                        "machines with stop-time diagnostics requested", decision.confidence,
                        {**(decision.plan or {}), "diagnostics_requested": True, "from": "run_diagnostics"},
                        blame=False)
    return Decision("notify", (), f"{decision.reason} -- no machine named: nothing to evict; a person should look",
                    decision.confidence, decision.plan, blame=False)


class Guard:
    """One engine's guard: de-duplication and the confidence floor here, the caps in the shared log."""

    def __init__(self, config: GuardConfig):
        self.config = config
        self._sent: dict[tuple[str, str, tuple[str, ...]], float] = {}

    def check(self, decision: Decision, *, job: str, now: float, job_nodes: int, log: GuardLog,
              claim_id: str, retry: str = "", evidence_age_s: float | None = None,
              max_evidence_age_s: float = 0.0) -> GuardVerdict:
        """The decision as it may go out (or None), with each suppression and its reason.

        ``claim_id`` names the eviction on the guard log (the action id: a replay claims the same);
        ``retry``: a refused eviction claimed again after a reset (``retry_after_reset``), under
        ``claim_id/retry`` and not a duplicate of its refused self; ``evidence_age_s``: how old (wall
        clock, online) the incident's newest evidence is: past ``max_evidence_age_s`` an eviction is
        refused as "stale"."""
        notes: list[str] = []
        decision = asked = job_level(decision)
        nodes = tuple(sorted(decision.nodes))
        key = (job, decision.type, nodes)
        if retry:
            claim_id = f"{claim_id}/{retry}"
        last = self._sent.get(key)
        if last is not None and now - last < self.config.dedup_window_s and not retry:
            why = f"duplicate of a {decision.type} sent {now - last:.0f} s ago"
            return GuardVerdict(None, [why], suppressed=[("duplicate", why)], asked=decision)
        suppressed: list[tuple[str, str]] = []
        storm = False
        if decision.type == ActionType.EVICT_NODES:
            refused: tuple[str, str] | None = None
            if evidence_age_s is not None and 0 < max_evidence_age_s < evidence_age_s:
                refused = ("stale", f"stale: the newest evidence is {evidence_age_s:.0f} s old, more than "
                           f"diagnosis.max_evidence_age_s {max_evidence_age_s:g} s (the pipeline is behind)")
            elif decision.confidence < self.config.min_confidence_evict:
                refused = ("confidence", f"confidence {decision.confidence:.2f} below guard.min_confidence_evict "
                           f"{self.config.min_confidence_evict:.2f}")
            else:
                claim = log.claim(claim_id, job=job, nodes=nodes, ts=now, job_nodes=job_nodes)
                if not claim.granted:
                    refused = (claim.reason, claim.text)
                    storm = claim.reason == "storm"
            if refused is not None:
                suppressed.append(refused)
                notes.append(refused[1])
                if storm:
                    decision = Decision("notify", decision.nodes, f"fabric-level {refused[1]}; not evicting "
                                        f"({decision.reason})", decision.confidence, decision.plan)
                else:
                    decision = Decision("notify", decision.nodes, f"{decision.reason} -- not evicted: {refused[1]}",
                                        decision.confidence, decision.plan)
        self._sent[(job, decision.type, tuple(sorted(decision.nodes)))] = now
        self._sent[key] = now
        return GuardVerdict(decision, notes, storm=storm, suppressed=suppressed, asked=asked)


def retry_after_reset(inc: Any, log: GuardLog, now: float) -> tuple[Decision, str] | None:
    """The eviction the caps or a breaker refused on the open incident ``inc``, to claim again now that
    no breaker is open in its scope (one closes only by a person's reset), with the retry's name
    (deterministic: a replay after a restore claims the same and gets its first verdict back).
    None when there is none. Each refusal is retried once; a refusal of the retry waits for the
    next reset."""
    if inc.status != "open" or not RETRY_AFTER_RESET & inc.suppressed_counts.keys():
        return None
    pending = [s for s in inc.suppressed if s.get("type") == ActionType.EVICT_NODES
               and s.get("reason") in RETRY_AFTER_RESET and not s.get("retried") and s.get("nodes")]
    if not pending:
        return None
    log.refresh()  # a reset written by `faultlens guard reset` since the last read
    if log.book.fleet_breaker is not None or inc.job in log.book.job_breakers:
        return None
    for s in pending:
        s["retried"] = True
    refused = pending[-1]
    n = sum(inc.suppressed_counts.get(r, 0) for r in RETRY_AFTER_RESET)
    inc.dirty = True
    inc.updated_ts = max(inc.updated_ts, now)  # a new version of the incident: the lake's latest shows the retry
    return (Decision(ActionType.EVICT_NODES, tuple(refused["nodes"]),
                     f"retried after a guard reset (refused: {str(refused.get('text', ''))[:200]})", inc.confidence),
            f"retry{n}")
