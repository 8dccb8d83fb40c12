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
    """An ordered pattern table with its one-scan prefilter.

    ``ordinary_kinds``: kinds that are everyday noise (the agent counts them instead of
    shipping them); ``noteworthy``: a regex that makes an ordinary record worth shipping
    anyway (an error word no kind recognises), with ``noteworthy_any`` its substrings
    (lower case) for the ordinary-line fast path (``hot_regex``).
    """

    file: str
    kinds: tuple[KindPattern, ...]
    prefilter: re.Pattern[str]
    ordinary_kinds: frozenset[str] = frozenset({"other"})
    noteworthy: re.Pattern[str] | None = None
    noteworthy_any: tuple[str, ...] = ()

    def is_ordinary(self, kind: str, message: str, raw: str) -> bool:
        """An everyday record: an ordinary kind, no error word, no bad bytes (those are kept)."""
        if kind not in self.ordinary_kinds or BAD_INPUT_RE.search(raw) is not None:
            return False
        return self.noteworthy is None or self.noteworthy.search(message) is None

    def words(self) -> list[str]:
        """Every substring (lower case) that can make a line anything but ordinary."""
        return [s.lower() for k in self.kinds for s in k.any] + [s.lower() for s in self.noteworthy_any]

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
    ordinary = data.get("ordinary", {})
    okinds = ordinary.get("kinds", ["other"])
    if not isinstance(okinds, list) or not all(isinstance(k, str) for k in okinds):
        raise CatalogError("`kinds` must be a list of kind names", file=str(path), entry="ordinary")
    nw_any = ordinary.get("noteworthy_any", [])
    if not isinstance(nw_any, list) or not all(isinstance(x, str) and x for x in nw_any):
        raise CatalogError("`noteworthy_any` must be a list of non-empty substrings", file=str(path), entry="ordinary")
    nw = None
    if "noteworthy" in ordinary:
        try:
            nw = re.compile(ordinary["noteworthy"])
        except (re.error, TypeError) as exc:
            raise CatalogError(f"bad `noteworthy` regex: {exc}", file=str(path), entry="ordinary") from None
        if not nw_any:
            raise CatalogError("`noteworthy` needs `noteworthy_any` (its substrings, for the fast path)", file=str(path),
                               entry="ordinary")
    return KindTable(str(path), tuple(kinds), prefilter_regex(s for k in kinds for s in k.any), frozenset(okinds), nw,
                     tuple(nw_any))


# Bytes that are not text: an undecodable byte (U+FFFD after decoding) or a control
# character. A line carrying one is bad input: kept and shipped, never counted away.
BAD_INPUT_RE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ufffd]")


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


# Letters rarely seen in log text, rarest first: a word that holds one is only
# looked for when its letter occurs in the line.
_RARE = "zqjxkvwybgf"


class HotFilter:
    """Finds whether a LOWER-CASED line holds any of many words, at ~1 µs a line.

    ``search(text)`` returns True or None (like ``re.Pattern.search`` for ``is None``
    tests). Python's ``re`` costs 30-80 ns per position for an alternation of ~100
    words, i.e. several µs for a kernel line; ``str.__contains__`` is a C scan. So
    words are grouped under their rarest letter, and each group is tried only when
    its letter occurs; words without a rare letter are tried one by one. ``anchored``
    regexes (each with a literal that must occur; ``^...``: at the start) and bad
    bytes are checked too.
    """

    def __init__(self, words: Iterable[str], anchored: Iterable[tuple[str, str]] = ()):
        kept: list[str] = []
        for w in sorted({x.lower() for x in words}, key=len):
            if not any(o in w for o in kept):
                kept.append(w)
        groups: dict[str, list[str]] = {}
        plain: list[str] = []
        for w in kept:
            c = next((r for r in _RARE if r in w), None)
            if c is None or c == w:
                plain.append(w)
            else:
                groups.setdefault(c, []).append(w)
        self.words = tuple(kept)
        names: dict[str, object] = {}
        conds = []
        for c in _RARE:
            if c in groups:
                conds.append(f"({c!r} in s and ({' or '.join(f'{w!r} in s' for w in groups[c])}))")
        by_prefix: dict[str, list[str]] = {}
        for w in plain:  # plain words that share a 4-letter prefix are tried under it
            by_prefix.setdefault(w[:4], []).append(w)
        for pre, ws in by_prefix.items():
            conds.append(f"{ws[0]!r} in s" if len(ws) == 1 else f"({pre!r} in s and ({' or '.join(f'{w!r} in s' for w in ws)}))")
        for i, (lit, rx) in enumerate(anchored):
            names[f"rx{i}"] = re.compile(rx).match if rx.startswith("^") else re.compile(rx).search
            conds.append(f"({lit!r} in s and rx{i}(s) is not None)")
        conds.append("not s.isprintable()")
        conds.append("'\\ufffd' in s")
        src = "def search(s):\n    return True if (" + " or\n            ".join(conds) + ") else None\n"
        exec(compile(src, "<hot filter>", "exec"), names)  # noqa: S102 - generated from catalog words, not input
        self.search = names["search"]
        self.source = src


def hot_regex(words: Iterable[str], anchored: Iterable[tuple[str, str]] = ()) -> HotFilter:
    """The ordinary-line fast path's filter (HotFilter) for ``words`` and ``anchored`` regexes."""
    return HotFilter(words, anchored)
