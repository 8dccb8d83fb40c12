"""Loading parse-pattern tables (collectors/catalogs/*.toml) and the cheap prefilter.

A table is an ordered list of ``[[kind]]`` entries: ``name``, ``any`` (substrings,
at least one must occur) and ``regex``. All substrings of a table are folded into
one compiled case-insensitive prefix-trie regex so that a line that cannot match
any entry costs a single scan of its lower-cased text; only lines that pass it try the entries' regexes. A bad entry fails
at load time naming the file and the entry.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterable
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
        if self.prefilter.search(text.lower()) is None:
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
    return KindTable(str(path), tuple(kinds), prefilter_regex(s for k in kinds for s in k.any))


def prefilter_regex(substrings: Iterable[str]) -> re.Pattern[str]:
    """One regex that finds any of ``substrings`` in a LOWER-CASED text, cheaply.

    Case is folded (the prefilter may pass more than the entries' own case-sensitive
    ``any`` lists: they decide next), a substring that contains another is implied by
    it and left out, and the rest are merged into a prefix trie: Python's ``re`` tries
    alternatives one by one at every position, so a flat alternation of ~80 literals
    costs ~3x more than the trie on ordinary lines, which are most lines.
    """
    words: list[str] = []
    for w in sorted({s.lower() for s in substrings}, key=len):
        if not any(o in w for o in words):
            words.append(w)
    trie: dict = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict) -> str:
        if "" in node:
            return ""  # a shorter word ends here: it suffices
        alts = [re.escape(ch) + build(sub) for ch, sub in sorted(node.items())]
        return alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"

    return re.compile(build(trie) if words else r"(?!x)x")
