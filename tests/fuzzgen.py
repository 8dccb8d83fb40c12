"""Mutated real lines for the fuzz tests and benchmarks (tests/test_fuzz_*.py, benchmarks/fuzz.py, hostile.py).

The seed lines are the repository's own real-log fixtures (tests/fixtures/) and the
conformance corpus (datasets/conformance/*.jsonl), grouped by the parser that reads them.
``mutate`` changes a line a little, the way a torn write, a bad disk, a wrong locale or a
log shipper does: a changed character, a cut, a doubled field, a mangled month, a NUL,
bytes that are not UTF-8, a huge number, deep brackets.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
CONFORMANCE = ROOT / "datasets" / "conformance"
SOURCES = ("kernel", "nccl", "steps", "stack", "nvsmi", "gpu")

_CONFORMANCE_SOURCE = {"nccl.jsonl": "nccl", "nvsmi.jsonl": "nvsmi"}  # every other family file: kernel lines
_FIXTURE_FILES = {
    "kernel": ["kernel/*/input.log", "kmsg/recorded/input.kmsg"],
    "nccl": ["nccl/*/input.log"],
    "steps": ["steps/real/input.log"],
    "stack": ["stacks/*/*.txt", "stacks/real/input.log"],
    "nvsmi": ["nvsmi/families/*.txt"],
    "gpu": ["decode/gpu.jsonl"],
}


def _lines(text: str) -> list[str]:
    return [ln for ln in text.split("\n") if ln.strip()]


@lru_cache(maxsize=1)
def corpus() -> dict[str, tuple[str, ...]]:
    """source -> the real lines the repository holds for that parser."""
    out: dict[str, list[str]] = {s: [] for s in SOURCES}
    for source, globs in _FIXTURE_FILES.items():
        for g in globs:
            for f in sorted(FIXTURES.glob(g)):
                out[source] += _lines(f.read_text(encoding="utf-8", errors="replace"))
    for name in ("kernel", "nccl", "steps", "stacks", "nvsmi"):
        f = FIXTURES / "real_logs" / f"{name}.jsonl"
        if f.is_file():
            for raw in f.read_text().splitlines():
                if raw.strip():
                    out["stack" if name == "stacks" else name] += _lines(json.loads(raw).get("text", ""))
    for f in sorted(CONFORMANCE.glob("*.jsonl")):
        source = _CONFORMANCE_SOURCE.get(f.name, "kernel")
        for raw in f.read_text().splitlines():
            if raw.strip():
                out[source] += _lines(json.loads(raw).get("text", ""))
    return {k: tuple(dict.fromkeys(v)) for k, v in out.items()}


def seed_lines(*sources: str) -> list[str]:
    c = corpus()
    return [ln for s in (sources or SOURCES) for ln in c[s]]


# --------------------------------------------------------------------------- mutations

_NOISE = "\x00\t \\\"'[]{}():;,.=<>|/-+0123456789eE\ufffd\u00e9\u4e2d\U0001f600\x1b\r"
_MONTHS = ("Qct", "Xyz", "Okt", "Mär", "0ct", "Oc", "Octo", "")


def _change(s: str, r: random.Random) -> str:
    if not s:
        return r.choice(_NOISE)
    i = r.randrange(len(s))
    return s[:i] + r.choice(_NOISE) + s[i + 1:]


def _delete(s: str, r: random.Random) -> str:
    if not s:
        return s
    i = r.randrange(len(s))
    return s[:i] + s[i + r.randint(1, 8):]


def _cut(s: str, r: random.Random) -> str:
    return s[: r.randrange(len(s) + 1)]


def _cut_head(s: str, r: random.Random) -> str:
    return s[r.randrange(len(s) + 1):]


def _double_field(s: str, r: random.Random) -> str:
    parts = s.split(" ")
    i = r.randrange(len(parts))
    parts.insert(i, parts[i])
    return " ".join(parts)


def _drop_field(s: str, r: random.Random) -> str:
    parts = s.split(" ")
    if len(parts) > 1:
        del parts[r.randrange(len(parts))]
    return " ".join(parts)


def _month(s: str, r: random.Random) -> str:
    for m in ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"):
        if m in s:
            return s.replace(m, r.choice(_MONTHS), 1)
    return "[Sat Qct 12 18:35:32 2024] " + s


def _digits(s: str, r: random.Random) -> str:
    out = []
    for ch in s:
        if ch.isdigit() and r.random() < 0.3:
            ch = r.choice(("9" * r.randint(1, 40), "0", "-1", "99", "", "x", "1e999"))
        out.append(ch)
    return "".join(out)


def _bad_bytes(s: str, r: random.Random) -> str:
    # what invalid UTF-8 becomes once read with errors="replace" (explain, batch) or surrogateescape
    i = r.randrange(len(s) + 1)
    return s[:i] + r.choice(("\ufffd", "\udcff\udcfe", "\ufffd\ufffd\x00", "\x00")) + s[i:]


def _nest(s: str, r: random.Random) -> str:
    n = r.choice((10, 100, 1000, 5000))
    o, c = r.choice((("[", "]"), ("{\"a\":", "}"), ("(", ")")))
    i = r.randrange(len(s) + 1)
    return s[:i] + o * n + (c * n if r.random() < 0.5 else "") + s[i:]


def _long(s: str, r: random.Random) -> str:
    return s + r.choice(("A", " x", "0", "[", "\x00", ":")) * r.choice((1000, 20000))


def _splice(s: str, r: random.Random) -> str:
    other = r.choice(seed_lines())
    i, j = r.randrange(len(s) + 1), r.randrange(len(other) + 1)
    return s[:i] + other[j:]


def _newline(s: str, r: random.Random) -> str:
    i = r.randrange(len(s) + 1)
    return s[:i] + r.choice(("\n", "\r", "\n    ", "\x0b", "\x0c", "\u2028")) + s[i:]


MUTATIONS: tuple[Callable[[str, random.Random], str], ...] = (
    _change, _change, _change, _delete, _cut, _cut_head, _double_field, _drop_field, _month, _digits,
    _bad_bytes, _nest, _long, _splice, _newline,
)


def mutate(line: str, r: random.Random, rounds: int | None = None) -> str:
    """``line`` changed 1-3 times (``rounds`` to fix it)."""
    for _ in range(rounds or r.randint(1, 3)):
        line = r.choice(MUTATIONS)(line, r)
    return line


def mutated_lines(sources: tuple[str, ...] | str, n: int, seed: int = 0) -> list[str]:
    """``n`` mutated real lines of ``sources`` (one line each: embedded newlines are kept out)."""
    r = random.Random(seed)
    seeds = seed_lines(*((sources,) if isinstance(sources, str) else sources))
    out = []
    while len(out) < n:
        m = mutate(r.choice(seeds), r)
        out.extend(x for x in m.split("\n"))
    return out[:n]


def mutate_bytes(data: bytes, r: random.Random) -> bytes:
    """A byte-level change: flip, cut, invalid UTF-8, NUL run."""
    if not data:
        return bytes([r.randrange(256)])
    i = r.randrange(len(data))
    how = r.randrange(4)
    if how == 0:
        return data[:i] + bytes([data[i] ^ (1 << r.randrange(8))]) + data[i + 1:]
    if how == 1:
        return data[:i]
    if how == 2:
        return data[:i] + r.choice((b"\xff\xfe", b"\xc3", b"\xed\xa0\x80", b"\x80\x80")) + data[i:]
    return data[:i] + b"\x00" * r.randint(1, 64) + data[i:]


def to_bytes(lines: list[str]) -> bytes:
    """Lines as a file's bytes (the lone surrogates ``_bad_bytes`` makes become the bytes they stand for)."""
    return ("\n".join(lines) + "\n").encode("utf-8", "surrogateescape")
