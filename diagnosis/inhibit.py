"""Declared inhibition: a root cause mutes its symptoms (catalogs/inhibit.toml).

Xid 79 on node N explains the watchdog timeouts every other rank prints ten
minutes later; an IB link going down explains the NCCL completion errors of its
peers. Rather than correlate by hand in code, rules name a cause's kinds and the
kinds (and roles) it mutes, the scope (same job or same node) and a time window.
A muted signal or incident records the rule that muted it.

A rule with ``effect = "corroborate"`` does not drop its target: the target
signal joins the cause's incident as more evidence and raises its confidence
(a PCIe replay storm plus the step-time detector's fail-slow finding on the same
node is one stronger incident, not one weak incident and one muted finding).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from faultlens.config import read_catalog
from faultlens.diagnosis.rules import CATALOGS
from faultlens.errors import CatalogError


@dataclass(frozen=True)
class InhibitRule:
    name: str
    source_kinds: tuple[str, ...]
    target_kinds: tuple[str, ...]
    scope: str = "job"  # job | node
    window_s: float = 1800.0
    lead_s: float = 60.0
    target_roles: tuple[str, ...] = ()
    effect: str = "mute"  # mute | corroborate


def load_weak_spares(path: Path | None = None) -> frozenset[str]:
    """``[weak] spares``: the target kinds a weak cause (a warning, or one that recovered) does not mute."""
    path = path or CATALOGS / "inhibit.toml"
    spares = read_catalog(path).get("weak", {}).get("spares", [])
    if not isinstance(spares, list) or not all(isinstance(k, str) for k in spares):
        raise CatalogError("[weak] spares must be a list of kinds", file=str(path), entry="weak")
    return frozenset(spares)


def load_inhibit_rules(path: Path | None = None) -> list[InhibitRule]:
    path = path or CATALOGS / "inhibit.toml"
    rules = []
    for i, entry in enumerate(read_catalog(path).get("rule", [])):
        name = str(entry.get("name", f"#{i}"))
        try:
            fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in entry.items()}
            rule = InhibitRule(**fields)
        except TypeError as exc:
            raise CatalogError(str(exc), file=str(path), entry=name) from None
        if rule.scope not in ("job", "node"):
            raise CatalogError(f"scope {rule.scope!r} must be job or node", file=str(path), entry=name)
        if rule.effect not in ("mute", "corroborate"):
            raise CatalogError(f"effect {rule.effect!r} must be mute or corroborate", file=str(path), entry=name)
        if not rule.source_kinds or not rule.target_kinds:
            raise CatalogError("source_kinds and target_kinds must not be empty", file=str(path), entry=name)
        rules.append(rule)
    return rules


@dataclass(frozen=True)
class Cause:
    kind: str
    job: str
    node: str | None
    ts: float
    incident_id: str
    spares: frozenset[str] = frozenset()  # target kinds this cause does not mute (it is weak: a warning, recovered)


class Inhibitor:
    """Remembers causes and answers whether a signal is muted, and by which rule."""

    def __init__(self, rules: list[InhibitRule] | None = None, weak_spares: frozenset[str] | None = None):
        self.rules = rules if rules is not None else load_inhibit_rules()
        self.weak_spares = weak_spares if weak_spares is not None else load_weak_spares()
        self._effect = {r.name: r.effect for r in self.rules}
        self._causes: list[Cause] = []

    def effect(self, rule_name: str) -> str:
        """``mute`` or ``corroborate``: what the named rule does to its target."""
        return self._effect.get(rule_name, "mute")

    def note_cause(self, cause: Cause) -> None:
        self._causes.append(cause)

    def weaken(self, incident_id: str) -> None:
        """The incident's cause is weak: only a warning for a person (a non-fatal NVSwitch error, a corrected
        error burst) or a fault that went away (a tolerated flap). It still explains the transient symptoms of
        its window, not a lasting one (``[weak] spares``: a hang is judged on its own evidence)."""
        self._set_spares(incident_id, self.weak_spares)

    def strengthen(self, incident_id: str) -> None:
        """The incident turned critical: its cause mutes every target kind again."""
        self._set_spares(incident_id, frozenset())

    def _set_spares(self, incident_id: str, spares: frozenset[str]) -> None:
        self._causes = [replace(c, spares=spares) if c.incident_id == incident_id else c for c in self._causes]

    def muted_by(self, kind: str, role: str, job: str, node: str | None, ts: float,
                 *, exclude_incident: str | None = None) -> tuple[str, Cause] | None:
        """(rule name, cause) that mutes this signal, or None."""
        for rule in self.rules:
            if kind not in rule.target_kinds or (rule.target_roles and role not in rule.target_roles):
                continue
            for cause in self._causes:
                if cause.incident_id == exclude_incident or cause.kind not in rule.source_kinds or cause.job != job:
                    continue
                if rule.scope == "node" and (node is None or cause.node != node):
                    continue
                if kind in cause.spares:
                    continue
                if cause.kind == kind and cause.node == node:
                    continue  # a cause never mutes its own kind on its own node
                if cause.ts - rule.lead_s <= ts <= cause.ts + rule.window_s:
                    return rule.name, cause
        return None

    def forget_before(self, ts: float) -> None:
        horizon = max((r.window_s for r in self.rules), default=0.0)
        self._causes = [c for c in self._causes if c.ts + horizon >= ts]
