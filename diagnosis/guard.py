"""Guard rails on automatic actions (faultlens.config.GuardConfig).

Between a policy's decision and the runner stand: a confidence threshold for
evictions, de-duplication, a blast-radius cap (K nodes per job per hour and a
share P of the job's nodes, always allowing one), a storm detector (many nodes
blamed at once is the fabric, not the machines: one fabric-level notify, never
mass eviction), a circuit breaker that only a person resets, and dry-run by
default. A guarded eviction becomes a ``notify`` that says why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from faultlens.config import GuardConfig
from faultlens.diagnosis.policy import Decision


@dataclass
class GuardVerdict:
    decision: Decision | None  # None: suppressed (duplicate)
    notes: list[str] = field(default_factory=list)
    storm: bool = False


class Guard:
    def __init__(self, config: GuardConfig):
        self.config = config
        self._sent: dict[tuple[str, str, tuple[str, ...]], float] = {}
        self._evicted: dict[str, list[tuple[float, str]]] = {}  # job -> [(ts, node)]
        self._blamed: list[tuple[float, str, str]] = []  # (ts, job, node) primary suspects of evictions
        self.breaker_open = False
        self.breaker_reason = ""

    def reset_breaker(self) -> None:
        """A person looked at what tripped it and lets automatic evictions resume."""
        self.breaker_open = False
        self.breaker_reason = ""

    def check(self, decision: Decision, *, job: str, now: float, job_nodes: int) -> GuardVerdict:
        notes: list[str] = []
        nodes = tuple(sorted(decision.nodes))
        key = (job, decision.type, nodes)
        last = self._sent.get(key)
        if last is not None and now - last < self.config.dedup_window_s:
            return GuardVerdict(None, [f"duplicate of an action sent {now - last:.0f} s ago"])
        if decision.type == "evict_nodes":
            downgrade = None
            if self.breaker_open:
                downgrade = f"circuit breaker open ({self.breaker_reason}); a person must reset it"
            elif decision.confidence < self.config.min_confidence_evict:
                downgrade = (f"confidence {decision.confidence:.2f} below guard.min_confidence_evict "
                             f"{self.config.min_confidence_evict:.2f}")
            else:
                window = self.config.storm_window_s
                self._blamed = [b for b in self._blamed if now - b[0] <= window]
                blamed = {b[2] for b in self._blamed} | ({nodes[0]} if nodes else set())
                if len(blamed) >= self.config.storm_nodes:
                    self.breaker_open = True
                    self.breaker_reason = f"storm: {len(blamed)} nodes blamed within {window:.0f} s"
                    return GuardVerdict(Decision("notify", nodes, f"fabric-level storm: {len(blamed)} nodes blamed within "
                                                 f"{window:.0f} s; not evicting ({decision.reason})", decision.confidence),
                                        [self.breaker_reason], storm=True)
                recent = [e for e in self._evicted.get(job, []) if now - e[0] <= 3600.0]
                already = {n for _, n in recent}
                new = [n for n in nodes if n not in already]
                cap_fraction = max(1, math.floor(self.config.max_evicted_fraction * max(job_nodes, 1)))
                total = len(already) + len(new)
                if total > self.config.max_evictions_per_job_per_hour:
                    downgrade = (f"blast radius: {total} nodes in an hour > guard.max_evictions_per_job_per_hour "
                                 f"{self.config.max_evictions_per_job_per_hour}")
                elif len(new) > 1 and total > cap_fraction:
                    downgrade = (f"blast radius: {total} of {job_nodes} nodes > guard.max_evicted_fraction "
                                 f"{self.config.max_evicted_fraction:.0%}")
                if downgrade and downgrade.startswith("blast"):
                    self.breaker_open = True
                    self.breaker_reason = downgrade
            if downgrade:
                notes.append(downgrade)
                decision = Decision("notify", decision.nodes, f"{decision.reason} -- not evicted: {downgrade}",
                                    decision.confidence, decision.plan)
            else:
                self._evicted.setdefault(job, []).extend((now, n) for n in nodes)
                if nodes:
                    self._blamed.append((now, job, nodes[0]))
        self._sent[(job, decision.type, tuple(sorted(decision.nodes)))] = now
        self._sent[key] = now
        return GuardVerdict(decision, notes)
