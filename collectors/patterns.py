"""Loading parse-pattern tables (the ``[[kind]]`` part of collectors/catalogs/kernel.toml,
nccl.toml) and the cheap prefilter.

A table is an ordered list of ``[[kind]]`` entries: ``name``, ``any`` (substrings,
at least one must occur) and ``regex``. All substrings of a table are folded into
one compiled case-insensitive prefix-trie regex so that a line that cannot match
any entry costs a single scan of its lower-cased text; only lines that pass it try the entries' regexes. A bad entry fails
at load time naming the file and the entry.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from faultlens.collectors.signatures import (  # noqa: F401  (one catalog folder, one bad-byte test, one match limit)
    BAD_INPUT_RE,
    CATALOGS,
    MATCH_LIMIT,
    bounded,
)
from faultlens.config import read_catalog
from faultlens.errors import CatalogError


@dataclass(frozen=True, slots=True)
class KindPattern:
    name: str
    any: tuple[str, ...]
    regex: re.Pattern[str]
    single_line: bool = False  # the format has no continuation lines: the record is complete at its line

    def search(self, text: str) -> re.Match[str] | None:
        for s in self.any:
            if s in text:
                return self.regex.search(text)
        return None


@dataclass(frozen=True, slots=True)
class KindTable:
    """An ordered pattern table with its one-scan prefilter.

    ``ordinary_kinds``: kinds that are everyday noise (the agent counts them instead of
    shipping them unless the classifier finds something in them: ``faultlens.collectors.signatures.is_ordinary``);
    ``noteworthy_any``: lower-case substrings one of which every line the family's kind-``other``
    rules match contains (error words), for the ordinary-line fast path (``hot_regex``).
    """

    file: str
    kinds: tuple[KindPattern, ...]
    prefilter: re.Pattern[str]
    ordinary_kinds: frozenset[str] = frozenset({"other"})
    noteworthy_any: tuple[str, ...] = ()

    @property
    def single_line_kinds(self) -> frozenset[str]:
        """Kinds whose printed form has no continuation lines (``single_line = true``)."""
        return frozenset(k.name for k in self.kinds if k.single_line)

    def words(self) -> list[str]:
        """Every substring (lower case) that can make a line anything but ordinary."""
        return [s.lower() for k in self.kinds for s in k.any] + [s.lower() for s in self.noteworthy_any]

    def match(self, text: str) -> tuple[str, re.Match[str] | None]:
        """(kind, match) of the first entry that matches, ``("other", None)`` otherwise.
        A long record is judged by its head and tail (``signatures.bounded`` says why)."""
        text = bounded(text)
        if self.prefilter.search(text.lower()) is None:
            return "other", None
        for k in self.kinds:
            m = k.search(text)
            if m is not None:
                return k.name, m
        return "other", None


def load_kind_table(path: Path) -> KindTable:
    data = read_catalog(path)
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
        single = entry.get("single_line", False)
        if not isinstance(single, bool):
            raise CatalogError("`single_line` must be true or false", file=str(path), entry=name)
        kinds.append(KindPattern(name, tuple(subs), rx, single))
    if not kinds:
        raise CatalogError("no [[kind]] entries", file=str(path))
    ordinary = data.get("ordinary", {})
    okinds = ordinary.get("kinds", ["other"])
    if not isinstance(okinds, list) or not all(isinstance(k, str) for k in okinds):
        raise CatalogError("`kinds` must be a list of kind names", file=str(path), entry="ordinary")
    nw_any = ordinary.get("noteworthy_any", [])
    if not isinstance(nw_any, list) or not all(isinstance(x, str) and x for x in nw_any):
        raise CatalogError("`noteworthy_any` must be a list of non-empty substrings", file=str(path), entry="ordinary")
    if "noteworthy" in ordinary:
        raise CatalogError("`noteworthy` is gone: what an unrecognised line means is the family's kind-`other` "
                           "[[rule]]s; list their words in `noteworthy_any`", file=str(path), entry="ordinary")
    return KindTable(str(path), tuple(kinds), prefilter_regex(s for k in kinds for s in k.any), frozenset(okinds),
                     tuple(nw_any))


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


class HotFilter:
    """Finds the lines of a chunk that could be anything but ordinary, in one scan.

    A line is hot when its lower-cased text holds one of ``words``; when one of
    ``patterns`` (regexes) matches in its lower-cased text; when an ``anchored``
    pair's screen regex occurs in it and the pair's regex matches its lower-cased
    text (``^...``: at the start); when one of ``raw`` matches in its original
    text; or when it holds a byte that is not text (non-printable, U+FFFD) or a
    line break. ``patterns``, screens and ``raw`` are searched in the whole chunk,
    so they must not match a line break, and they are fast only when they start
    with a literal (``re`` then skips to it): write ``\\d -> \\d`` as
    `` -> (?<=\\d -> )\\d``.

    Why a chunk: Python's ``re`` costs 30-80 ns per position for an alternation
    of ~100 words, and even grouped ``str.__contains__`` tests cost ~3 µs a
    line, most of an agent's CPU at 1,000 lines/s. An Aho-Corasick automaton
    (``ahocorasick_rs``, compiled) finds every word in a joined, lower-cased
    chunk in one pass at ~0.4 µs a line, and a chunk of ordinary lines, the
    usual case, then costs nothing more.
    """

    def __init__(
        self,
        words: Iterable[str],
        anchored: Iterable[tuple[str, str]] = (),
        patterns: Iterable[str] = (),
        raw: Iterable[str] = (),
    ):
        import ahocorasick_rs

        kept: list[str] = []
        for w in sorted({x.lower() for x in words} | {"\ufffd"}, key=len):
            if not any(o in w for o in kept):
                kept.append(w)
        self.words = tuple(kept)
        self._automaton = ahocorasick_rs.AhoCorasick(self.words)
        self._anchored = [
            (
                re.compile(screen),
                re.compile(rx).match if rx.startswith("^") else re.compile(rx).search,
            )
            for screen, rx in anchored
        ]
        self._patterns = [re.compile(rx) for rx in patterns]
        self._raw = [re.compile(rx) for rx in raw]

    def hot_indexes(self, lines: Sequence[str]) -> list[int]:
        """Indexes, ascending, of the hot lines of ``lines`` (which hold no line break)."""
        if not lines:
            return []
        raw = "\n" + "\n".join(lines)
        low = raw.lower()
        if len(low) != len(raw) or raw.count("\n") != len(lines):
            # A character whose lower case is longer, or a line break inside a line: line by line.
            return [i for i, line in enumerate(lines) if self._line_hot(line)]
        ends = [end - 1 for _, _, end in self._find(low)]
        ends += [m.start() for r in self._patterns for m in r.finditer(low)]
        ends += [m.start() for r in self._raw for m in r.finditer(raw)]
        screened: list[tuple[int, Callable[[str], object] | None]] = [
            (m.start(), rx) for screen, rx in self._anchored for m in screen.finditer(low)]
        odd = not raw.replace("\n", "").isprintable()
        if not (ends or screened or odd):
            return []
        # Positions -> line indexes by counting line breaks between sorted hits (C scans),
        # rather than a Python-level table of every line's start.
        hot: set[int] = set()
        at, line_no = 0, -1  # the leading "\n" is line 0's
        hits: list[tuple[int, Callable[[str], object] | None]] = [(p, None) for p in ends]
        for p, rx in sorted(hits + screened, key=lambda h: h[0]):
            line_no += raw.count("\n", at, p + 1)
            at = p + 1
            if rx is None or (line_no not in hot and rx(lines[line_no].lower()) is not None):
                hot.add(line_no)
        if odd:
            hot.update(i for i, line in enumerate(lines) if not line.isprintable())
        hot.discard(-1)
        return sorted(hot)

    def _find(self, text: str) -> list[tuple[int, int, int]]:
        try:
            return self._automaton.find_matches_as_indexes(text)
        except UnicodeEncodeError:  # a lone surrogate (surrogateescape'd bytes): such a line is hot anyway
            return self._automaton.find_matches_as_indexes(_encodable(text))

    def _line_hot(self, line: str) -> bool:
        low = line.lower()
        return bool(
            self._find("\n" + low)  # framed as in a chunk: "\n " marks indentation
            or any(r.search(low) is not None for r in self._patterns)
            or any(
                screen.search(low) is not None and rx(low) is not None
                for screen, rx in self._anchored
            )
            or any(r.search(line) is not None for r in self._raw)
            or not line.isprintable()
        )

    def search(self, text: str) -> bool | None:
        """One line: True if hot, else None (for ``is None`` tests, like ``re.Pattern.search``)."""
        return True if self.hot_indexes([text]) else None


def _encodable(text: str) -> str:
    """``text`` with each lone surrogate (text decoded with surrogateescape) as ``?``: the
    automaton needs UTF-8; same length, so positions hold (such a line is hot anyway)."""
    return text.encode("utf-8", "replace").decode("utf-8")


def hot_regex(
    words: Iterable[str],
    anchored: Iterable[tuple[str, str]] = (),
    patterns: Iterable[str] = (),
    raw: Iterable[str] = (),
) -> HotFilter:
    """The ordinary-line fast path's filter (HotFilter); see its arguments there. One filter per set of
    arguments (it is never changed after it is built): a big job's batch directory makes a parser per
    rank's log, and building the automaton and regexes again for each was ~8% of the post-mortem."""
    return _hot_filter(tuple(words), tuple(tuple(a) for a in anchored), tuple(patterns), tuple(raw))


@functools.lru_cache(maxsize=64)
def _hot_filter(words: tuple[str, ...], anchored: tuple[tuple[str, ...], ...], patterns: tuple[str, ...],
                raw: tuple[str, ...]) -> HotFilter:
    return HotFilter(words, [(a[0], a[1]) for a in anchored], patterns, raw)
