"""The real-world conformance corpus (datasets/conformance): every entry through ``explain``.

The corpus holds real kernel / NCCL / nvidia-smi lines and blocks from the peers' fixtures
(gpud, NVSentinel, node-problem-detector) and public reports, each labelled with what an
expert operator wants. The threshold is the issue's: >= 95% agreement on category and on
action. Misses are printed so a failing run says which families to fix.
"""

from __future__ import annotations

import pytest

from faultlens.datasets import realworld as rw
from faultlens.vocabulary import Category, LineAction

THRESHOLD = 0.95
MIN_ENTRIES = 300
ENTRIES = rw.load()
RESULT = rw.score(ENTRIES)


def test_corpus_format_size_and_provenance() -> None:
    assert len(ENTRIES) >= MIN_ENTRIES
    synthetic = sum(e["synthetic"] for e in ENTRIES)
    assert synthetic / len(ENTRIES) < 0.20, "constructed lines must stay a clear minority"
    for e in ENTRIES:
        assert e["text"].strip(), e["id"]
        assert e["source_url"] or (e["repo"] and e["path"]), e["id"]
        assert e["reason"].strip(), e["id"]
    fams = {e["family"] for e in ENTRIES}
    assert len(fams) >= 30, sorted(fams)
    negatives = [e for e in ENTRIES if e["expected"]["category"] == Category.NONE]
    assert len(negatives) >= 40, "normal lines that must stay quiet"
    assert any(e["expected"]["action"] == LineAction.EVICT_NODE for e in ENTRIES)


def test_bad_corpus_line_names_file_and_line(tmp_path) -> None:
    (tmp_path / "x.jsonl").write_text('{"id": "a"}\n')
    with pytest.raises(rw.CorpusError, match=r"x\.jsonl:1: missing"):
        rw.load(tmp_path)


def test_agreement_with_expert_labels() -> None:
    o = RESULT["overall"]
    misses = rw.misses(RESULT)
    for r in misses:
        print(f"MISS {r['id']} [{r['family']}] want {r['expected']['category']}/{r['expected']['action']} "
              f"got {r['got']['category']}/{r['got']['action']} ({r['rule']}): {r['text'].splitlines()[0][:100]}")
    print(f"category {o['category']:.3f} action {o['action']:.3f} over {o['n']} entries")
    assert o["category"] >= THRESHOLD and o["action"] >= THRESHOLD
