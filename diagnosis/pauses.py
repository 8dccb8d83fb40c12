"""The job's own pauses: framework lines that announce an evaluation or a checkpoint save (catalogs/pauses.toml).

Every rank stops stepping together while its framework evaluates or saves, the processes stay alive
and the GPUs keep their memory: from the steps alone that looks like a hang. The framework says so in
its log, in its own words; a matched ``begin`` line marks the pause (diagnosis.progress then waits up
to the entry's ``max_s`` before calling the silence a hang) and its ``end`` line says it is over.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from faultlens.config import read_catalog
from faultlens.diagnosis.rules import CATALOGS
from faultlens.errors import CatalogError


@dataclass(frozen=True)
class PauseRule:
    name: str
    framework: str
    begin: re.Pattern[str]
    end: re.Pattern[str] | None
    max_s: float


@dataclass(frozen=True)
class PauseLine:
    """A line that begins or ends one of the job's own pauses."""

    rule: PauseRule
    ends: bool


def load_pauses(path: Path | None = None) -> list[PauseRule]:
    """The ``[[pause]]`` entries; a bad one fails at start naming the file and the entry."""
    path = path or CATALOGS / "pauses.toml"
    rules = []
    for i, e in enumerate(read_catalog(path).get("pause", [])):
        name = str(e.get("name", f"pause#{i}"))
        try:
            begin = re.compile(str(e["begin"]))
            end = re.compile(str(e["end"])) if e.get("end") else None
            max_s = float(e["max_s"])
        except (KeyError, TypeError, ValueError, re.error) as exc:
            raise CatalogError(f"a pause needs begin (a regex), max_s (seconds) and may have end: {exc}",
                               file=str(path), entry=name) from None
        if max_s <= 0:
            raise CatalogError("max_s must be > 0", file=str(path), entry=name)
        rules.append(PauseRule(name, str(e.get("framework", "")), begin, end, max_s))
    return rules


@lru_cache(maxsize=1)
def shipped_pauses() -> tuple[PauseRule, ...]:
    return tuple(load_pauses())


def pause_line(text: str, rules: tuple[PauseRule, ...] | None = None) -> PauseLine | None:
    """The pause ``text`` begins or ends, or None (most lines: a cheap miss on the rules' regexes)."""
    for rule in shipped_pauses() if rules is None else rules:
        if rule.end is not None and rule.end.search(text):
            return PauseLine(rule, ends=True)
        if rule.begin.search(text):
            return PauseLine(rule, ends=False)
    return None
