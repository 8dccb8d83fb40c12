"""ActionRunner: consumes actions, executes them through an adapter, reports the result.

For each message on the actions topic (consumer group ``runner.group_id``):

1. verify the signature (stream/signing.py: a key listed in ``[keys] files``,
   not expired, not dated in the future); what does not verify is dead-lettered
   with its reason and counted, never reported nor written to the ledger (a
   forged message must not take the id of a real action). With no key
   configured nothing verifies: every action is at most dry-run, and a
   non-dry-run one is refused with how to make a key;
2. validate the CloudEvent against ``schemas/action.schema.json``, then decode
   the Action; anything wrong is dead-lettered (and, when the message names an
   action id and job, reported ``refused``): a bad message never stops the runner;
3. once per action id: a re-delivered action (a rebalance, a restart before
   the commit) is recognised by its id and not executed again. The id is
   written to the ledger (``runner.state_path``, a file by default) *before*
   anything runs, so execution is at most once even across a crash;
4. refuse what is unsafe: actions older than ``runner.max_action_age_s`` (a
   replayed topic) or dated in the future, actions (but notify) whose evidence is
   older than their evidence window (``evidence_age_s`` when decided plus the
   action's own age past ``evidence_window_s``: a pipeline that fell behind), node names that are not host names,
   ids that are not plain ids, job ids the adapter cannot use, action types the
   adapter does not support; and what passes the runner's own caps (its second
   line behind diagnosis' guard): at most ``runner.max_actions_per_window``
   executions per ``runner.rate_window_s`` and
   ``runner.max_nodes_evicted_per_hour`` distinct nodes isolated in any hour,
   counted from the ledger so a restart does not reset them;
5. execute only when the runner was started with ``runner.execute`` (the
   ``--execute`` flag) *and* the action says ``dry_run: false``; otherwise log
   what would run and report ``dry_run``;
6. produce an ``ActionStatus`` on action-status with every command line started
   and, on failure, the tail of stderr; then commit the offsets. A self-executing
   adapter (Slurm) also reports the scheduler's state it read back (``observed``),
   and the nodes the scheduler has isolated already count against the fleet cap;
   what the scheduler cannot take now (``Pending``: its controller is down, it does
   not know a node) is reported ``pending`` with its message and tried again every
   ``runner.pending_retry_s``, from the ledger across restarts, until it is done,
   fails or ``runner.pending_retries`` attempts are spent (then ``failed``).

``handle(value)`` is the whole decision for one message, without Kafka;
``run()`` is the consume/produce loop around it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import orjson

from faultlens import schema
from faultlens.config import Config, RunnerConfig
from faultlens.diagnosis.event_schemas import EventValidator
from faultlens.diagnosis.runner.adapter_base import (
    Adapter,
    Pending,
    Refused,
    SelfExecuting,
    Session,
    StepsResult,
    check_nodes,
    run_steps,
)
from faultlens.diagnosis.runner.adapter_dryrun import DryRunAdapter
from faultlens.diagnosis.runner.adapters import make_adapter
from faultlens.errors import BusError, ConfigError, LakeError, SchemaError
from faultlens.files import replace_lines
from faultlens.metrics import ServiceMetrics, observe_consumer_lag
from faultlens.schema import Action, ActionStatus, DeadLetter
from faultlens.stream import topics
from faultlens.stream.bus import Consumer, Producer, ensure_topics
from faultlens.stream.bus.consume_loop import ConsumeLoop
from faultlens.stream.signing import HOW_TO_MAKE_A_KEY, Keyring, Unverified, verifier_warning
from faultlens.vocabulary import ActionType

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What handling one message produced: a status to report and/or a dead letter."""

    status: ActionStatus | None = None
    dead_letter: DeadLetter | None = None
    duplicate: bool = False


@dataclass(frozen=True, slots=True)
class Execution:
    """One action carried out: when, which, and the nodes it isolated (empty: none)."""

    ts: float
    action_id: str
    nodes: tuple[str, ...]


ISOLATING = frozenset({ActionType.EVICT_NODES, ActionType.RUN_DIAGNOSTICS})  # drain / cordon the named nodes


