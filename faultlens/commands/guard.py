"""``faultlens guard``: the guard's breakers and eviction counts; a person's reset.

The guard log (diagnosis.guardlog) is the topic ``diag-guard`` when a bus is
configured (every online diagnosis instance reads it, so a reset reaches them
within a second), else the JSON-lines file ``guard.state_path`` (batch
diagnosis). A reset is an event on that log with who, when and why.
"""

from __future__ import annotations

import argparse
import getpass
import json
from typing import Any

from faultlens.config import Config
from faultlens.diagnosis.guardlog import KafkaGuardLog, LocalGuardLog
from faultlens.errors import ConfigError

HELP = (
    "Show the guard rails' state (fleet and job breakers, nodes evicted in the last hour, resets) or reset a "
    "breaker after a person has looked at what tripped it. Online: the diag-guard topic (--bootstrap-servers); "
    "batch: the file guard.state_path (--state-path)."
)
EXAMPLE = ("faultlens guard status --bootstrap-servers kafka1:9092\n"
           "  faultlens guard reset --fleet --reason 'switch leaf-7 replaced' --bootstrap-servers kafka1:9092\n"
           "  faultlens guard reset --job j1 --reason 'n003 and n004 passed dcgmi diag' --state-path guard.jsonl")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", choices=["status", "reset"], help="status: print the state; reset: close a breaker")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--job", default="", help="reset: the job whose breaker and eviction count start afresh")
    scope.add_argument("--fleet", action="store_true", help="reset: the fleet breaker and the fleet's count")
    p.add_argument("--reason", default="", help="reset: why (recorded with who and when; required)")
    p.add_argument("--by", default="", help="reset: who (default: the login name)")
    p.add_argument("--state-path", default=None, help="the guard log file (when not given: guard.state_path)")
    p.add_argument("--json", action="store_true", help="status: one JSON object")


def open_log(config: Config, state_path: str | None) -> Any:
    """The guard log a person acts on: the topic when a bus is configured, else the file."""

    path = state_path if state_path is not None else config.guard.state_path
    if config.bus.bootstrap_servers:
        return KafkaGuardLog(config.guard, config.bus, backup_path=path or "")
    if path:
        return LocalGuardLog(config.guard, path)
    raise ConfigError("no guard log: give --bootstrap-servers (online diagnosis) or --state-path FILE "
                      "(guard.state_path of batch diagnosis)", key="guard.state_path")


def _print_status(status: dict[str, Any]) -> None:
    fleet = status["fleet_breaker"]
    print(f"fleet breaker: {'OPEN since ts ' + str(fleet['since_ts']) + ': ' + fleet['reason'] if fleet else 'closed'}")
    for job, b in sorted(status["job_breakers"].items()):
        print(f"job breaker {job}: OPEN since ts {b['since_ts']}: {b['reason']}")
    ev = status["evicted_last_hour"]
    caps = status["caps"]
    print(f"evicted in the last hour: {len(ev['fleet'])} node(s) fleet-wide (cap {caps['max_evictions_fleet_per_hour']})")
    for job, nodes in sorted(ev["jobs"].items()):
        print(f"  {job}: {', '.join(nodes)}")
    for r in status["resets"][-10:]:
        print(f"reset {r['scope']}{' ' + r['job'] if r.get('job') else ''} by {r['by']} at wall {r['wall']:.0f}: "
              f"{r['reason']}")


def run(args: argparse.Namespace, config: Config) -> int:
    if args.what == "reset":
        if not (args.fleet or args.job):
            raise ConfigError("reset needs --fleet or --job J", key="--job")
        if not args.reason.strip():
            raise ConfigError("reset needs --reason: what a person checked before letting evictions resume",
                              key="--reason")
    guard_log = open_log(config, args.state_path)
    try:
        guard_log.read_to_end()
        if args.what == "status":
            status = guard_log.book.status()
            if args.json:
                print(json.dumps(status, default=str))
            else:
                _print_status(status)
            return 0
        event = guard_log.reset("fleet" if args.fleet else "job", job=args.job,
                                by=args.by or getpass.getuser(), reason=args.reason.strip())
        print(f"reset {event['scope']}{' ' + event['job'] if event['job'] else ''} recorded "
              f"(by {event['by']}, event {event['eid']})")
        return 0
    finally:
        close = getattr(guard_log, "close", None)
        if close is not None:
            close()
