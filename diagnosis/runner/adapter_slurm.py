"""Slurm: drain the blamed nodes, requeue the job, check nodes with a real job, return the good ones.

The adapter carries an action out itself (``SelfExecuting``): before and after each
command it reads Slurm's state back (``scontrol show node|job -o``), records it on
the action's status (``observed``), and judges the command by what Slurm then says,
never by its exit status alone. The job id of an action is the Slurm job id
(digits, or ``<id>_<task>`` for an array task).

| action           | what happens |
|------------------|--------------|
| evict_nodes      | ``scontrol update NodeName=<n> State=DRAIN Reason="faultlens <incident>: <reason>"`` per node, then ``scontrol requeue <job>`` when the job allows it (``Requeue=1``; runner.slurm_requeue) and is running, or ended FAILED/NODE_FAIL on a node drained here (the fault killed it first); a job held to a drained node (``ReqNodeList``) is requeued held, freed of that list, released |
| restart_job      | ``scontrol requeuehold <job>``, ``scontrol update JobId=<job> ReqNodeList=<its nodes>``, ``scontrol release <job>``: the same nodes |
| run_diagnostics  | a maintenance reservation ``faultlens_diag_<node>`` holds the node, a node drained by faultlens is resumed under it, and ``sbatch`` runs the check there (polled until it ends) (runner.diagnostics_command, else ``dcgmi diag -r 1`` where DCGM exists, else a CPU/memory/disk check); exit 0: the reservation goes and the node takes work again; else it is drained "faultlens <incident>: diagnostics failed" |
| notify           | none: only the status |
| rollback_code, adapt_parallelism | refused: the job's own tooling does those (command adapter) |

What faultlens drains carries the reason prefix ``faultlens ``; a node drained with any
other reason was drained by a person and faultlens never resumes it, nor checks it.
A controller that does not answer, or a node Slurm does not know, raises ``Pending``
with Slurm's message (the runner retries); a command Slurm refuses is a failure with
Slurm's message.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from faultlens.config import RunnerConfig
from faultlens.diagnosis.runner.adapter_base import (
    CarriedOut,
    CommandResult,
    Pending,
    Refused,
    Session,
    Step,
    check_nodes,
    check_slurm_job,
    clean_text,
    fill_template,
    parse_template,
    template_values,
)
from faultlens.schema import Action

REASON_PREFIX = "faultlens "
# Slurm's words when the controller is not there (22.05 clients), and when it does not know a node.
UNREACHABLE_RE = re.compile(r"Unable to contact slurm controller|Socket timed out|Zero Bytes were transmitted|"
                            r"Connection refused|Communication connection failure|standby mode|timed out after", re.I)
UNKNOWN_NODE_RE = re.compile(r"Node \S+ not found|Invalid node name specified", re.I)
_FIELD_RE = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9:/_]*)=")
_REASON_STAMP_RE = re.compile(r"\s*\[[^\]@]+@[^\]]+\]$")  # "[root@2026-11-28T14:56:20]" after the reason
ISOLATED_FLAGS = ("DRAIN", "DOWN", "FAIL")
NODE_FIELDS = ("State", "Reason")
JOB_FIELDS = ("JobState", "Reason", "NodeList", "ReqNodeList", "Requeue", "Restarts")
DIAG_OUTPUT = "/tmp/faultlens-diag-%j.out"  # node-local on a real cluster: read back only where it is visible

# The check a diagnostics job runs when runner.diagnostics_command is empty: DCGM's short run where
# DCGM is installed; else the CPU computes, memory can be taken and checked, the local disk takes a
# file and gives it back unchanged. Exit status decides.
NODE_CHECK = r"""
if command -v dcgmi >/dev/null 2>&1; then exec dcgmi diag -r 1; fi
set -eu
echo "cpu: $(nproc) cpu(s)"; [ "$(nproc)" -ge 1 ]
[ "$(awk 'BEGIN { s = 0; for (i = 0; i < 300000; i++) s += i % 7; print s }')" = 899997 ]
avail_kb=$(awk '/^MemAvailable:/ { print $2 }' /proc/meminfo); echo "memory: ${avail_kb} kB available"
[ "$avail_kb" -ge 262144 ]
[ "$(head -c 67108864 /dev/zero | tr '\0' 'x' | wc -c)" = 67108864 ]
dir=${TMPDIR:-/tmp}; f=$(mktemp "$dir/faultlens-diag.XXXXXX"); trap 'rm -f "$f"' EXIT
head -c 16777216 /dev/urandom > "$f"; a=$(md5sum < "$f"); sync; b=$(md5sum < "$f")
[ "$a" = "$b" ] && [ "$(wc -c < "$f")" = 16777216 ]; echo "disk: $dir wrote and read back 16 MiB"
"""


def parse_show(text: str) -> list[dict[str, str]]:
    """``scontrol show node|job -o`` records as {key: value}; a value may hold spaces (``Reason=a b``)."""
    records = []
    for line in text.splitlines():
        marks = list(_FIELD_RE.finditer(line))
        if not marks:
            continue
        fields = {}
        for i, m in enumerate(marks):
            end = marks[i + 1].start() if i + 1 < len(marks) else len(line)
            fields[m.group(1)] = line[m.end():end].strip()
        records.append(fields)
    return records


def reason_text(fields: Mapping[str, str]) -> str:
    """A node's Reason without Slurm's ``[user@time]`` stamp; "" when none."""
    reason = fields.get("Reason", "")
    return "" if reason in ("", "(null)", "None") else _REASON_STAMP_RE.sub("", reason)


def is_isolated(fields: Mapping[str, str]) -> bool:
    """Drained, draining, down or failing: taken out of service already (``IDLE+DRAIN``, ``DOWN*``)."""
    state = fields.get("State", "").upper()
    return any(flag in state for flag in ISOLATED_FLAGS)


def is_drained(fields: Mapping[str, str]) -> bool:
    return "DRAIN" in fields.get("State", "").upper()


def by_faultlens(fields: Mapping[str, str]) -> bool:
    return reason_text(fields).startswith(REASON_PREFIX)


class SlurmAdapter:
    name: ClassVar[str] = "slurm"
    executes: ClassVar[bool] = True

    def __init__(self, config: RunnerConfig, *, scontrol: str = "scontrol", sbatch: str = "sbatch",
                 scancel: str = "scancel", node_health: Any = None):
        self.config = config
        self.scontrol = scontrol
        self.sbatch = sbatch
        self.scancel = scancel
        self.diagnostics = parse_template(config.diagnostics_command, key="runner.diagnostics_command")
        self.health = node_health  # diagnosis.nodehealth.NodeHealth or None
        if self.health is None and config.node_health_path:
            from faultlens.diagnosis.nodehealth import NodeHealth  # duckdb: the [server] extra
            self.health = NodeHealth(config.node_health_path)

    # ------------------------------------------------------------------ the plan (what dry-run shows)

    def _reason(self, action: Action, what: str = "") -> str:
        return clean_text(f"{REASON_PREFIX}{action.incident_id}: {what}{action.reason or action.type}")

    def _drain(self, node: str, reason: str) -> tuple[str, ...]:
        return (self.scontrol, "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}")

    def plan(self, action: Action, event: Mapping[str, Any]) -> list[Step]:
        """The main commands, checked; reads and conditional steps are decided when carried out."""
        if action.type == "notify":
            return []
        if action.type == "evict_nodes":
            nodes = check_nodes(action.nodes, required=True)
            job = check_slurm_job(action.job) if self.config.slurm_requeue else ""
            steps = [Step(self._drain(n, self._reason(action))) for n in nodes]
            return steps + ([Step((self.scontrol, "requeue", job))] if job else [])
        if action.type == "restart_job":
            job = check_slurm_job(action.job)
            return [Step((self.scontrol, "requeuehold", job)), Step((self.scontrol, "release", job))]
        if action.type == "run_diagnostics":
            nodes = check_nodes(action.nodes, required=True)
            return [Step(self._diag_argv(action, n, "<reservation>")) for n in nodes]
        raise Refused(f"{action.type} is not supported by the slurm adapter; use the command adapter")

    # ------------------------------------------------------------------ reading Slurm back

    def _ask(self, session: Session, argv: tuple[str, ...], what: str, *, record: bool = True) -> CommandResult:
        """A read of Slurm's state; no answer from the controller -> Pending with Slurm's words."""
        res = session.run(argv, record=record)
        if not res.ok and UNREACHABLE_RE.search(res.message):
            raise Pending(f"slurmctld did not answer ({what}): {res.message}")
        return res

    def _node(self, session: Session, node: str, when: str) -> dict[str, str]:
        res = self._ask(session, (self.scontrol, "show", "node", "-o", node), f"show node {node}")
        if not res.ok:
            if UNKNOWN_NODE_RE.search(res.message):
                raise Pending(f"Slurm does not know node {node}: {res.message}")
            raise Pending(f"cannot read node {node}: {res.message}")
        fields = next(iter(parse_show(res.stdout)), {})
        session.observe({"when": when, "node": node, "State": fields.get("State", ""), "Reason": reason_text(fields)})
        return fields

    def _job(self, session: Session, job: str, when: str) -> dict[str, str] | None:
        res = self._ask(session, (self.scontrol, "show", "job", "-o", job), f"show job {job}")
        fields = next(iter(parse_show(res.stdout)), {}) if res.ok else {}
        entry: dict[str, Any] = {"when": when, "job": job}
        entry.update({k: fields.get(k, "") for k in JOB_FIELDS} if fields else {"error": res.message})
        session.observe(entry)
        return fields or None

    def _command(self, session: Session, argv: tuple[str, ...], what: str, *,
                 timeout_s: float | None = None) -> CommandResult:
        """A command that changes Slurm; no answer -> Pending, refused -> the caller fails with the message."""
        res = session.run(argv, timeout_s=timeout_s)
        if not res.ok and UNREACHABLE_RE.search(res.message):
            raise Pending(f"slurmctld did not answer ({what}): {res.message}")
        if not res.ok and UNKNOWN_NODE_RE.search(res.message):
            raise Pending(f"Slurm does not know a node ({what}): {res.message}")
        return res

    def isolated_nodes(self, session: Session) -> set[str]:
        res = self._ask(session, (self.scontrol, "show", "node", "-o"), "show node")
        if not res.ok:
            raise Pending(f"cannot list Slurm's nodes: {res.message}")
        isolated = {f["NodeName"] for f in parse_show(res.stdout) if "NodeName" in f and is_isolated(f)}
        session.observe({"when": "before", "isolated": sorted(isolated)})
        return isolated

    # ------------------------------------------------------------------ carrying out

    def carry_out(self, action: Action, event: Mapping[str, Any], session: Session) -> CarriedOut:
        if action.type == "notify":
            return CarriedOut(True, "notify: nothing to execute for the slurm adapter")
        if action.type == "evict_nodes":
            return self._evict(action, session)
        if action.type == "restart_job":
            return self._restart(action, session)
        if action.type == "run_diagnostics":
            return self._diagnose(action, session)
        raise Refused(f"{action.type} is not supported by the slurm adapter; use the command adapter")

    def _drain_nodes(self, action: Action, nodes: list[str], session: Session) -> tuple[list[str], str | None]:
        """Drain each node (skipping one drained already); (what happened per node, failure or None)."""
        befores = {n: self._node(session, n, "before") for n in nodes}  # every node known before any drain
        said = []
        for node in nodes:
            before = befores[node]
            if is_drained(before):
                who = "faultlens" if by_faultlens(before) else "a person"
                said.append(f"{node} already drained by {who} ({reason_text(before)!r}): left as it is")
                session.mark(f"drain:{node}")
                continue
            if not session.done(f"drain:{node}"):
                res = self._command(session, self._drain(node, self._reason(action)), f"drain {node}")
                after = self._node(session, node, "after drain")
                if not res.ok:
                    return said, f"drain {node}: Slurm refused: {res.message}"
                if not (is_drained(after) and by_faultlens(after)):
                    return said, (f"drain {node}: Slurm accepted it but the node reads State={after.get('State')} "
                                  f"Reason={reason_text(after)!r}")
                session.mark(f"drain:{node}")
                said.append(f"drained {node} ({before.get('State')} -> {after.get('State')})")
                if self.health is not None:  # once per drain Slurm confirmed, never again on a retry
                    self.health.record_eviction(node, incident_id=action.incident_id, job=action.job,
                                                kind=action.type, reason=action.reason)
        return said, None

    def _evict(self, action: Action, session: Session) -> CarriedOut:
        nodes = check_nodes(action.nodes, required=True)
        job = check_slurm_job(action.job) if self.config.slurm_requeue else ""
        said, failure = self._drain_nodes(action, nodes, session)
        if failure:
            return CarriedOut(False, "; ".join([*said, failure]))
        if not job:
            return CarriedOut(True, "; ".join([*said, "not requeued (runner.slurm_requeue = false)"]))
        before = self._job(session, job, "before requeue")
        if before is None:
            return CarriedOut(False, "; ".join([*said, f"requeue {job}: Slurm does not know the job "
                                                       f"({session.observed[-1].get('error', '')})"]))
        if before.get("Requeue") != "1":
            return CarriedOut(True, "; ".join([*said, f"job {job} not requeued: it says Requeue="
                                                      f"{before.get('Requeue')} (sbatch --no-requeue); it runs on "
                                                      "until it ends or a person acts"]))
        state = before.get("JobState", "")
        # A job the fault already ended (its ranks died with the machine: FAILED, or NODE_FAIL) goes again
        # too when it ran on a node drained here; one that ended otherwise (completed, cancelled) stays ended.
        ended_by_it = state in ENDED_BY_FAULT and bool(set(expand_nodes(before.get("NodeList", ""))) & set(nodes))
        if session.done(f"requeue:{job}") or (state not in ("RUNNING", "SUSPENDED", "CONFIGURING")
                                              and not ended_by_it):
            return CarriedOut(True, "; ".join([*said, f"job {job} not requeued again: it is "
                                                      f"{before.get('JobState')} (Restarts={before.get('Restarts')})"]))
        held = set(expand_nodes(before.get("ReqNodeList", ""))) & set(nodes)
        if held:  # the job asked for a node now drained: requeue held, free it of that list, release
            steps = [(self.scontrol, "requeuehold", job), (self.scontrol, "update", f"JobId={job}", "ReqNodeList="),
                     (self.scontrol, "release", job)]
        else:
            steps = [(self.scontrol, "requeue", job)]
        for argv in steps:
            res = self._command(session, argv, f"{argv[1]} {job}")
            if not res.ok:
                self._job(session, job, f"after {argv[1]}")
                return CarriedOut(False, "; ".join([*said, f"{argv[1]} {job}: Slurm refused: {res.message}"]))
        after = self._job(session, job, "after requeue") or {}
        session.mark(f"requeue:{job}")
        if after.get("Restarts") == before.get("Restarts") and after.get("JobState") in ("RUNNING", state):
            return CarriedOut(False, "; ".join([*said, f"requeue {job}: Slurm accepted it but the job still reads "
                                                       f"RUNNING, Restarts={after.get('Restarts')}"]))
        return CarriedOut(True, "; ".join([*said, f"requeued {job} (was {before.get('JobState')} on "
                                                  f"{before.get('NodeList')}, now {after.get('JobState')}, "
                                                  f"Restarts={after.get('Restarts')})"]))

    def _restart(self, action: Action, session: Session) -> CarriedOut:
        job = check_slurm_job(action.job)
        before = self._job(session, job, "before requeue")
        if before is None:
            return CarriedOut(False, f"restart {job}: Slurm does not know the job ({session.observed[-1].get('error')})")
        if before.get("Requeue") != "1":
            raise Refused(f"job {job} says Requeue={before.get('Requeue')} (sbatch --no-requeue): "
                          "faultlens does not requeue it")
        nodes = before.get("NodeList", "")
        if session.done(f"requeue:{job}") or before.get("JobState") != "RUNNING" or nodes in ("", "(null)"):
            return CarriedOut(True, f"job {job} not requeued: it is {before.get('JobState')} "
                                    f"(Restarts={before.get('Restarts')})")
        for argv in [(self.scontrol, "requeuehold", job), (self.scontrol, "update", f"JobId={job}",
                                                          f"ReqNodeList={nodes}"), (self.scontrol, "release", job)]:
            res = self._command(session, argv, f"{argv[1]} {job}")
            if not res.ok:
                self._job(session, job, f"after {argv[1]}")
                return CarriedOut(False, f"{argv[1]} {job}: Slurm refused: {res.message}")
        session.mark(f"requeue:{job}")
        after = self._job(session, job, "after requeue") or {}
        return CarriedOut(True, f"requeued {job} on the same nodes {nodes} (was {before.get('JobState')}, now "
                                f"{after.get('JobState')}, ReqNodeList={after.get('ReqNodeList')}, "
                                f"Restarts={after.get('Restarts')})")

    # ------------------------------------------------------------------ diagnostics

    def _diag_argv(self, action: Action, node: str, reservation: str) -> tuple[str, ...]:
        if self.diagnostics:
            script = shlex.join(fill_template(self.diagnostics, {**template_values(action), "node": node}))
        else:
            script = NODE_CHECK
        minutes = max(1, math.ceil(self.config.diagnostics_timeout_s / 60))
        return (self.sbatch, "--parsable", "--no-requeue", "-N", "1", "-n", "1", f"--nodelist={node}",
                f"--reservation={reservation}", f"--job-name=faultlens-diag-{node}", f"--time={minutes}",
                f"--output={DIAG_OUTPUT}", f"--wrap={script}")

    def _await_check(self, session: Session, job_id: str) -> dict[str, str] | None:
        """Poll the check job until it ends (``runner.diagnostics_timeout_s`` + 60 s); its last record."""
        deadline = time.monotonic() + self.config.diagnostics_timeout_s + 60
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            res = self._ask(session, (self.scontrol, "show", "job", "-o", job_id), f"show job {job_id}", record=False)
            fields = _job_fields(res)
            if not fields or fields.get("JobState", "").split("+")[0] in TERMINAL:
                break
            time.sleep(0.2)
        session.observe({"when": "after the check", "job": job_id,
                         **{k: fields.get(k, "") for k in (*JOB_FIELDS, "ExitCode")}})
        return fields or None

    def _diagnose(self, action: Action, session: Session) -> CarriedOut:
        nodes = check_nodes(action.nodes, required=True)
        befores = {n: self._node(session, n, "before") for n in nodes}
        for node, before in befores.items():
            if is_drained(before) and not by_faultlens(before):
                raise Refused(f"{node} was drained by a person (Reason={reason_text(before)!r}): faultlens neither "
                              "checks nor resumes it")
        verdicts, ok = [], True
        for node in nodes:
            passed, text = self._diagnose_node(action, node, befores[node], session)
            ok &= passed
            verdicts.append(text)
        return CarriedOut(ok, "; ".join(verdicts))

    def _diagnose_node(self, action: Action, node: str, before: dict[str, str],
                       session: Session) -> tuple[bool, str]:
        reservation = f"faultlens_diag_{node.replace('.', '_')}"
        if not session.done(f"reserve:{node}"):
            res = self._command(session, (self.scontrol, "create", "reservation", f"ReservationName={reservation}",
                                          f"Nodes={node}", "StartTime=now", "Duration=UNLIMITED", f"Users={_me()}",
                                          "Flags=MAINT,IGNORE_JOBS"), f"reserve {node}")
            if not res.ok and "Duplicate reservation name" not in res.message:
                return False, f"{node}: reservation refused by Slurm: {res.message}"
            session.mark(f"reserve:{node}")
        if is_drained(before):  # drained by faultlens: resumed under the reservation, so only the check lands
            res = self._command(session, (self.scontrol, "update", f"NodeName={node}", "State=RESUME"),
                                f"resume {node} for its check")
            self._node(session, node, "after resume under the reservation")
            if not res.ok:
                return False, f"{node}: resume for the check refused by Slurm: {res.message}"
        submitted = self._command(session, self._diag_argv(action, node, reservation), f"diagnostics on {node}")
        job_id = submitted.stdout.strip().split(";")[0] if submitted.ok else ""
        job = self._await_check(session, job_id) if job_id.isdigit() else None
        if job is not None and job.get("JobState", "").split("+")[0] not in TERMINAL:  # out of time: stop it
            self._command(session, (self.scancel, job_id), f"cancel check job {job_id}")
        passed = job is not None and job.get("JobState") == "COMPLETED" and job.get("ExitCode") == "0:0"
        words = _read_output(job_id) or (submitted.message if not submitted.ok else "")
        summary = (f"check job {job_id or '(not submitted)'} {job.get('JobState') if job else 'unknown'} "
                   f"exit {job.get('ExitCode') if job else '-'}: {words[-300:]}")
        if passed:
            res = self._command(session, (self.scontrol, "delete", f"ReservationName={reservation}"),
                                f"release {node}")
            after = self._node(session, node, "after passed diagnostics")
            if self.health is not None:
                self.health.record_diagnostics(node, passed=True, detail=summary)
            if not res.ok:
                return False, f"{node}: diagnostics passed but Slurm kept the reservation: {res.message}"
            return True, f"{node}: diagnostics passed ({summary}); returned to service, State={after.get('State')}"
        ran = job is not None  # a check Slurm would not start says nothing about the node
        reason = self._reason(action, "diagnostics failed: " if ran else "diagnostics not run: ")
        drain = self._command(session, self._drain(node, reason), f"drain {node} after failed diagnostics")
        self._command(session, (self.scontrol, "delete", f"ReservationName={reservation}"), f"release {node}")
        after = self._node(session, node, "after failed diagnostics")
        rma = ""
        if not ran:
            return False, (f"{node}: the check job was not run ({summary}); left drained, "
                           f"State={after.get('State')}")
        if self.health is not None:
            self.health.record_diagnostics(node, passed=False, detail=summary)
            rma = "; an RMA candidate" if node in self.health.rma_candidates() else ""
        if not drain.ok or not is_drained(after):
            return False, f"{node}: diagnostics failed ({summary}) and the drain was refused: {drain.message}"
        return False, f"{node}: diagnostics failed ({summary}); stays drained, State={after.get('State')}{rma}"


ENDED_BY_FAULT = frozenset({"FAILED", "NODE_FAIL"})
TERMINAL = frozenset({"COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                      "DEADLINE", "PREEMPTED"})


def _job_fields(res: CommandResult) -> dict[str, str]:
    return next(iter(parse_show(res.stdout)), {}) if res.ok else {}


USER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?$")


def _me() -> str:
    """The runner's own user: the only one its diagnostics reservation admits (it submits the check)."""
    import pwd

    name = pwd.getpwuid(os.geteuid()).pw_name
    if not USER_RE.match(name):
        raise Refused(f"the runner's user name {name!r} is not a plain user name: no reservation made for it")
    return name


def _read_output(job_id: str) -> str:
    """The check job's output where this host can read it (the same host, a shared /tmp), then removed."""
    if not job_id.isdigit():
        return ""
    path = Path(DIAG_OUTPUT.replace("%j", job_id))
    try:
        text = path.read_text(errors="replace")
        path.unlink()
    except OSError:
        return ""
    return " ".join(text.split())


def expand_nodes(expr: str) -> list[str]:
    """Slurm's hostlist (``node[1,3-4],gpu7``) as names; "" / "(null)" -> []."""
    if expr in ("", "(null)", "None"):
        return []
    names: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", expr):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not m:
            names.append(part)
            continue
        head, ranges, tail = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                names.append(f"{head}{i:0{width}d}{tail}")
    return names