def cap_refusal(cfg: RunnerConfig, executions: list[Execution], action: Action, now: float,
                already_isolated: set[str] | frozenset[str] = frozenset()) -> str | None:
    """Why the runner's own caps forbid carrying out ``action`` now, or None. ``already_isolated``: nodes
    the scheduler has taken out of service already (Slurm's drained nodes), counted with the ledger's."""
    recent = [e for e in executions if now - e.ts < cfg.rate_window_s]
    if len(recent) >= cfg.max_actions_per_window:
        return (f"runner rate cap: {len(recent)} action(s) executed in the last {cfg.rate_window_s:g} s, "
                f"limit runner.max_actions_per_window={cfg.max_actions_per_window}")
    if action.type in ISOLATING:
        isolated = {n for e in executions if now - e.ts < 3600.0 for n in e.nodes} | set(already_isolated)
        after = isolated | set(action.nodes)
        if len(after) > cfg.max_nodes_evicted_per_hour:
            held = f" ({len(set(already_isolated))} drained in the scheduler)" if already_isolated else ""
            return (f"runner fleet cap: {len(isolated)} distinct node(s) isolated in the last hour{held}, "
                    f"{len(after - isolated)} more would pass runner.max_nodes_evicted_per_hour="
                    f"{cfg.max_nodes_evicted_per_hour}")
    return None


IN_DOUBT = "started"  # recorded before anything runs; still the last word after a crash mid-action
PENDING = "pending"  # the scheduler could not take it: tried again (the message is kept in the ledger)


