"""ActionRunner: consumes actions, executes them through an adapter, reports the result.

For each message on the actions topic (consumer group ``runner.group_id``):

1. parse and validate the CloudEvent against ``schemas/action.schema.json``,
   then decode the Action; anything wrong is dead-lettered (and, when the
   message names an action id and job, reported ``refused``): a bad message
   never stops the runner;
2. once per action id: a re-delivered action (a rebalance, a restart before
   the commit) is recognised by its id and not executed again. The id is
   written to the ledger (``runner.state_path``, or memory) *before* anything
   runs, so execution is at most once even across a crash;
3. refuse what is unsafe: actions older than ``runner.max_action_age_s`` (a
   replayed topic), node names that are not host names, job ids the adapter
   cannot use, action types the adapter does not support;
4. execute only when the runner was started with ``runner.execute`` (the
   ``--execute`` flag) *and* the action says ``dry_run: false``; otherwise log
   what would run and report ``dry_run``;
5. produce an ``ActionStatus`` on action-status with every command line started
   and, on failure, the tail of stderr; then commit the offsets.

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

import orjson

from faultlens.config import Config
from faultlens.diagnosis.adapter_base import Adapter, Refused, check_nodes, run_steps
from faultlens.diagnosis.adapter_dryrun import DryRunAdapter
from faultlens.diagnosis.adapters import make_adapter
from faultlens.diagnosis.event_schemas import EventValidator
from faultlens.errors import BusError, LakeError, SchemaError
from faultlens.metrics import ServiceMetrics
from faultlens.stream import schema, topics
from faultlens.stream.schema import Action, ActionStatus, DeadLetter

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What handling one message produced: a status to report and/or a dead letter."""

    status: ActionStatus | None = None
    dead_letter: DeadLetter | None = None
    duplicate: bool = False


