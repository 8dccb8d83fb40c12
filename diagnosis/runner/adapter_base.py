"""What every runner adapter shares: the step plan, name checks, and the executor.

An adapter turns an action into a *plan*: a list of ``Step`` (an argv list,
optionally bytes for stdin). It never runs anything itself. The runner decides
whether the plan runs (``--execute`` and ``dry_run=false``) and runs it through
``run_steps``, which uses argv lists only (never a shell), stops at the first
failure, and records every command line it started.

Everything an adapter puts into an argv is checked first: node names against a
strict hostname pattern, Slurm job ids against digits, free text stripped of
control characters. A check that fails raises ``Refused``; the runner reports
status ``refused`` and runs nothing of that action.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from faultlens.errors import ConfigError, Pending, Refused  # noqa: F401 - re-exported for the adapters
from faultlens.schema import Action
from faultlens.vocabulary import ActionType

log = logging.getLogger(__name__)

# RFC 1123 host names: labels of letters, digits and inner hyphens, dot-separated.
# No leading '-' (an option to the tool), no spaces, quotes, '$', ';', '/'.
HOSTNAME_RE = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)
SLURM_JOB_ID_RE = re.compile(r"^[0-9]{1,12}(?:_[0-9]{1,9})?$")
# Job, incident and action ids put into a command: letters, digits, '._-', not starting with '-'
# (never an option), bounded. Anything else (spaces, '$(...)', quotes, newlines) refuses the action.
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# Programs that hand their arguments to a shell on another machine: every value is quoted for it.
REMOTE_SHELLS = frozenset({"ssh", "rsh", "pdsh", "clush"})
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]+")
STDERR_TAIL_CHARS = 2000


# Refused lives in the one exception tree (faultlens.errors); adapters import it from here too.


@dataclass(frozen=True, slots=True)
class Step:
    """One command of a plan: argv (never a shell string) and optional stdin bytes."""

    argv: tuple[str, ...]
    stdin: bytes | None = None


@dataclass(slots=True)
class StepsResult:
    ok: bool
    commands: list[list[str]] = field(default_factory=list)
    detail: str = ""


class Adapter(Protocol):
    """A runner adapter. ``executes`` False: it only ever logs (the dry-run adapter)."""

    name: ClassVar[str]
    executes: ClassVar[bool]

    def plan(self, action: Action, event: Mapping[str, Any]) -> list[Step]:
        """The commands that carry out ``action``; raises ``Refused``. Runs nothing."""
        ...


@dataclass(frozen=True, slots=True)
class CommandResult:
    """One command run by a self-executing adapter, with what it printed."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def message(self) -> str:
        """What the program said (stderr, else stdout), on one line, bounded: its own words, for the status."""
        return " ".join((self.stderr.strip() or self.stdout.strip()).split())[:STDERR_TAIL_CHARS]


class Session:
    """What the runner lends a self-executing adapter for one action: commands it runs are recorded
    (argv, never a shell), the state it reads back is noted, and the ledger's marks of finished steps
    let an action resumed after a crash skip what already happened."""

    def __init__(self, *, timeout_s: float, env: Mapping[str, str] | None,
                 done: set[Any] | None = None, mark: Any = None):
        self.timeout_s = timeout_s
        self.env = dict(os.environ if env is None else env)
        self.commands: list[list[str]] = []
        self.observed: list[dict[str, Any]] = []
        self._done = set(done or ())
        self._mark = mark

    def run(self, argv: Sequence[str], *, timeout_s: float | None = None, record: bool = True) -> CommandResult:
        """Run one command; ``record`` False: a repeated read (a poll) kept off the status' command list."""
        argv = tuple(argv)
        if record:
            self.commands.append(list(argv))
        limit = timeout_s if timeout_s is not None else self.timeout_s
        log.log(logging.INFO if record else logging.DEBUG, "running: %s", subprocess.list2cmdline(argv))
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, errors="replace",  # noqa: S603 - argv list
                                  timeout=limit, env=self.env, shell=False, check=False)
        except FileNotFoundError:
            return CommandResult(argv, 127, "", f"executable not found: {argv[0]}")
        except PermissionError as exc:
            return CommandResult(argv, 126, "", f"cannot execute {argv[0]}: {exc}")
        except subprocess.TimeoutExpired as exc:
            return CommandResult(argv, 124, "", f"{argv[0]} timed out after {limit:g} s; {_tail(exc.stderr)}")
        return CommandResult(argv, proc.returncode, proc.stdout, proc.stderr)

    def observe(self, entry: Mapping[str, Any]) -> None:
        """Record the scheduler's state as read back (before or after a command)."""
        self.observed.append(dict(entry))

    def done(self, key: str) -> bool:
        """This step finished before (this run or one the runner was stopped in)."""
        return key in self._done

    def mark(self, key: str) -> None:
        self._done.add(key)
        if self._mark is not None:
            self._mark(key)


@dataclass(frozen=True, slots=True)
class CarriedOut:
    """A self-executing adapter's verdict: ``ok`` (done) or not (failed), and why, in the scheduler's words."""

    ok: bool
    detail: str


