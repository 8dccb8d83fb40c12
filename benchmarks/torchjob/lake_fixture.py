"""One job's records from a realjob work directory's lake, as a test fixture (JSON lines, verbatim rows).

Each line is ``{"kind": <topic kind>, "rec": <the lake row>}`` (the row as the stream processor wrote
it, partition columns dropped, its JSON-text columns parsed back), ordered by time; tests decode them
with ``faultlens.decode.from_obj``
and feed them to diagnosis as the bus did. ``--since``/``--until`` (seconds from the job's first step
record) keep a window.

    python benchmarks/torchjob/lake_fixture.py /tmp/realjob rj1-rank-frozen --kinds jobs,steps,stacks \\
        --out tests/fixtures/real_torch/online_frozen_rank.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

PARTITION_COLUMNS = ("date", "hour")


def rows(lake: Path, kind: str, job: str) -> list[dict[str, Any]]:
    """The lake rows of ``kind`` for ``job`` (nccl and kernel rows by the job's nodes: their job may be null)."""
    import duckdb

    from faultlens.schema import json_columns

    jcols = json_columns(kind)
    files = str(lake / kind / "**" / "*.parquet")
    if not list((lake / kind).glob("**/*.parquet")):
        return []
    con = duckdb.connect()
    out = []
    for rec in con.sql(f"select * from read_parquet('{files}', union_by_name=true)").to_arrow_table().to_pylist():
        for c in PARTITION_COLUMNS:
            rec.pop(c, None)
        for c in jcols:
            if isinstance(rec.get(c), str):
                rec[c] = json.loads(rec[c])
        out.append({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in rec.items()})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="example: python benchmarks/torchjob/lake_fixture.py /tmp/realjob rj1-rank-frozen "
                                        "--kinds jobs,steps,stacks --out frozen.jsonl")
    ap.add_argument("workdir", type=Path, help="benchmarks/realjob.py --workdir (run with --keep)")
    ap.add_argument("job")
    ap.add_argument("--kinds", default="jobs,steps,stacks,nccl,kernel")
    ap.add_argument("--since", type=float, default=None, help="seconds from the job's first step record")
    ap.add_argument("--until", type=float, default=None, help="seconds from the job's first step record")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    lake = args.workdir / "lake"
    nodes: set[str] = set()
    for t in rows(lake, "jobs", args.job):
        if t.get("job") == args.job:
            nodes |= {str(v["node"]) for v in (t.get("ranks") or {}).values()}
    picked: list[tuple[float, str, dict[str, Any]]] = []
    for kind in args.kinds.split(","):
        for rec in rows(lake, kind, args.job):
            mine = rec.get("job") == args.job or (kind in ("nccl", "kernel") and not rec.get("job")
                                                   and rec.get("node") in nodes)
            if mine:
                picked.append((float(rec.get("ts") or 0.0), kind, rec))
    first = min((ts for ts, k, _ in picked if k == "steps"), default=0.0)
    kept = [(ts, k, r) for ts, k, r in sorted(picked, key=lambda x: (x[0], x[1]))
            if (k == "jobs" or args.since is None or ts >= first + args.since)
            and (args.until is None or ts <= first + args.until)]
    with open(args.out, "w") as f:
        for _, kind, rec in kept:
            f.write(json.dumps({"kind": kind, "rec": rec}, default=str) + "\n")
    print(f"{len(kept)} records of {args.job} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