class Ledger:
    """Action ids already handled, with their status; a JSON-lines file when ``path`` is set."""

    def __init__(self, path: str = ""):
        self.path = Path(path) if path else None
        self._seen: dict[str, str] = {}
        if self.path is not None and self.path.exists():
            try:
                for line in self.path.read_text(encoding="utf-8").splitlines():
                    if line.strip():
                        entry = orjson.loads(line)
                        self._seen[entry["action_id"]] = entry["status"]
            except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as exc:
                raise LakeError(f"runner ledger {self.path} is unreadable: {exc}") from exc

    def __contains__(self, action_id: str) -> bool:
        return action_id in self._seen

    def status(self, action_id: str) -> str | None:
        return self._seen.get(action_id)

    def record(self, action_id: str, status: str) -> None:
        self._seen[action_id] = status
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("ab") as f:
                f.write(orjson.dumps({"action_id": action_id, "status": status, "ts": time.time()}) + b"\n")
                f.flush()
                os.fsync(f.fileno())


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
        self.ledger = Ledger(self.cfg.state_path)
        self.topic = topics.topic("actions", config.bus.topic_prefix)

    # ------------------------------------------------------------------ one message

    def handle(self, value: bytes, *, partition: int = 0, offset: int = -1, key: str | None = None) -> Outcome:
        """Decide and (maybe) execute one actions-topic message. Never raises for a bad message."""
        try:
            event = orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            return self._dead(value, "malformed_json", str(exc), partition, offset, key)
        problems = self.validator.errors(event)
        if problems:
            return self._dead(value, "schema_invalid", "; ".join(problems[:5]), partition, offset, key, event=event)
        try:
            action = schema.from_dict("actions", event["data"])
        except SchemaError as exc:
            return self._dead(value, exc.reason, str(exc), partition, offset, key, event=event)
        if action.id in self.ledger:
            log.info("action %s already handled (%s): not run again", action.id, self.ledger.status(action.id))
            self.metrics.actions.labels(type=action.type, status="duplicate").inc()
            return Outcome(duplicate=True)
        self.ledger.record(action.id, "started")
        status = self._decide_and_run(action, event)
        self.ledger.record(action.id, status.status)
        self.metrics.actions.labels(type=action.type, status=status.status).inc()
        return Outcome(status=status)

    def _decide_and_run(self, action: Action, event: Mapping[str, Any]) -> ActionStatus:
        def status(state: str, detail: str, commands: list[list[str]] | None = None) -> ActionStatus:
            return ActionStatus(ts=self.clock(), action_id=action.id, job=action.job, adapter=self.adapter.name,
                                status=state, detail=detail, commands=commands or [])

        age_s = self.clock() - action.ts
        if age_s > self.cfg.max_action_age_s:
            log.warning("action %s refused: %.0f s old (runner.max_action_age_s=%g)", action.id, age_s,
                        self.cfg.max_action_age_s)
            return status("refused", f"stale: the action is {age_s:.0f} s old, limit {self.cfg.max_action_age_s:g} s")
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
        if not steps:
            log.info("action %s (%s): nothing to execute for adapter %s", action.id, action.type, self.adapter.name)
            return status("done", f"{action.type}: nothing to execute for the {self.adapter.name} adapter")
        log.warning("executing action %s (%s) for job %s: %s", action.id, action.type, action.job, would)
        result = run_steps(steps, timeout_s=self.cfg.command_timeout_s, env=self.env)
        if not result.ok:
            log.error("action %s failed: %s", action.id, result.detail)
        return status("done" if result.ok else "failed", result.detail, result.commands)

    def _dead(self, value: bytes, reason: str, detail: str, partition: int, offset: int, key: str | None,
              *, event: Any = None) -> Outcome:
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
        """Consume until ``stop`` is set (or ``max_seconds``); returns the number of messages handled."""
        from faultlens.metrics import observe_consumer_lag
        from faultlens.stream.bus import Consumer, Producer, ensure_topics

        stop = stop or threading.Event()
        bus = self.config.bus
        try:
            ensure_topics(bus, self.bootstrap, names=("actions", "action-status", "deadletter"))
        except BusError as exc:  # no right to create topics: they may exist already (an operator made them)
            log.warning("runner: could not ensure topics: %s", exc)
        consumer = Consumer(bus, ["actions"], group_id=self.cfg.group_id, bootstrap=self.bootstrap)
        producer = Producer(bus, self.bootstrap)
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        handled = 0
        log.info("runner: adapter %s, %s, consuming %s as group %s", self.adapter.name,
                 "EXECUTING non-dry-run actions" if self.cfg.execute else "dry-run (logs only)", self.topic,
                 self.cfg.group_id)
        try:
            while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
                try:
                    messages = consumer.poll(poll_ms, max_records=100)
                except BusError as exc:
                    log.error("runner: %s; retrying", exc)
                    stop.wait(1.0)
                    continue
                for m in messages:
                    self.metrics.messages_consumed.labels(topic=m.topic).inc()
                    try:
                        outcome = self.handle(m.value, partition=m.partition, offset=m.offset, key=m.key)
                    except Exception as exc:  # noqa: BLE001 - one bad action must not stop the runner
                        log.exception("runner: unexpected error on %s[%d]@%d", m.topic, m.partition, m.offset)
                        outcome = self._dead(m.value, "runner_error", repr(exc), m.partition, m.offset, m.key)
                    for record in (outcome.status, outcome.dead_letter):
                        if record is not None:
                            producer.send(record)
                            self.metrics.messages_produced.labels(
                                topic=topics.topic(type(record).KIND, bus.topic_prefix)).inc()
                    handled += 1
                if messages:
                    try:
                        producer.flush(timeout_s=30)
                        consumer.commit()
                    except BusError as exc:
                        # The ledger keeps re-delivered actions from running twice.
                        log.error("runner: %s", exc)
                    observe_consumer_lag(self.metrics, consumer.raw)
        finally:
            producer.close()
            consumer.close()
        return handled
