"""How the engine gets stack dumps: the one difference between batch and online diagnosis.

Online (``OnlineMode``) a suspected hang asks the job's agents for stacks (a
``dump_stacks`` command on the commands topic) and waits ``stacks_wait_s`` for the
answers. Batch (``BatchMode``) the stacks are whatever the input directory holds (a
snapshot taken during the hang, whenever that was), nothing can be asked for, and the
input's end is the last moment to decide. Everything else in diagnosis is the same code.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any, Protocol

from faultlens.diagnosis.incidents import OpenIncident
from faultlens.schema import Command, StackDump


def output_id(prefix: str, *parts: Any) -> str:
    """A deterministic id (same inputs, same id): replays and restored instances agree."""
    return f"{prefix}-" + hashlib.sha1("|".join(str(p) for p in parts).encode()).hexdigest()[:12]


class Mode(Protocol):
    """The batch/online strategy the engine is built with."""

    name: str
    stacks_expected: bool  # whether a missing stack set means "none came back" (online) or "none in the input"

    def request_stacks(self, inc: OpenIncident, now: float, reason: str) -> Command | None:
        """A dump_stacks command for the incident's job, or None where stacks cannot be asked for."""
        ...

    def stacks_ready_at(self, inc: OpenIncident, now: float, *, grace_s: float, wait_s: float,
                        answered: bool = False, answered_wait_s: float = 0.0) -> float:
        """Event time from which the stacks at hand are judged; ``answered``: every rank answered the request
        (online), which ends the wait ``answered_wait_s`` after the request."""
        ...

    def usable_dumps(self, dumps: Iterable[StackDump], now: float, *, final: bool) -> list[StackDump]:
        """The dumps to aggregate at ``now``."""
        ...


class OnlineMode:
    """On the bus: ask the agents for stacks, give them ``stacks_wait_s`` to answer."""

    name = "online"
    stacks_expected = True

    def request_stacks(self, inc: OpenIncident, now: float, reason: str) -> Command | None:
        if inc.state.command is not None:
            return None
        cmd = Command(id=output_id("cmd", inc.id, "dump_stacks"), ts=now, kind="dump_stacks", job=inc.job,
                      params={"incident_id": inc.id, "reason": reason})
        inc.state.command = cmd.id
        inc.state.requested_ts = now
        return cmd

    def stacks_ready_at(self, inc: OpenIncident, now: float, *, grace_s: float, wait_s: float,
                        answered: bool = False, answered_wait_s: float = 0.0) -> float:
        requested = inc.state.requested_ts if inc.state.requested_ts is not None else now
        full = max(inc.opened_ts + grace_s, requested + wait_s)
        # Every rank answered: the evidence is complete, and an explicit cause has had the silence threshold
        # and this wait to show itself (a real 8-rank job's stacks and Flight Recorder answers came in 5-7 s
        # under load; the full grace held it 180 s, past benchmarks/realjob.py's window).
        return min(full, requested + answered_wait_s) if answered else full

    def usable_dumps(self, dumps: Iterable[StackDump], now: float, *, final: bool) -> list[StackDump]:
        return list(dumps)


class BatchMode:
    """A directory's records on their own clock: stacks come with the input; its end is final."""

    name = "batch"
    stacks_expected = False

    def request_stacks(self, inc: OpenIncident, now: float, reason: str) -> Command | None:
        return None

    def stacks_ready_at(self, inc: OpenIncident, now: float, *, grace_s: float, wait_s: float,
                        answered: bool = False, answered_wait_s: float = 0.0) -> float:
        return inc.opened_ts + grace_s

    def usable_dumps(self, dumps: Iterable[StackDump], now: float, *, final: bool) -> list[StackDump]:
        dumps = list(dumps)
        if final:
            return dumps
        # A snapshot dated before now belongs to this hang; one dated later (a file's mtime) is still the
        # only one there is.
        return [d for d in dumps if d.ts <= now + 1e-6] or dumps


ONLINE = OnlineMode()
BATCH = BatchMode()
