"""Node health memory across jobs: blame, evictions, diagnostics, quarantine, RMA.

A machine's record outlives the job that exposed it. The BLOOM runs lost days
to a rescheduled job landing on the same bad node; so an evicted node is
quarantined by its incident, a restarted job is refused that node
(``admissible``), and the node leaves quarantine only after verified recovery:
stop-time diagnostics passed, or a person cleared it. A node blamed before is a
stronger suspect next time (``prior_blames``); one evicted ``rma_after`` times
becomes an RMA candidate.

Stored in a DuckDB file owned by the diagnosis service (``diagnosis.catalog_path``;
``":memory:"`` for a throwaway memory). Others read the lake, never this file.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from faultlens.errors import LakeError

SCHEMA = """
CREATE TABLE IF NOT EXISTS node_events (
    ts DOUBLE, node VARCHAR, event VARCHAR, incident_id VARCHAR, job VARCHAR, kind VARCHAR, detail VARCHAR
);
CREATE TABLE IF NOT EXISTS node_state (
    node VARCHAR PRIMARY KEY, quarantined BOOLEAN, incident_id VARCHAR, reason VARCHAR, since DOUBLE,
    blames INTEGER, evictions INTEGER, rma_candidate BOOLEAN
);
"""
EVENTS = ("blamed", "evicted", "diagnostics_passed", "diagnostics_failed", "cleared", "incident_resolved")


class NodeHealth:
    """Per-node record across jobs; quarantine gate for restarts."""

    def __init__(self, path: str | Path = ":memory:", *, rma_after: int = 3):
        try:
            import duckdb
        except ImportError as exc:  # pragma: no cover - the [server] extra
            raise LakeError("node health memory needs duckdb: pip install 'faultlens[server]'") from exc
        self.path = str(path)
        self.rma_after = rma_after
        try:
            self._db = duckdb.connect(self.path)
            self._db.execute(SCHEMA)
        except duckdb.Error as exc:
            raise LakeError(f"cannot open node health store {self.path}: {exc}") from exc
        self._blames_cache: dict[str, int] = {}

    def close(self) -> None:
        self._db.close()

    def _state(self, node: str) -> dict[str, Any] | None:
        row = self._db.execute("SELECT node, quarantined, incident_id, reason, since, blames, evictions, rma_candidate "
                               "FROM node_state WHERE node = ?", [node]).fetchone()
        if row is None:
            return None
        keys = ("node", "quarantined", "incident_id", "reason", "since", "blames", "evictions", "rma_candidate")
        return dict(zip(keys, row, strict=True))

    def _upsert(self, node: str, **changes: Any) -> None:
        st = self._state(node) or {"node": node, "quarantined": False, "incident_id": None, "reason": None,
                                   "since": None, "blames": 0, "evictions": 0, "rma_candidate": False}
        st.update(changes)
        self._db.execute("INSERT OR REPLACE INTO node_state VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                         [st["node"], st["quarantined"], st["incident_id"], st["reason"], st["since"], st["blames"],
                          st["evictions"], st["rma_candidate"]])
        self._blames_cache.pop(node, None)

    def _event(self, node: str, event: str, *, incident_id: str | None = None, job: str | None = None,
               kind: str | None = None, detail: str = "", ts: float | None = None) -> None:
        self._db.execute("INSERT INTO node_events VALUES (?, ?, ?, ?, ?, ?, ?)",
                         [ts if ts is not None else time.time(), node, event, incident_id, job, kind, detail])

    # ---------------------------------------------------------------- what diagnosis records

    def record_blame(self, node: str, *, incident_id: str, job: str, kind: str, ts: float | None = None) -> None:
        st = self._state(node)
        self._event(node, "blamed", incident_id=incident_id, job=job, kind=kind, ts=ts)
        self._upsert(node, blames=(st["blames"] if st else 0) + 1)

    def record_eviction(self, node: str, *, incident_id: str, job: str, kind: str, reason: str = "",
                        ts: float | None = None) -> None:
        """An eviction quarantines the node under its incident."""
        st = self._state(node)
        evictions = (st["evictions"] if st else 0) + 1
        self._event(node, "evicted", incident_id=incident_id, job=job, kind=kind, detail=reason, ts=ts)
        self._upsert(node, quarantined=True, incident_id=incident_id, reason=reason or kind,
                     since=ts if ts is not None else time.time(), evictions=evictions,
                     rma_candidate=evictions >= self.rma_after)

    def record_diagnostics(self, node: str, *, passed: bool, detail: str = "", ts: float | None = None) -> None:
        """Stop-time check result; a pass is the verified recovery that ends quarantine. A node that failed
        its checks ``rma_after`` times since its last pass is an RMA candidate."""
        self._event(node, "diagnostics_passed" if passed else "diagnostics_failed", detail=detail, ts=ts)
        if passed:
            self._upsert(node, quarantined=False, incident_id=None, reason=None, since=None)
            return
        row = self._db.execute(
            "SELECT count(*) FROM node_events WHERE node = ? AND event = 'diagnostics_failed' AND ts >= coalesce("
            "(SELECT max(ts) FROM node_events WHERE node = ? AND event = 'diagnostics_passed'), -1e300)",
            [node, node]).fetchone()
        failures = int(row[0]) if row else 0
        st = self._state(node)
        self._upsert(node, quarantined=True, reason=(st or {}).get("reason") or "diagnostics failed",
                     since=(st or {}).get("since") or (ts if ts is not None else time.time()),
                     rma_candidate=bool((st or {}).get("rma_candidate")) or failures >= self.rma_after)

    def clear(self, node: str, *, by: str, detail: str = "", ts: float | None = None) -> None:
        """A person vouches for the node."""
        self._event(node, "cleared", detail=f"by {by}: {detail}".strip(), ts=ts)
        self._upsert(node, quarantined=False, incident_id=None, reason=None, since=None)

    # ---------------------------------------------------------------- what others ask

    def prior_blames(self, node: str) -> int:
        """Incidents this node was blamed for before (a stronger suspect next time)."""
        if node not in self._blames_cache:
            st = self._state(node)
            self._blames_cache[node] = st["blames"] if st else 0
        return self._blames_cache[node]

    def quarantined(self) -> dict[str, dict[str, Any]]:
        rows = self._db.execute("SELECT node, incident_id, reason, since, evictions, rma_candidate FROM node_state "
                                "WHERE quarantined ORDER BY node").fetchall()
        return {r[0]: {"incident_id": r[1], "reason": r[2], "since": r[3], "evictions": r[4], "rma_candidate": r[5]}
                for r in rows}

    def admissible(self, nodes: list[str]) -> tuple[list[str], dict[str, str]]:
        """(nodes a job may be (re)started on, {refused node: why})."""
        q = self.quarantined()
        ok = [n for n in nodes if n not in q]
        refused = {n: f"quarantined by incident {q[n]['incident_id']} ({q[n]['reason']}); needs passed diagnostics "
                      "or a person's clearance" for n in nodes if n in q}
        return ok, refused

    def rma_candidates(self) -> list[str]:
        return [r[0] for r in self._db.execute("SELECT node FROM node_state WHERE rma_candidate ORDER BY node").fetchall()]

    def history(self, node: str) -> list[dict[str, Any]]:
        rows = self._db.execute("SELECT ts, event, incident_id, job, kind, detail FROM node_events WHERE node = ? "
                                "ORDER BY ts", [node]).fetchall()
        return [dict(zip(("ts", "event", "incident_id", "job", "kind", "detail"), r, strict=True)) for r in rows]
