"""The workflow protocol, and the desk the engine gives a workflow to work at.

An incident family (an explicit machine fault, a hang, a NaN loss, a user exception, a slow
machine, a job-wide event) is one workflow: the incident kinds it owns, what it does when a
signal opens or joins one of its incidents (``decide``), what it decides as time passes
(``on_tick``), and, where the family reads records of its own (a traceback, a step's loss,
a job's silence), ``reads``/``observe``/``watch``. The engine only routes; a workflow keeps
no state of its own (everything it learns lives in the engine's EngineState, which is what
a checkpoint carries) and owns its settings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from faultlens.config import Config
from faultlens.diagnosis.decision import Decision, Hold
from faultlens.diagnosis.engine_state import EngineState
from faultlens.diagnosis.incidents import IncidentBook, OpenIncident, Signal
from faultlens.diagnosis.modes import Mode
from faultlens.diagnosis.policy import Policy
from faultlens.diagnosis.settings import EngineSettings
from faultlens.vocabulary import ActionType

if TYPE_CHECKING:
    from faultlens.diagnosis.engine import JobState


# A machine incident whose machine was evicted takes none of these later (a later line of the same fault).
_WEAKER_THAN_EVICTION = frozenset({ActionType.RUN_DIAGNOSTICS, ActionType.RESTART_JOB, ActionType.NOTIFY})


class Desk(Protocol):
    """What a workflow may use of the engine: its state, policy and settings, and three verbs."""

    config: Config
    settings: EngineSettings
    policy: Policy
    mode: Mode
    state: EngineState

    @property
    def book(self) -> IncidentBook: ...

    def job(self, name: str) -> JobState:
        """The job's state (made when first named)."""
        ...

    def file(self, signal: Signal, *, decide: bool = True) -> OpenIncident | None:
        """Into the incident book (bursts, inhibition, job-wide rules); ``decide``: its workflow decides now."""
        ...

    def decide(self, inc: OpenIncident) -> None:
        """The owning workflow decides ``inc`` (after the job-wide hold)."""
        ...

    def held_for_job(self, inc: OpenIncident) -> bool:
        """True while a node's incident waits for the job's other nodes (workflows.job_wide)."""
        ...

    def act(self, inc: OpenIncident, decision: Decision) -> Decision | None:
        """Through the guard rails and out as an action; what was taken (None: suppressed)."""
        ...


class Workflow(Protocol):
    """One incident family (see the module docstring)."""

    name: str
    kinds: frozenset[str]  # the incident kinds it decides (the machine-fault workflow takes every other kind)
    reads: tuple[type, ...]  # record types it reads itself, in the engine's routing order

    def observe(self, desk: Desk, record: Any, job: str) -> bool:
        """A record of a type in ``reads``. True: it was this workflow's alone (a line no signal matcher reads)."""
        ...

    def watch(self, desk: Desk, job: JobState, now: float, final: bool) -> None:
        """Time passed on a job (the hang workflow watches its steps' silence)."""
        ...

    def decide(self, desk: Desk, inc: OpenIncident) -> None:
        """A signal opened or joined an incident of its kinds: decide now, or wait."""
        ...

    def on_tick(self, desk: Desk, inc: OpenIncident, now: float, final: bool) -> None:
        """Time passed on an open incident of its kinds."""
        ...


class BaseWorkflow:
    """Defaults: reads nothing itself, watches no job, decides an undecided incident on a tick."""

    name = "base"
    kinds: frozenset[str] = frozenset()
    reads: tuple[type, ...] = ()

    def observe(self, desk: Desk, record: Any, job: str) -> bool:
        return False

    def watch(self, desk: Desk, job: JobState, now: float, final: bool) -> None:
        return None

    def decide(self, desk: Desk, inc: OpenIncident) -> None:
        if not desk.held_for_job(inc):
            carry_out(desk, inc, route_decision(desk, inc))

    def on_tick(self, desk: Desk, inc: OpenIncident, now: float, final: bool) -> None:
        if not inc.decided:
            desk.decide(inc)


def world_size(desk: Desk, job_name: str) -> int | None:
    job = desk.state.jobs.get(job_name)
    return job.topology.world_size if job is not None and job.topology is not None else None


def route_decision(desk: Desk, inc: OpenIncident) -> Decision | Hold | None:
    """The policy route's decision for the incident (policy.toml ``[route.<kind>]``)."""
    return desk.policy.decide(inc, desk.state.now, world_size=world_size(desk, inc.job), final=desk.state.final)


def carry_out(desk: Desk, inc: OpenIncident, decision: Decision | Hold | None) -> Decision | None:
    """A route's decision: a hold waits, a notification is held back (a stronger signal may still
    come; the engine sends it after ``notify_delay_s``), anything else is acted on. The action taken."""
    if isinstance(decision, Hold):
        inc.state.waiting = decision.reason
        return None
    if decision is None or decision.type in inc.decided or (
            ActionType.EVICT_NODES in inc.decided and decision.type in _WEAKER_THAN_EVICTION):
        return None  # taken already, or weaker than the eviction its machine already got
    inc.state.waiting = None
    if decision.type == ActionType.NOTIFY:
        if not inc.decided:
            inc.state.notify = decision
        return None
    return desk.act(inc, decision)
