"""The real-world conformance corpus (datasets/conformance/*.jsonl): loading and scoring.

Each entry is one real log line or block (kernel, NCCL/torch.distributed, nvidia-smi -q)
with the verdict an expert operator would want from ``faultlens explain``. Scoring runs
every entry through the same function ``faultlens explain --json`` uses
(``faultlens.diagnosis.explain.explain_lines``, format auto-detected) and takes the most
significant classification of the block as faultlens's verdict. The corpus is what the
classifier is measured against, so the labels never follow the implementation; see
datasets/conformance/README.md for how they were chosen.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from faultlens.diagnosis.classify import most_significant
from faultlens.diagnosis.explain import explain_lines
from faultlens.vocabulary import Category, LineAction, Severity

CORPUS_DIR = Path(__file__).parent / "conformance"
REQUIRED = ("id", "family", "source", "text", "expected", "reason", "synthetic")


class CorpusError(ValueError):
    """A corpus line that does not follow the format (names file and line)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    category: str
    severity: str
    action: str
    xid: int | None
    rule: str | None
    meaning: str


def _check(e: dict, where: str) -> None:
    missing = [k for k in REQUIRED if k not in e]
    if missing:
        raise CorpusError(f"{where}: missing {missing}")
    if not (e.get("source_url") or (e.get("repo") and e.get("path"))):
        raise CorpusError(f"{where}: needs source_url or repo+path")
    exp = e["expected"]
    if exp.get("category") not in set(Category):
        raise CorpusError(f"{where}: category {exp.get('category')!r} not in the vocabulary")
    if exp.get("severity") not in set(Severity):
        raise CorpusError(f"{where}: severity {exp.get('severity')!r} not in the vocabulary")
    for a in [exp.get("action"), *e.get("also_ok", {}).get("action", [])]:
        if a not in set(LineAction):
            raise CorpusError(f"{where}: action {a!r} not in the vocabulary")
    if not isinstance(e["synthetic"], bool):
        raise CorpusError(f"{where}: synthetic must be true or false")


def load(directory: Path | str | None = None) -> list[dict]:
    """Every entry of every ``*.jsonl`` file, validated; ``file`` is added to each."""
    d = Path(directory) if directory else CORPUS_DIR
    out: list[dict] = []
    seen: dict[str, str] = {}
    for f in sorted(d.glob("*.jsonl")):
        for no, raw in enumerate(f.read_text().splitlines(), 1):
            if not raw.strip():
                continue
            where = f"{f.name}:{no}"
            try:
                e = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise CorpusError(f"{where}: {exc}") from exc
            _check(e, where)
            if e["id"] in seen:
                raise CorpusError(f"{where}: id {e['id']} already used at {seen[e['id']]}")
            seen[e["id"]] = where
            e["file"] = f.name
            out.append(e)
    return out


def verdict(text: str) -> Verdict:
    """faultlens's verdict on one line or block: the most significant line of ``explain``."""

    lines = text.split("\n")
    got = [e.c for e in explain_lines(lines) if e.c.rule != "empty"]
    c = most_significant(got)
    if c is None:
        return Verdict("none", "info", "none", None, "empty", "")
    return Verdict(c.category, c.severity, c.action, c.xid, c.rule, c.meaning)


def _ok(e: dict, field: str, got: str) -> bool:
    return got == e["expected"][field] or got in e.get("also_ok", {}).get(field, [])


def score(entries: list[dict]) -> dict:
    """Per-entry rows and per-family / overall agreement on category, action and severity."""
    rows = []
    for e in entries:
        v = verdict(e["text"])
        rows.append({"id": e["id"], "family": e["family"], "file": e["file"], "synthetic": e["synthetic"],
                     "expected": e["expected"], "got": {"category": v.category, "severity": v.severity,
                                                        "action": v.action},
                     "rule": v.rule, "xid": v.xid, "peer": e.get("peer"), "reason": e["reason"],
                     "text": e["text"],
                     "category_ok": _ok(e, "category", v.category), "action_ok": _ok(e, "action", v.action),
                     "severity_ok": _ok(e, "severity", v.severity)})
    fam: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        fam[r["family"]].append(r)

    def agg(rs: list[dict]) -> dict:
        n = len(rs)
        return {"n": n, "category": sum(r["category_ok"] for r in rs) / n if n else 0.0,
                "action": sum(r["action_ok"] for r in rs) / n if n else 0.0,
                "severity": sum(r["severity_ok"] for r in rs) / n if n else 0.0,
                "both": sum(r["category_ok"] and r["action_ok"] for r in rs) / n if n else 0.0}

    return {"rows": rows, "overall": agg(rows), "families": {k: agg(v) for k, v in sorted(fam.items())}}


def misses(result: dict) -> list[dict]:
    """Rows where category or action disagree with the label."""
    return [r for r in result["rows"] if not (r["category_ok"] and r["action_ok"])]