class Ledger:
    """Action ids already handled, with their status and the steps that finished; a JSON-lines
    file when ``path`` is set (fsynced per entry, so it survives a kill -9).

    Bounded: an id whose last entry is older than ``keep_s`` and that is neither in flight nor pending
    is forgotten (a redelivery of it is older than ``runner.max_action_age_s`` by then, and refused
    as stale), executions older than ``executions_keep_s`` too (the caps look back an hour); the file
    is rewritten to what is left (temporary file, fsync, rename) at start, on a write ``keep_s`` after
    the last rewrite, and whenever it holds more than twice what the last rewrite left plus
    ``COMPACT_SLACK`` lines."""

    COMPACT_SLACK = 1000

    def __init__(self, path: str = "", *, keep_s: float = 0.0, executions_keep_s: float = 3600.0,
                 clock: Callable[[], float] = time.time):
        self.path = Path(path) if path else None
        self.keep_s = keep_s  # 0: never forget
        self.executions_keep_s = executions_keep_s
        self.clock = clock
        self._seen: dict[str, str] = {}
        self._last_ts: dict[str, float] = {}  # action id -> its newest entry's time
        self._steps: dict[str, set[int | str]] = {}
        self._attempts: dict[str, int] = {}  # pending attempts per action id
        self.retries: dict[str, bytes] = {}  # pending action id -> its message, tried again after a restart
        self.executions: list[Execution] = []  # what was carried out, for the runner's caps
        self._lines = 0  # entries in the file (live and forgettable)
        self._compacted_lines = 0  # entries left by the last compaction
        self._compacted_at = clock()  # when: a quiet ledger is compacted once per keep_s as well
        self.compactions = 0
        if self.path is not None and self.path.exists():
            try:
                lines = [ln for ln in self.path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
            except OSError as exc:
                raise LakeError(f"runner ledger {self.path} is unreadable: {exc}") from exc
            self._lines = len(lines)
            for n, line in enumerate(lines, 1):
                try:
                    entry = orjson.loads(line)
                    action_id = entry["action_id"]
                    self._last_ts[action_id] = max(self._last_ts.get(action_id, 0.0), float(entry.get("ts") or 0.0))
                    if "step" in entry:
                        step = entry["step"]
                        self._steps.setdefault(action_id, set()).add(step if isinstance(step, str) else int(step))
                    elif "executing" in entry:
                        self.executions.append(Execution(float(entry["ts"]), str(action_id),
                                                         tuple(str(n) for n in entry["nodes"])))
                    else:
                        self._seen[action_id] = entry["status"]
                        if entry["status"] == PENDING:
                            self._attempts[action_id] = int(entry.get("attempts") or self._attempts.get(action_id, 0) + 1)
                            self.retries[action_id] = str(entry["retry"]).encode()
                        else:
                            self.retries.pop(action_id, None)
                except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                    if n == len(lines):  # a kill -9 mid-write tears at most the last entry
                        log.warning("runner ledger %s: torn last entry ignored (%s)", self.path, exc)
                        continue
                    raise LakeError(f"runner ledger {self.path} line {n} is unreadable: {exc}") from exc
            self.compact()

    def __contains__(self, action_id: str) -> bool:
        return action_id in self._seen

    def __len__(self) -> int:
        return len(self._last_ts)

    def status(self, action_id: str) -> str | None:
        return self._seen.get(action_id)

    def in_doubt(self, action_id: str) -> bool:
        """Started and never finished (the runner stopped while carrying it out), or pending a retry."""
        return self._seen.get(action_id) in (IN_DOUBT, PENDING)

    def steps_done(self, action_id: str) -> set[int | str]:
        return set(self._steps.get(action_id, ()))

    def attempts(self, action_id: str) -> int:
        """How many times the scheduler could not take this action."""
        return self._attempts.get(action_id, 0)

    def record(self, action_id: str, status: str) -> None:
        self._seen[action_id] = status
        self.retries.pop(action_id, None)
        self._write({"action_id": action_id, "status": status, "ts": self.clock()})

    def record_pending(self, action_id: str, value: bytes, detail: str) -> None:
        """Not taken now: kept with its message (``value``) so a restarted runner tries it again."""
        self._seen[action_id] = PENDING
        self._attempts[action_id] = self._attempts.get(action_id, 0) + 1
        self.retries[action_id] = value
        self._write({"action_id": action_id, "status": PENDING, "ts": self.clock(), "detail": detail[:500],
                     "retry": value.decode("utf-8", "replace"), "attempts": self._attempts[action_id]})

    def record_execution(self, execution: Execution) -> None:
        """An action is about to be carried out on these nodes (the caps count it from now on)."""
        self.executions.append(execution)
        self._write({"action_id": execution.action_id, "executing": True, "nodes": list(execution.nodes),
                     "ts": execution.ts})

    def record_step(self, action_id: str, step: int | str) -> None:
        """Step ``step`` of the action's plan finished: a resumed action does not run it again."""
        self._steps.setdefault(action_id, set()).add(step)
        self._write({"action_id": action_id, "step": step, "ts": self.clock()})

    def _write(self, entry: dict[str, Any]) -> None:
        action_id = str(entry["action_id"])
        self._last_ts[action_id] = max(self._last_ts.get(action_id, 0.0), float(entry["ts"]))
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("ab") as f:
                f.write(orjson.dumps(entry) + b"\n")
                f.flush()
                os.fsync(f.fileno())
            self._lines += 1
            if self._lines > 2 * self._compacted_lines + self.COMPACT_SLACK or (
                    self.keep_s > 0 and entry["ts"] - self._compacted_at > self.keep_s):
                self.compact()

    def compact(self) -> int:
        """Forget what no redelivery can need any more and rewrite the file to the rest; returns the
        number of action ids forgotten."""
        now = self._compacted_at = self.clock()
        forgotten = []
        if self.keep_s > 0:
            forgotten = [a for a, ts in self._last_ts.items()
                         if now - ts > self.keep_s and self._seen.get(a) not in (IN_DOUBT, PENDING)]
        for a in forgotten:
            for table in (self._seen, self._last_ts, self._steps, self._attempts, self.retries):
                table.pop(a, None)
        if self.executions_keep_s > 0:
            self.executions = [e for e in self.executions if now - e.ts <= self.executions_keep_s]
        if self.path is None or (not forgotten and self._lines <= len(self._last_ts) + len(self.executions)):
            self._compacted_lines = self._lines
            return len(forgotten)
        entries: list[dict[str, Any]] = []
        for a, ts in self._last_ts.items():
            entries.extend({"action_id": a, "step": s, "ts": ts} for s in sorted(self._steps.get(a, ()), key=str))
            if a in self._seen:
                entry: dict[str, Any] = {"action_id": a, "status": self._seen[a], "ts": ts}
                if a in self.retries:
                    entry.update(retry=self.retries[a].decode("utf-8", "replace"), attempts=self._attempts.get(a, 1))
                entries.append(entry)
        entries.extend({"action_id": e.action_id, "executing": True, "nodes": list(e.nodes), "ts": e.ts}
                       for e in self.executions)
        replace_lines(self.path, (orjson.dumps(e) for e in entries))
        self._lines = self._compacted_lines = len(entries)
        self.compactions += 1
        return len(forgotten)


def _cmdline(argv: Any) -> str:
    return subprocess.list2cmdline(list(argv))


class ActionRunner:
    """Executes actions from the bus through one adapter; see the module docstring."""

    def __init__(
        self,
        config: Config,
        *,
        adapter: Adapter | None = None,
        bootstrap: str | None = None,
        env: Mapping[str, str] | None = None,
        metrics: ServiceMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.config = config
        self.cfg = config.runner
        self.adapter = adapter if adapter is not None else make_adapter(config.runner)
        self.bootstrap = bootstrap
        self.env = env
        self.metrics = metrics if metrics is not None else ServiceMetrics("runner")
        self.clock = clock
        self.validator = EventValidator("actions")
        self.keyring = Keyring.from_config(config.keys, clock=clock)  # a bad key file fails here, at start
        if self.cfg.execute and not self.cfg.state_path:
            raise ConfigError("--execute needs the ledger (at most once across restarts); set a file",
                              key="runner.state_path")
        # An id is forgotten once a redelivery of it would be refused as too old anyway (plus the skew).
        self.ledger = Ledger(self.cfg.state_path, clock=clock,
                             keep_s=self.cfg.max_action_age_s + config.keys.max_skew_s + 60.0,
                             executions_keep_s=max(self.cfg.rate_window_s, 3600.0))
        self.topic = topics.topic("actions", config.bus.topic_prefix)
        # Pending actions (the scheduler could not take them) and when each is tried again: those a
        # stopped runner left pending are due at once.
        self.retry_at: dict[str, float] = {a: self.clock() for a in self.ledger.retries}

    # ------------------------------------------------------------------ one message

    def handle(self, value: bytes, *, partition: int = 0, offset: int = -1, key: str | None = None) -> Outcome:
        """Decide and (maybe) execute one actions-topic message. Never raises for a bad message."""
        if not value:  # a tombstone or an empty message: nothing to act on
            return self._dead(value or b"", "empty_message", "no payload", partition, offset, key)
        try:
            event = orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            return self._dead(value, "malformed_json", str(exc), partition, offset, key)
        if self.keyring:
            try:
                self.keyring.verify(event)
            except Unverified as exc:  # forged, unsigned, expired, future: never reported, never in the ledger
                return self._dead(value, exc.reason, exc.detail, partition, offset, key)
        problems = self.validator.errors(event)
        if problems:
            return self._dead(value, "schema_invalid", "; ".join(problems[:5]), partition, offset, key, event=event)
        try:
            action = schema.from_dict("actions", event["data"])
        except SchemaError as exc:
            return self._dead(value, exc.reason, str(exc), partition, offset, key, event=event)
        resume = self.ledger.in_doubt(action.id)
        if action.id in self.ledger and not resume:
            log.info("action %s already handled (%s): not run again", action.id, self.ledger.status(action.id))
            self.metrics.actions.labels(type=action.type, status="duplicate").inc()
            return Outcome(duplicate=True)
        if resume:
            log.warning("action %s was %s: resuming after step(s) %s", action.id,
                        "pending" if self.ledger.status(action.id) == PENDING else "in flight when the runner stopped",
                        sorted(map(str, self.ledger.steps_done(action.id))) or "none")
        else:
            self.ledger.record(action.id, IN_DOUBT)
        status = self._decide_and_run(action, event)
        if status.status == PENDING:
            attempt = self.ledger.attempts(action.id) + 1
            if attempt >= self.cfg.pending_retries:
                status = msgspec.structs.replace(status, status="failed", detail=(
                    f"gave up after {attempt} attempt(s) (runner.pending_retries); the scheduler's last word: "
                    f"{status.detail}"))
            else:
                status = msgspec.structs.replace(status, detail=(
                    f"{status.detail}; attempt {attempt} of {self.cfg.pending_retries}, "
                    f"again in {self.cfg.pending_retry_s:g} s"))
                self.ledger.record_pending(action.id, value, status.detail)
                self.retry_at[action.id] = self.clock() + self.cfg.pending_retry_s
        if status.status != PENDING:
            self.ledger.record(action.id, status.status)
            self.retry_at.pop(action.id, None)
        self.metrics.actions.labels(type=action.type, status=status.status).inc()
        return Outcome(status=status)

    def retry_due(self) -> list[Outcome]:
        """Try again the pending actions whose time has come (``runner.pending_retry_s``)."""
        now = self.clock()
        outcomes = []
        for action_id in [a for a, at in self.retry_at.items() if at <= now]:
            value = self.ledger.retries.get(action_id)
            outcome = self.handle(value) if value is not None else Outcome()
            if outcome.status is None:  # no longer verifies (its signature expired) or not in the ledger
                self.retry_at.pop(action_id, None)
                if self.ledger.in_doubt(action_id):
                    self.ledger.record(action_id, "failed")
            outcomes.append(outcome)
        return outcomes

    def _decide_and_run(self, action: Action, event: Mapping[str, Any]) -> ActionStatus:
        def status(state: str, detail: str, commands: list[list[str]] | None = None,
                   observed: list[dict[str, Any]] | None = None) -> ActionStatus:
            return ActionStatus(ts=self.clock(), action_id=action.id, job=action.job, adapter=self.adapter.name,
                                status=state, detail=detail, commands=commands or [], observed=observed or [])

        age_s = self.clock() - action.ts
        if -age_s > self.config.keys.max_skew_s:
            log.warning("action %s refused: dated %.0f s in the future", action.id, -age_s)
            return status("refused", f"future-dated: the action is stamped {-age_s:.0f} s ahead of the runner's "
                                     f"clock, more than keys.max_skew_s={self.config.keys.max_skew_s:g}")
        if age_s > self.cfg.max_action_age_s:
            log.warning("action %s refused: %.0f s old (runner.max_action_age_s=%g)", action.id, age_s,
                        self.cfg.max_action_age_s)
            return status("refused", f"stale: the action is {age_s:.0f} s old, limit {self.cfg.max_action_age_s:g} s")
        window_s = action.evidence_window_s
        if window_s > 0 and action.evidence_age_s is not None and action.type != ActionType.NOTIFY \
                and action.evidence_age_s + max(0.0, age_s) > window_s:
            seen = action.evidence_age_s + max(0.0, age_s)
            log.warning("action %s refused: its evidence is %.0f s old (window %g s)", action.id, seen, window_s)
            return status("refused", f"stale evidence: the newest evidence is {seen:.0f} s old ({action.evidence_age_s:.0f} s "
                                     f"when decided, {max(0.0, age_s):.0f} s since), past its evidence window "
                                     f"{window_s:g} s (diagnosis.max_evidence_age_s)")
        try:
            check_nodes(action.nodes, required=False)
            steps = self.adapter.plan(action, event)
        except Refused as exc:
            log.warning("action %s (%s) refused: %s", action.id, action.type, exc)
            return status("refused", str(exc))
        would = "; ".join(_cmdline(s.argv) for s in steps)
        if not self.adapter.executes or not self.cfg.execute or action.dry_run:
            why = ("dry-run adapter" if not self.adapter.executes
                   else "action is dry_run" if action.dry_run else "runner not started with --execute")
            text = DryRunAdapter.describe(action) + (f"; would run: {would}" if would else "")
            log.info("[dry-run: %s] action %s: %s", why, action.id, text)
            return status("dry_run", f"{why}: {text}")
        if not self.keyring:
            log.warning("action %s refused: unsigned and no signing key configured; %s", action.id, HOW_TO_MAKE_A_KEY)
            return status("refused", f"unsigned: the runner has no signing key, so it executes nothing; "
                                     f"{HOW_TO_MAKE_A_KEY}")
        if not steps:
            log.info("action %s (%s): nothing to execute for adapter %s", action.id, action.type, self.adapter.name)
            return status("done", f"{action.type}: nothing to execute for the {self.adapter.name} adapter")
        if isinstance(self.adapter, SelfExecuting):
            return self._carry_out(action, event, status)
        if not any(e.action_id == action.id for e in self.ledger.executions):  # a resumed action counted once
            capped = cap_refusal(self.cfg, self.ledger.executions, action, self.clock())
            if capped is not None:
                log.warning("action %s (%s) refused: %s", action.id, action.type, capped)
                return status("refused", capped)
            self.ledger.record_execution(Execution(self.clock(), action.id,
                                                   tuple(action.nodes) if action.type in ISOLATING else ()))
        log.warning("executing action %s (%s) for job %s: %s", action.id, action.type, action.job, would)
        result = self._run_steps(action.id, steps)
        if not result.ok:
            log.error("action %s failed: %s", action.id, result.detail)
        return status("done" if result.ok else "failed", result.detail, result.commands)

    def _carry_out(self, action: Action, event: Mapping[str, Any], status: Callable[..., ActionStatus]) -> ActionStatus:
        """A self-executing adapter (Slurm): it reads the scheduler back around each command; the runner
        lends it the ledger's step marks and applies its caps, counting what the scheduler isolated."""
        adapter: Any = self.adapter
        session = Session(timeout_s=self.cfg.command_timeout_s, env=self.env,
                          done=self.ledger.steps_done(action.id),
                          mark=lambda key: self.ledger.record_step(action.id, key))
        try:
            if not any(e.action_id == action.id for e in self.ledger.executions):  # a resumed action counted once
                isolated = adapter.isolated_nodes(session) if action.type in ISOLATING else set()
                capped = cap_refusal(self.cfg, self.ledger.executions, action, self.clock(), isolated)
                if capped is not None:
                    log.warning("action %s (%s) refused: %s", action.id, action.type, capped)
                    return status("refused", capped, session.commands, session.observed)
                self.ledger.record_execution(Execution(self.clock(), action.id,
                                                       tuple(action.nodes) if action.type in ISOLATING else ()))
            log.warning("executing action %s (%s) for job %s through %s", action.id, action.type, action.job,
                        self.adapter.name)
            result = adapter.carry_out(action, event, session)
        except Refused as exc:
            log.warning("action %s (%s) refused: %s", action.id, action.type, exc)
            return status("refused", str(exc), session.commands, session.observed)
        except Pending as exc:
            log.warning("action %s (%s) pending: %s", action.id, action.type, exc)
            return status(PENDING, str(exc), session.commands, session.observed)
        if not result.ok:
            log.error("action %s failed: %s", action.id, result.detail)
        return status("done" if result.ok else "failed", result.detail, session.commands, session.observed)

    def _run_steps(self, action_id: str, steps: list[Any]) -> Any:
        """Run the plan one step at a time, each recorded in the ledger when it finishes, so a runner
        killed mid-action resumes at the step in flight (steps are idempotent: drain, cordon, taint,
        a hook keyed by the action id) and never repeats a finished one."""
        done = self.ledger.steps_done(action_id)
        total = StepsResult(ok=True)
        for i, step in enumerate(steps):
            if i in done:
                continue
            result = run_steps([step], timeout_s=self.cfg.command_timeout_s, env=self.env)
            total.commands.extend(result.commands)
            if not result.ok:
                total.ok, total.detail = False, result.detail
                return total
            self.ledger.record_step(action_id, i)
        skipped = len(done & set(range(len(steps))))
        total.detail = f"{len(steps) - skipped} command(s) succeeded" + (
            f" ({skipped} finished before a restart)" if skipped else "")
        return total

    def _dead(self, value: bytes, reason: str, detail: str, partition: int, offset: int, key: str | None,
              *, event: Any = None) -> Outcome:
        """Dead-letter a message; ``event`` (a verified envelope): also report its action ``refused``."""
        log.warning("actions message at %s[%d]@%d dead-lettered: %s: %s", self.topic, partition, offset, reason,
                    detail[:300])
        self.metrics.dead_letters.labels(topic=self.topic, reason=reason).inc()
        letter = DeadLetter(ts=self.clock(), topic=self.topic, partition=partition, offset=offset, reason=reason,
                            detail=detail[:2000], key=key, payload=value[:schema.MAX_MESSAGE_BYTES].decode(
                                "utf-8", "backslashreplace"), size=len(value))
        status = None
        data = event.get("data") if isinstance(event, dict) else None
        if isinstance(data, dict) and isinstance(data.get("id"), str) and isinstance(data.get("job"), str):
            action_id = data["id"]
            if action_id not in self.ledger:
                self.ledger.record(action_id, "refused")
                status = ActionStatus(ts=self.clock(), action_id=action_id, job=data["job"],
                                      adapter=self.adapter.name, status="refused",
                                      detail=f"invalid action ({reason}): {detail[:500]}")
                self.metrics.actions.labels(type=str(data.get("type", "unknown"))[:40], status="refused").inc()
        return Outcome(status=status, dead_letter=letter)

    # ------------------------------------------------------------------ the loop

    def run(self, stop: threading.Event | None = None, *, max_seconds: float | None = None,
            poll_ms: int = 500) -> int:
        """Consume until ``stop`` is set (or ``max_seconds``); returns the number of messages handled.

        One ``ConsumeLoop``: a batch's statuses are flushed before its offsets are committed; a
        re-delivered action (a commit lost to a crash or a rebalance) is recognised by the ledger."""

        bus = self.config.bus
        try:
            ensure_topics(bus, self.bootstrap, names=("actions", "action-status", "deadletter"))
        except BusError as exc:  # no right to create topics: they may exist already (an operator made them)
            log.warning("runner: could not ensure topics: %s", exc)
        # An action must not wait out Kafka's 500 ms default fetch wait (one runner: 20 fetches/s when idle).
        consumer = Consumer(bus, ["actions"], group_id=self.cfg.group_id, bootstrap=self.bootstrap,
                            fetch_max_wait_ms=50)
        producer = Producer(bus, self.bootstrap)
        handled = 0

        def send(outcome: Outcome) -> None:
            for record in (outcome.status, outcome.dead_letter):
                if record is not None:
                    producer.send(record)
                    self.metrics.messages_produced.labels(
                        topic=topics.topic(type(record).KIND, bus.topic_prefix)).inc()

        def retry_pending() -> None:
            outcomes = self.retry_due()
            for outcome in outcomes:
                send(outcome)
            if outcomes:
                producer.flush(timeout_s=30)

        def handle_batch(messages: Any) -> None:
            nonlocal handled
            for m in messages:
                self.metrics.messages_consumed.labels(topic=m.topic).inc()
                try:
                    outcome = self.handle(m.value, partition=m.partition, offset=m.offset, key=m.key)
                except Exception as exc:  # noqa: BLE001 - one bad action must not stop the runner
                    log.exception("runner: unexpected error on %s[%d]@%d", m.topic, m.partition, m.offset)
                    outcome = self._dead(m.value, "runner_error", repr(exc), m.partition, m.offset, m.key)
                send(outcome)
                handled += 1
            for outcome in self.retry_due():
                send(outcome)
            producer.flush(timeout_s=30)  # a BusError here: the loop rewinds; the ledger stops a second run
            observe_consumer_lag(self.metrics, consumer.raw)

        log.info("runner: adapter %s, %s, consuming %s as group %s", self.adapter.name,
                 "EXECUTING non-dry-run actions" if self.cfg.execute else "dry-run (logs only)", self.topic,
                 self.cfg.group_id)
        if not self.keyring:
            log.warning("runner: no signing key configured: no action will be executed, only dry-run; %s",
                        HOW_TO_MAKE_A_KEY)
        warning = verifier_warning(self.keyring, "runner")
        if warning:
            log.warning("%s", warning)
        loop = ConsumeLoop(consumer, handle_batch, producer=producer, name="runner", max_records=100, poll_ms=poll_ms,
                           metrics=self.metrics, on_idle=retry_pending)
        try:
            loop.run(stop, max_seconds=max_seconds)
        finally:
            producer.close()
        return handled
