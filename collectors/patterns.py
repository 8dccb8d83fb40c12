"""Loading parse-pattern tables (collectors/catalogs/*.toml) and the cheap prefilter.

A table is an ordered list of ``[[kind]]`` entries: ``name``, ``any`` (substrings,
at least one must occur) and ``regex``. All substrings of a table are folded into
one compiled alternation so that a line that cannot match any entry costs a
single scan; only lines that pass it try the entries' regexes. A bad entry fails
at load time naming the file and the entry.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from faultlens.errors import CatalogError

CATALOGS = Path(__file__).resolve().parent / "catalogs"


@dataclass(frozen=True, slots=True)
class KindPattern:
    name: str
    any: tuple[str, ...]
    regex: re.Pattern[str]

    def search(self, text: str) -> re.Match[str] | None:
        for s in self.any:
            if s in text:
                return self.regex.search(text)
        return None


@dataclass(frozen=True, slots=True)
class KindTable:
    """An ordered pattern table with its one-scan prefilter."""

    file: str
    kinds: tuple[KindPattern, ...]
    prefilter: re.Pattern[str]

    def match(self, text: str) -> tuple[str, re.Match[str] | None]:
        """(kind, match) of the first entry that matches, ``("other", None)`` otherwise."""
        if self.prefilter.search(text) is None:
            return "other", None
        for k in self.kinds:
            m = k.search(text)
            if m is not None:
                return k.name, m
        return "other", None


def load_kind_table(path: Path) -> KindTable:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise CatalogError("pattern file not found", file=str(path)) from None
    except tomllib.TOMLDecodeError as exc:
        raise CatalogError(f"not valid TOML: {exc}", file=str(path)) from None
    kinds = []
    seen: set[str] = set()
    for i, entry in enumerate(data.get("kind", [])):
        name = entry.get("name") or f"#{i}"
        if not isinstance(entry.get("name"), str):
            raise CatalogError("entry has no name", file=str(path), entry=name)
        subs = entry.get("any")
        if not subs or not all(isinstance(s, str) and s for s in subs):
            raise CatalogError("`any` must be a non-empty list of substrings", file=str(path), entry=name)
        try:
            rx = re.compile(entry["regex"])
        except (KeyError, re.error) as exc:
            raise CatalogError(f"bad regex: {exc}", file=str(path), entry=name) from None
        if name in seen:
            name = f"{name}"  # several entries may share a kind name; order still decides
        seen.add(name)
        kinds.append(KindPattern(name, tuple(subs), rx))
    if not kinds:
        raise CatalogError("no [[kind]] entries", file=str(path))
    all_subs = sorted({s for k in kinds for s in k.any}, key=len, reverse=True)
    prefilter = re.compile("|".join(re.escape(s) for s in all_subs))
    return KindTable(str(path), tuple(kinds), prefilter)
