"""Notes: evidence that opens no incident and decides nothing, but belongs on one (signal role "note").

The fault classifier, when unsure (its likeliest class under ``min_probability``), names no
fault of its own: it defers to the rules and says so, with a ``classifier_deferred`` finding
that names its top guesses (models/classifier.py). policy.toml files such findings with role
"note". A note goes onto the open incidents of its job that concern its machine (the
machine's own, or the job-level ones), as evidence a person reads; with none open yet it
waits, at most ``NOTE_KEEP_S`` and ``MAX_PENDING`` per job, for an incident on that machine
to open, and joins it then. A note never changes an incident's kind, confidence, suspects or
decision: the rules decide.
"""

from __future__ import annotations

from faultlens.diagnosis.incidents import MAX_EVIDENCE, IncidentBook, OpenIncident, Signal

NOTE = "note"
NOTE_KEEP_S = 600.0
MAX_PENDING = 32


def _concerns(inc: OpenIncident, note: Signal) -> bool:
    return inc.job == note.job and (note.node is None or inc.node in (None, note.node) or note.node in inc.suspects)


def _attach(inc: OpenIncident, note: Signal) -> None:
    ev = note.evidence() | {"role": NOTE}
    if len(inc.evidence) < MAX_EVIDENCE + 8 and \
            not any(e.get("rule") == ev["rule"] and e.get("text") == ev["text"] for e in inc.evidence):
        inc.evidence.append(ev)  # not add_evidence: a note does not count as a signal of the incident
        inc.dirty = True


def file_note(book: IncidentBook, pending: list[Signal], note: Signal) -> list[OpenIncident]:
    """Put ``note`` on the open incidents it concerns; with none, keep it in ``pending`` (bounded)."""
    targets = [inc for inc in book.open_incidents(note.job) if _concerns(inc, note)]
    for inc in targets:
        _attach(inc, note)
    if not targets:
        pending.append(note)
        del pending[:-MAX_PENDING]
    return targets


def attach_pending(inc: OpenIncident, pending: list[Signal]) -> None:
    """An incident was opened or updated: notes waiting for it join it (and stop waiting)."""
    if not pending:
        return
    keep = []
    for note in pending:
        if inc.opened_ts - NOTE_KEEP_S <= note.ts <= inc.updated_ts + NOTE_KEEP_S and _concerns(inc, note):
            _attach(inc, note)
        elif note.ts >= inc.updated_ts - NOTE_KEEP_S:
            keep.append(note)
    pending[:] = keep
