"""Agreement of ``faultlens explain`` with the real-world conformance corpus, per family.

    python benchmarks/realworld.py            # the whole corpus, misses listed
    python benchmarks/realworld.py --quick    # same corpus (it is small), misses not listed
    python benchmarks/realworld.py --misses-md FILE   # also write the misses as a Markdown table

Prints one row per family (n, category / action / severity agreement), then, for every
entry where a peer (gpud, NVSentinel, node-problem-detector) states an answer, faultlens's
verdict beside the peer's, then the misses, and as its last line one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from faultlens.datasets import realworld as rw  # noqa: E402


def _pct(x: float) -> str:
    return f"{100 * x:5.1f}%"


def misses_markdown(result: dict) -> str:
    """The misses as a Markdown table (README section), one row per entry."""
    out = ["| id | family | expected (category / action) | faultlens (category / action, rule) | text (start) |",
           "|---|---|---|---|---|"]
    for r in rw.misses(result):
        e, g = r["expected"], r["got"]
        text = r["text"].split("\n")[0][:90].replace("|", "\\|")
        out.append(f"| {r['id']} | {r['family']} | {e['category']} / {e['action']} | "
                   f"{g['category']} / {g['action']} ({r['rule']}) | `{text}` |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="do not list the misses (the corpus is always scored whole)")
    ap.add_argument("--corpus", default=None, help="corpus directory (default: datasets/conformance)")
    ap.add_argument("--misses-md", default=None, help="write the misses as a Markdown table to this file")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    entries = rw.load(a.corpus)
    res = rw.score(entries)
    dt = time.perf_counter() - t0

    print(f"{'family':<20} {'n':>4} {'category':>9} {'action':>8} {'severity':>9}")
    for fam, s in res["families"].items():
        print(f"{fam:<20} {s['n']:>4} {_pct(s['category']):>9} {_pct(s['action']):>8} {_pct(s['severity']):>9}")
    o = res["overall"]
    print(f"{'ALL':<20} {o['n']:>4} {_pct(o['category']):>9} {_pct(o['action']):>8} {_pct(o['severity']):>9}")

    peered = [r for r in res["rows"] if r["peer"]]
    print(f"\nWhere a peer states an answer ({len(peered)} entries):")
    print(f"{'id':<14} {'peer':<22} {'peer answer':<48} {'faultlens':<32} {'label':<28}")
    for r in peered:
        g, e = r["got"], r["expected"]
        print(f"{r['id']:<14} {r['peer']['name']:<22} {r['peer']['answer'][:48]:<48} "
              f"{g['category'] + '/' + g['action']:<32} {e['category'] + '/' + e['action']:<28}")
    by_peer: dict[str, list[dict]] = {}
    for r in peered:
        by_peer.setdefault(r["peer"]["name"], []).append(r)
    peer_summary = {name: {"n": len(rs), "faultlens_agrees_with_label": sum(r["category_ok"] and r["action_ok"] for r in rs) / len(rs)}
                    for name, rs in sorted(by_peer.items())}
    for name, s in peer_summary.items():
        print(f"  {name}: {s['n']} entries, faultlens matches the corpus label on {_pct(s['faultlens_agrees_with_label'])}")

    ms = rw.misses(res)
    if not a.quick:
        print(f"\nMisses ({len(ms)}):")
        for r in ms:
            print(f"  {r['id']} [{r['family']}] want {r['expected']['category']}/{r['expected']['action']} "
                  f"got {r['got']['category']}/{r['got']['action']} ({r['rule']}): {r['text'].splitlines()[0][:100]}")
    if a.misses_md:
        Path(a.misses_md).write_text(misses_markdown(res))
    synthetic = sum(e["synthetic"] for e in entries)
    summary = {"bench": "realworld", "entries": len(entries), "synthetic": synthetic,
               "category_agreement": round(o["category"], 4), "action_agreement": round(o["action"], 4),
               "severity_agreement": round(o["severity"], 4), "both_agreement": round(o["both"], 4),
               "misses": len(ms), "families": len(res["families"]), "seconds": round(dt, 2)}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
