"""Labels: a person confirms or corrects an incident's root cause.

The explorer writes each label as its own Parquet file under
``LAKE/labels/date=YYYY-MM-DD/hour=HH/`` (schema ``LABELS_SCHEMA`` below, one
row per label; the newest label of an incident wins). It writes nothing else
and never opens a service's DuckDB file. ``faultlens train --from-lake`` reads
this table to add labelled incidents to the classifier's training data; the
report's downtime ledger prefers a label's kind over the diagnosed one.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa

from faultlens.stream.lake import LakeWriter
from faultlens.vocabulary import Category, FaultKind, values

# The lake's labels table: one row per label a person gave (the newest per incident wins).
# Kept here, beside the only writer, until faultlens/schema.py (which owns the lake schemas)
# takes it over: a one-line move.
LABELS_SCHEMA = pa.schema(
    [
        pa.field("ts", pa.float64(), False),
        pa.field("incident_id", pa.string(), False),
        pa.field("job", pa.string()),
        pa.field("verdict", pa.string(), False),  # confirmed | corrected
        pa.field("diagnosed_kind", pa.string()),
        pa.field("diagnosed_category", pa.string()),
        pa.field("kind", pa.string(), False),  # the root cause a person settled on
        pa.field("category", pa.string()),
        pa.field("nodes", pa.string()),  # JSON list of culprit nodes
        pa.field("author", pa.string()),
        pa.field("note", pa.string()),
    ]
)

# Fault kinds a person can pick: the simulator's vocabulary plus the kinds
# diagnosis names that have no simulator twin, and "other".
FAULT_KINDS = values(FaultKind)
CATEGORIES = values(Category)
VERDICTS = ("confirmed", "corrected")


def label_row(
    incident: dict[str, Any], *, verdict: str, kind: str | None = None, category: str | None = None,
    nodes: list[str] | None = None, author: str = "", note: str = "", ts: float | None = None,
) -> dict[str, Any]:
    """The label row for an incident (``views.incident``'s dict). Confirming copies the diagnosis."""
    if verdict not in VERDICTS:
        raise ValueError(f"verdict must be one of {', '.join(VERDICTS)}, not {verdict!r}")
    kind = incident["kind"] if verdict == "confirmed" else kind
    category = incident.get("category") if verdict == "confirmed" else category
    if kind not in FAULT_KINDS and kind != incident["kind"]:
        raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(FAULT_KINDS)}")
    if category is not None and category not in CATEGORIES:
        raise ValueError(f"unknown category {category!r}; known: {', '.join(CATEGORIES)}")
    if nodes is None:
        nodes = [s["node"] for s in incident.get("suspects", [])[:1] if s.get("node")]
    return {
        "ts": time.time() if ts is None else float(ts),
        "incident_id": incident["id"],
        "job": incident.get("job"),
        "verdict": verdict,
        "diagnosed_kind": incident.get("kind"),
        "diagnosed_category": incident.get("category"),
        "kind": kind,
        "category": category,
        "nodes": orjson.dumps(list(nodes)).decode(),
        "author": author,
        "note": note,
    }


def write_label(lake_path: str | Path, incident: dict[str, Any], **label: Any) -> Path:
    """Write one label file into the lake and return its path (see ``label_row`` for arguments)."""
    row = label_row(incident, **label)
    table = pa.Table.from_pylist([row], schema=LABELS_SCHEMA)
    return LakeWriter(lake_path).write_table("labels", table)[0]
