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
from typing import Any, ClassVar, Protocol

from faultlens.errors import ConfigError, Refused  # noqa: F401 - Refused re-exported for the adapters
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