@runtime_checkable
class SelfExecuting(Protocol):
    """An adapter that carries an action out itself, reading the scheduler's state back before and after
    each command (the Slurm adapter). ``plan`` still says what it would run (dry-run)."""

    def isolated_nodes(self, session: Session) -> set[str]:
        """Nodes the scheduler has isolated already (drained, down): the fleet cap counts them.
        Raises ``Pending`` when the scheduler does not answer."""
        ...

    def carry_out(self, action: Action, event: Mapping[str, Any], session: Session) -> CarriedOut:
        """Carry ``action`` out; raises ``Refused`` (nothing ran) or ``Pending`` (try again later)."""
        ...


def check_node(name: str) -> str:
    if not isinstance(name, str) or not HOSTNAME_RE.match(name):
        raise Refused(f"node name {name!r} is not a valid host name")
    return name


def check_nodes(nodes: Sequence[str], *, required: bool) -> list[str]:
    """Every node checked, duplicates dropped (order kept); ``required``: at least one."""
    if required and not nodes:
        raise Refused("the action names no nodes")
    return list(dict.fromkeys(check_node(n) for n in nodes))


def check_slurm_job(job: str) -> str:
    if not isinstance(job, str) or not SLURM_JOB_ID_RE.match(job):
        raise Refused(f"job {job!r} is not a Slurm job id")
    return job


def check_id(value: str, what: str) -> str:
    """``value`` when it is a plain id (``ID_RE``); else the action is refused, naming it."""
    if not isinstance(value, str) or not ID_RE.match(value):
        raise Refused(f"{what} {value!r:.80} is not a plain id (letters, digits, '._-', at most 128, "
                      "not starting with '-'): refused rather than put into a command")
    return value


def template_values(action: Action) -> dict[str, str]:
    """The checked values of an action for ``{type} {job} {incident} {action}`` placeholders."""
    if action.type not in set(ActionType):
        raise Refused(f"action type {action.type!r:.60} is not one of faultlens' action types")
    return {"type": str(action.type), "job": check_id(action.job, "job"),
            "incident": check_id(action.incident_id, "incident id"), "action": check_id(action.id, "action id")}


def clean_text(text: str, limit: int = 200) -> str:
    """Free text for a command argument: one line, printable, bounded."""
    return _CONTROL_RE.sub(" ", text).strip()[:limit]


def parse_template(line: str, *, key: str) -> tuple[str, ...]:
    """Split a configured command line into an argv template (no shell); "" -> ()."""
    try:
        return tuple(shlex.split(line))
    except ValueError as exc:
        raise ConfigError(f"cannot split the command line: {exc}", key=key) from None


def fill_template(template: Sequence[str], values: Mapping[str, str]) -> tuple[str, ...]:
    """Replace ``{name}`` placeholders inside each argv element (plain replace, no format()).

    The values must come from ``template_values`` / ``check_node`` (checked patterns). When the
    program is a remote shell (ssh ...), whose arguments a shell on the far side parses again,
    each value after the program name is also quoted for that shell (``shlex.quote``)."""
    remote = bool(template) and os.path.basename(template[0]) in REMOTE_SHELLS
    out = []
    for i, arg in enumerate(template):
        for key, val in values.items():
            arg = arg.replace("{" + key + "}", shlex.quote(val) if remote and i > 0 else val)
        out.append(arg)
    return tuple(out)


def _tail(data: bytes | str | None) -> str:
    if not data:
        return ""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    return text.strip()[-STDERR_TAIL_CHARS:]


def run_steps(steps: Sequence[Step], *, timeout_s: float, env: Mapping[str, str] | None = None) -> StepsResult:
    """Run the steps in order without a shell; stop at the first failure.

    ``env`` replaces the environment of the commands (its PATH finds the
    executables); None: this process's environment.
    """
    result = StepsResult(ok=True)
    run_env = dict(os.environ if env is None else env)
    for step in steps:
        argv = list(step.argv)
        result.commands.append(argv)
        log.info("running: %s", subprocess.list2cmdline(argv))
        try:
            proc = subprocess.run(  # noqa: S603 - argv list, shell=False, names checked
                argv, input=step.stdin, capture_output=True, timeout=timeout_s, env=run_env, shell=False, check=False
            )
        except FileNotFoundError:
            result.ok, result.detail = False, f"executable not found: {argv[0]}"
            return result
        except PermissionError as exc:
            result.ok, result.detail = False, f"cannot execute {argv[0]}: {exc}"
            return result
        except subprocess.TimeoutExpired as exc:
            result.ok, result.detail = False, f"{argv[0]} timed out after {timeout_s:g} s; stderr: {_tail(exc.stderr)}"
            return result
        if proc.returncode != 0:
            result.ok = False
            result.detail = f"{argv[0]} exited {proc.returncode}; stderr: {_tail(proc.stderr)}"
            return result
    result.detail = f"{len(steps)} command(s) succeeded"
    return result
