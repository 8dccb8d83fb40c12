"""Red team: every attack of issue 24 against the real services, each counted.

Each attack is one function registered with ``@attack("name")``; it returns a dict of
counts whose keys name what went wrong (forged actions executed, injection effects,
forged log lines, crash loops, secrets in logs, evictions past a cap, ...). Every count
must be zero. Attacks run against real processes or the real classes on the embedded
broker (Tansu), never mocks.

    python benchmarks/redteam.py            # every attack
    python benchmarks/redteam.py --quick    # the same attacks, smaller volumes
    python benchmarks/redteam.py --smoke    # one small case per attack (seconds)
    python benchmarks/redteam.py --only forged_actions,injection

Last line: one JSON object, ``{"bench": "redteam", "<attack>.<count>": n, ..., "total": n}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from faultlens import lifeline  # noqa: E402 - after the path: children die with this script


@dataclass(frozen=True)
class Scale:
    """How hard each attack pushes: ``smoke`` (seconds), ``quick``, full."""

    name: str
    factor: float  # 1.0 = full volumes

    def n(self, full: int, minimum: int = 1) -> int:
        return max(minimum, int(full * self.factor))


AttackFn = Callable[[Scale], dict[str, int]]
ATTACKS: dict[str, AttackFn] = {}


def attack(name: str) -> Callable[[AttackFn], AttackFn]:
    """Register an attack under ``name`` (its counts print as ``name.count``)."""

    def register(fn: AttackFn) -> AttackFn:
        ATTACKS[name] = fn
        return fn

    return register


# ---------------------------------------------------------------------------
# Signed actions, injection, forged log lines, secrets, the runner's ledger
# (issue 24 items 1, 2, 6, 7)
# ---------------------------------------------------------------------------

# Each attack below starts its own embedded broker and real `faultlens runner` / `diagnose` /
# `stream` processes (a hook program that records its argv stands in for the site's tooling),
# except `injection`, which drives the real ActionRunner and adapters in this process with
# real subprocesses (a stand-in `ssh` runs its remote command through `sh -c`, as sshd would).

_FORGED_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \w+ faultlens\.diagnosis\.runner\.runner: "
                          r"executing action act-FORGED", re.M)


def _faultlens(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return lifeline.spawn([sys.executable, "-m", "faultlens.cli", *args], signum=signal.SIGTERM, cwd=cwd, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen[bytes], *, kill: bool = False) -> str:
    (proc.kill if kill else proc.terminate)()
    try:
        out = proc.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate()[0]
    return out.decode("utf-8", "replace")


class _Site:
    """A work directory with a signing key pair (diagnosis' private file, the runner's and agents' .pub),
    a recording hook on PATH and a topic prefix on one broker."""

    def __init__(self, root: Path, bootstrap: str, prefix: str):
        from faultlens.config import BusConfig, KeysConfig
        from faultlens.stream.bus import ensure_topics
        from faultlens.stream.signing import Ed25519Key, Keyring, new_key, public_path, write_key
        from tests.runner_standins import env_with, write_standin

        self.dir = root / prefix
        self.dir.mkdir(parents=True)
        key = new_key("redteam")
        assert isinstance(key, Ed25519Key)
        self.private_file = write_key(key, self.dir / "key.toml")  # diagnosis only
        self.key_file = write_key(key.public_half(), public_path(self.private_file))  # runner and agents
        self.keyring = Keyring.from_config(KeysConfig(files=(str(self.private_file),)))
        self.calls = self.dir / "calls.jsonl"
        for tool in ("hook", "scontrol", "kubectl"):
            write_standin(self.dir / "bin", tool, self.calls)
        self.env = env_with(self.dir / "bin")
        self.bus = BusConfig(bootstrap_servers=bootstrap, topic_prefix=prefix, linger_ms=5)
        ensure_topics(self.bus, names=("actions", "action-status", "deadletter"))
        self.bootstrap, self.prefix = bootstrap, prefix

    def runner(self, *sets: str) -> subprocess.Popen[bytes]:
        """`faultlens runner --execute --adapter command` on this site (ledger: the default file in its dir)."""
        args = ["runner", "--execute", "--adapter", "command", "--bootstrap-servers", self.bootstrap,
                "--set", f"bus.topic_prefix={self.prefix}", "--set", f"keys.files={self.key_file}",
                "--set", "runner.hook_command=hook {action}", "--set", f"runner.group_id=runner-{self.prefix}"]
        for item in sets:
            args += ["--set", item]
        return _faultlens(*args, cwd=self.dir, env=self.env)

    def hooks(self) -> list[list[str]]:
        from tests.runner_standins import recorded

        return recorded(self.calls)

    def statuses(self, want: set[str], timeout_s: float = 60.0) -> dict[str, Any]:
        """Action statuses on action-status until every id in ``want`` has one (or the timeout)."""
        from faultlens import schema
        from faultlens.stream.bus import Consumer

        got: dict[str, Any] = {}
        with Consumer(self.bus, ["action-status"], group_id=None) as consumer:
            deadline = time.monotonic() + timeout_s
            while not want <= set(got) and time.monotonic() < deadline:
                for m in consumer.poll(200):
                    st = schema.decode("action-status", m.value)
                    got[st.action_id] = st
        return got


def _action(id_: str, *, type_: str = "restart_job", nodes: tuple[str, ...] = (), ts: float | None = None,
            job: str = "4242", reason: str = "redteam") -> Any:
    from faultlens import schema

    return schema.Action(id=id_, incident_id="inc-rt", job=job, ts=time.time() if ts is None else ts, type=type_,
                         nodes=list(nodes), confidence=0.99, dry_run=False, reason=reason)


def _send(site: _Site, events: list[dict[str, Any]]) -> None:
    from faultlens.stream.bus import Producer

    with Producer(site.bus) as producer:
        for event in events:
            producer.send_raw("actions", event.get("subject"), json.dumps(event).encode())
        producer.flush(30)


@attack("forged_actions")
def forged_actions(scale: Scale) -> dict[str, int]:
    """Unsigned, wrongly signed, expired and future-dated actions (dry_run false) against a real runner."""
    from faultlens import schema
    from faultlens.stream.bus.embedded_broker import EmbeddedBroker
    from faultlens.stream.signing import Ed25519Key, Keyring

    n = scale.n(50, minimum=8)
    with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker() as broker:
        site = _Site(Path(tmp), broker.bootstrap, "rtforged")
        wrong = Keyring([Ed25519Key.from_seed("redteam", b"\x05" * 32)])  # the right key id, a guessed key
        past = Keyring(list(site.keyring.keys.values()), clock=lambda: time.time() - 7200)  # expired an hour ago
        events = []
        for i in range(n):
            cloud = schema.cloudevent(_action(f"act-forged-{i}", ts=time.time() + (86400 if i % 4 == 3 else 0)))
            events.append([cloud, wrong.sign(cloud), past.sign(cloud), site.keyring.sign(cloud)][i % 4])
        events.append(site.keyring.sign(schema.cloudevent(_action("act-legit"))))  # the canary: must run
        runner = site.runner()
        try:
            _send(site, events)
            site.statuses({"act-legit"})
        finally:
            _stop(runner)
        ran = [argv[1] for argv in site.hooks()]
    return {"forged_executed": sum(1 for a in ran if a.startswith("act-forged")),
            "legit_not_executed": int("act-legit" not in ran)}


@attack("agent_key_forges_action")
def agent_key_forges_action(scale: Scale) -> dict[str, int]:
    """A broken-into GPU node: the attacker holds the agent's key file (the .pub) and a signed command it
    received, and sends evict_nodes for the fleet to a real `faultlens runner --execute`."""
    import orjson

    from faultlens import schema
    from faultlens.config import KeysConfig
    from faultlens.errors import ConfigError
    from faultlens.stream.bus.embedded_broker import EmbeddedBroker
    from faultlens.stream.signing import (
        SIG_ATTR,
        SIGALG_ATTR,
        Ed25519Key,
        Key,
        Keyring,
        canonical,
        read_key,
    )

    n = scale.n(40, minimum=8)
    with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker() as broker:
        site = _Site(Path(tmp), broker.bootstrap, "rtagentkey")
        stolen = read_key(site.key_file)  # what the agent's DaemonSet mounts
        public_signed = 0
        try:
            Keyring.from_config(KeysConfig(files=(str(site.key_file),))).sign(schema.cloudevent(_action("act-x")))
            public_signed = 1
        except ConfigError:
            pass
        assert isinstance(stolen, Ed25519Key) and not stolen.can_sign
        confused = Key(stolen.id, stolen.public)  # the public key bytes taken for an HMAC secret
        as_hmac = Keyring([confused])
        own = Keyring([Ed25519Key.from_seed(stolen.id, b"\x07" * 32)])  # a fresh pair under the stolen id
        command = site.keyring.sign(schema.cloudevent(schema.Command("cmd-rt", time.time(), "dump_stacks", "4242",
                                                                     ["n001"])))  # what the node received
        events = []
        for i in range(n):
            evict = schema.cloudevent(_action(f"act-agentkey-{i}", type_="evict_nodes", nodes=(f"n{i:03d}",)))
            variant = i % 4
            if variant == 0:  # the public key bytes as an HMAC secret (algorithm confusion)
                events.append(as_hmac.sign(evict))
            elif variant == 1:  # the same, labelled ed25519 so a careless verifier takes the event's word
                relabelled = dict(as_hmac.sign(evict), **{SIGALG_ATTR: "ed25519"})
                relabelled[SIG_ATTR] = confused.mac(canonical(relabelled))
                events.append(relabelled)
            elif variant == 2:
                events.append(own.sign(evict))
            else:  # the received command's signature pasted onto an eviction
                events.append({**evict, **{k: v for k, v in command.items() if k.startswith("faultlens")}})
        events.append(site.keyring.sign(schema.cloudevent(_action("act-legit", type_="evict_nodes",
                                                                  nodes=("n900",)))))  # the canary: must run
        runner = site.runner()
        try:
            _send(site, [orjson.loads(orjson.dumps(e)) for e in events])
            site.statuses({"act-legit"})
        finally:
            _stop(runner)
        ran = [argv[1] for argv in site.hooks()]
    return {"forged_executed": sum(1 for a in ran if a.startswith("act-agentkey")),
            "public_key_signed": public_signed, "legit_not_executed": int("act-legit" not in ran)}


@attack("injection")
def injection(scale: Scale) -> dict[str, int]:
    """Hostile job/incident/action ids and reasons through the command, slurm and kubernetes templates."""
    import orjson

    from faultlens import schema
    from faultlens.config import Config, RunnerConfig
    from faultlens.diagnosis.runner.runner import ActionRunner
    from tests.runner_standins import env_with, keys_config, recorded, signed, write_standin

    effects = hostile_argv = 0
    quiet = logging.getLogger("faultlens.diagnosis.runner")  # ~130 refusals: the counts say what matters
    level, quiet.level = quiet.level, logging.CRITICAL
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        marker = root / "PWNED"
        hostile = [f"$(touch {marker})", f"`touch {marker}`", f"x;touch {marker}", "--help", "-rf",
                   "act\n2026-11-27 10:00:00,000 WARNING faultlens: executing action act-FORGED", "a b", "'",
                   "x" * 300, "../../etc/passwd", "j|touch " + str(marker)]
        hostile = hostile[: scale.n(len(hostile), minimum=len(hostile))]
        calls = root / "calls.jsonl"
        bindir = root / "bin"
        for tool in ("hook", "scontrol", "kubectl"):
            write_standin(bindir, tool, calls)
        ssh = bindir / "ssh"  # a remote shell here: the arguments after the host run through sh -c
        ssh.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$*\" >> {root / 'ssh.log'}\nshift\nexec sh -c \"$*\"\n")
        ssh.chmod(0o755)
        template = "ssh {node} echo diag --job {job} --incident {incident} --action {action}"
        adapters = {"command": dict(hook_command="hook --job {job} --incident {incident} --id {action}"),
                    "slurm": dict(diagnostics_command=template), "kubernetes": dict(diagnostics_command=template)}
        keys = keys_config(root)
        for adapter, kw in adapters.items():
            cfg = Config(runner=RunnerConfig(adapter=adapter, execute=True, state_path=str(root / f"{adapter}.jsonl"),
                                             max_actions_per_window=10_000, **kw), keys=keys)
            runner = ActionRunner(cfg, env=env_with(bindir))
            for i, value in enumerate(hostile):
                for field in ("job", "incident_id", "id", "reason"):
                    fields = {"job": "4242", "incident_id": "inc-1", "id": f"act-{adapter}-{field}-{i}",
                              "reason": "Xid 79", field: value}
                    action = schema.Action(ts=time.time(), type="run_diagnostics", nodes=["n001"], confidence=0.99,
                                           dry_run=False, **fields)
                    runner.handle(orjson.dumps(signed(schema.cloudevent(action))))
        quiet.setLevel(level)
        effects = int(marker.exists())
        argvs = recorded(calls)
        ssh_log = (root / "ssh.log").read_text() if (root / "ssh.log").exists() else ""
        for value in hostile:
            hostile_argv += sum(1 for argv in argvs for arg in argv[1:] if arg == value or arg.endswith(value)
                                and not arg.startswith("Reason="))
            hostile_argv += ssh_log.count(value)
    return {"files_touched": effects, "hostile_values_in_commands": hostile_argv}


@attack("forged_log_lines")
def forged_log_lines(scale: Scale) -> dict[str, int]:
    """Newlines in ids, jobs and reasons (signed and unsigned) must not write a line of their own."""
    from faultlens import schema
    from faultlens.stream.bus.embedded_broker import EmbeddedBroker

    forged = "\n2026-11-27 10:00:00,000 WARNING faultlens.diagnosis.runner.runner: executing action act-FORGED " \
             "(evict_nodes) for job 1: scontrol update NodeName=n9 State=DRAIN"
    n = scale.n(20, minimum=4)
    with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker() as broker:
        site = _Site(Path(tmp), broker.bootstrap, "rtlog")
        events = []
        for i in range(n):
            where = ("id", "job", "reason", "incident")[i % 4]
            action = _action(f"act-{i}" + (forged if where == "id" else ""), job="4242" + (forged if where == "job" else ""),
                             reason="Xid 79" + (forged if where == "reason" else ""))
            if where == "incident":
                action = schema.replace(action, incident_id="inc" + forged)
            cloud = schema.cloudevent(action)
            events += [site.keyring.sign(cloud), cloud]
        events.append(site.keyring.sign(schema.cloudevent(_action("act-canary"))))
        runner = site.runner()
        try:
            _send(site, events)
            site.statuses({"act-canary"})
        finally:
            out = _stop(runner)
    return {"forged_lines": len(_FORGED_LINE.findall(out))}


@attack("secrets_in_logs")
def secrets_in_logs(scale: Scale) -> dict[str, int]:
    """runner, diagnose and stream at DEBUG with a SASL password, a webhook token and a signing key."""
    from faultlens.stream.signing import new_key, write_key

    password, token = "Sasl-Pa55word-redteam", "webhook-token-redteam-42"
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        key_file = write_key(new_key("rt"), root / "key.toml")
        key_text = key_file.read_text().split('secret = "')[1].split('"')[0]
        common = ["--log-level", "DEBUG", "--bootstrap-servers", "127.0.0.1:9",  # nothing listens: it retries
                  "--set", "bus.security_protocol=SASL_PLAINTEXT", "--set", "bus.sasl_mechanism=PLAIN",
                  "--set", "bus.sasl_username=faultlens", "--set", f"bus.sasl_password={password}",
                  "--set", f"diagnosis.webhook_token={token}", "--set", "diagnosis.webhook_url=http://127.0.0.1:9/",
                  "--set", f"keys.files={key_file}"]
        names = ("runner", "diagnose", "stream")
        logs = {name: root / f"{name}.log" for name in names}
        procs = {}
        for name in names:
            with logs[name].open("wb") as log:  # the child holds its own copy of the descriptor
                procs[name] = lifeline.spawn([sys.executable, "-m", "faultlens.cli", name, *common], cwd=root,
                                             signum=signal.SIGTERM, stdout=log, stderr=subprocess.STDOUT)
        time.sleep(3 if scale.name == "smoke" else 6)
        # A loaded machine starts a service slowly: wait (bounded) until each has tried to connect
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(b"sasl_plain_password" in logs[n].read_bytes() for n in names):
            time.sleep(0.5)
        for name, proc in procs.items():
            proc.kill()
            proc.wait(timeout=30)
            out = logs[name].read_text(encoding="utf-8", errors="replace")
            counts[f"{name}_secrets"] = sum(out.count(s) for s in (password, token, key_text))
            # kafka-python dumps its configuration (the password's field) at DEBUG; no dump: nothing was tried
            counts[f"{name}_inconclusive"] = int("sasl_plain_password" not in out)
    return counts


@attack("hooks_run_twice")
def hooks_run_twice(scale: Scale) -> dict[str, int]:
    """Restart the runner (default settings: its ledger on by default) and re-send the actions it ran."""
    from faultlens import schema
    from faultlens.stream.bus.embedded_broker import EmbeddedBroker

    n = scale.n(20, minimum=3)
    with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker() as broker:
        site = _Site(Path(tmp), broker.bootstrap, "rttwice")
        events = [site.keyring.sign(schema.cloudevent(_action(f"act-{i}"))) for i in range(n)]
        ids = {e["id"] for e in events}
        for _life in range(2):
            runner = site.runner()
            try:
                _send(site, events)
                deadline = time.monotonic() + 60
                while len(site.hooks()) < n and time.monotonic() < deadline:
                    time.sleep(0.2)
                time.sleep(1.0 if scale.name == "smoke" else 3.0)  # let a second run show itself
            finally:
                _stop(runner)
        ran = [argv[1] for argv in site.hooks()]
    return {"hooks_run_twice": len(ran) - len(set(ran)), "never_run": len(ids - set(ran))}


@attack("runner_storm")
def runner_storm(scale: Scale) -> dict[str, int]:
    """More actions than the runner's own caps allow: its rate cap and its fleet cap hold on their own."""
    from faultlens import schema
    from faultlens.stream.bus.embedded_broker import EmbeddedBroker

    n, rate_cap, fleet_cap = scale.n(60, minimum=12), 5, 4
    with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker() as broker:
        rate = _Site(Path(tmp), broker.bootstrap, "rtrate")
        fleet = _Site(Path(tmp), broker.bootstrap, "rtfleet")
        rate_events = [rate.keyring.sign(schema.cloudevent(_action(f"act-r{i}"))) for i in range(n)]
        fleet_events = [fleet.keyring.sign(schema.cloudevent(_action(f"act-f{i}", type_="evict_nodes",
                                                                     nodes=(f"n{i:04d}",)))) for i in range(n)]
        runners = [rate.runner(f"runner.max_actions_per_window={rate_cap}"),
                   fleet.runner(f"runner.max_nodes_evicted_per_hour={fleet_cap}")]
        try:
            _send(rate, rate_events)
            _send(fleet, fleet_events)
            rate_status = rate.statuses({e["id"] for e in rate_events})
            fleet_status = fleet.statuses({e["id"] for e in fleet_events})
        finally:
            for r in runners:
                _stop(r)
        fleet_ran = len(fleet.hooks())  # one distinct node per action
    refused = sum(1 for st in [*rate_status.values(), *fleet_status.values()] if st.status == "refused")
    return {"executed_beyond_rate_cap": max(0, len(rate.hooks()) - rate_cap),
            "evicted_beyond_fleet_cap": max(0, fleet_ran - fleet_cap),
            "refusals_unreported": max(0, 2 * n - rate_cap - fleet_cap - refused)}


# ---------------------------------------------------------------------------
# Caps that hold: per-job, fleet, breaker, runner's own limits (issue 24 item 3)
# ---------------------------------------------------------------------------

CAPS_T0 = 1_700_000_000.0
# The Xid 79 line of the recorded attack (the real-logs form tests/fleetgen.py uses).
CAPS_XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."
CAP_REASONS = ("confidence", "job_cap", "fleet_cap", "breaker", "storm", "guard_unavailable")


def _caps_job(name: str, nodes: int) -> tuple[Any, list[str]]:
    """A job of ``nodes`` 8-GPU machines: (its topology record, its node names)."""
    from faultlens.schema import JobTopology
    from faultlens.stream.topology import Topology

    topo = Topology.packed(tp=8, pp=1, dp=nodes, gpus_per_node=8, job=name, node_fmt=f"{name}-n{{:02d}}")
    rec = JobTopology(ts=CAPS_T0 - 10, job=name, **{k: v for k, v in topo.to_job_dict().items() if k != "job"})
    return rec, topo.nodes


def _caps_xid(node: str, ts: float) -> Any:
    from faultlens.schema import KernelEvent

    return KernelEvent(ts=ts, node=node, kind="xid", xid=79, gpu=3, raw=CAPS_XID79)


def _caps_engine(guard: Any, jobs: list[tuple[Any, list[str]]]) -> Any:
    from faultlens.config import Config
    from faultlens.diagnosis.engine import DiagnosisEngine

    engine = DiagnosisEngine(Config(guard=guard), batch=True)
    for rec, _ in jobs:
        engine.set_topology(rec)
    return engine


def _caps_run(engine: Any, records: list[Any]) -> tuple[list[Any], list[Any]]:
    """The real engine over time-ordered records, ended as batch diagnosis ends: (actions, incidents)."""
    from faultlens.diagnosis.engine import run_records
    from faultlens.schema import Action

    out = run_records(engine, sorted(records, key=lambda r: r.ts))
    return [o for o in out if isinstance(o, Action)], engine.incidents()


def _past_cap(evictions: list[tuple[float, str]], cap: int) -> int:
    """The most distinct nodes evicted within any hour, beyond ``cap``."""
    worst = 0
    for start, _ in evictions:
        worst = max(worst, len({n for t, n in evictions if start <= t < start + 3600.0}))
    return max(0, worst - cap)


def _evictions(actions: list[Any], job: str | None = None) -> list[tuple[float, str]]:
    return [(a.ts, n) for a in actions if a.type == "evict_nodes" and (job is None or a.job == job) for n in a.nodes]


def _fleet_records(jobs: int = 30, xids: int = 80, minutes: float = 26.0) -> tuple[list[Any], list[Any]]:
    """The recorded fleet attack: ``xids`` Xid 79 on distinct machines of ``jobs`` 8-node jobs in ``minutes``."""
    fleet = [_caps_job(f"fleet{j:02d}", 8) for j in range(jobs)]
    nodes = [n for _, ns in fleet for n in ns]
    records = [_caps_xid(nodes[(k * 3) % len(nodes)], CAPS_T0 + k * minutes * 60.0 / xids) for k in range(xids)]
    return fleet, records


@attack("job_cap")
def attack_job_cap(scale: Scale) -> dict[str, int]:
    """Four Xid 79 one minute apart on each 4-node job: evictions past the job's cap (25% of 4 = 1 an hour)."""
    from faultlens.config import GuardConfig

    # the job cap alone: the fleet's cap and storm detector (which many jobs at once would trip) off
    guard = GuardConfig(max_evictions_fleet_per_hour=1_000_000, storm_nodes=1_000_000)
    jobs = [_caps_job(f"cap{j:03d}", 4) for j in range(scale.n(40))]
    engine = _caps_engine(guard, jobs)
    actions, _ = _caps_run(engine, [_caps_xid(n, CAPS_T0 + 60.0 * i + j) for j, (_, ns) in enumerate(jobs)
                                    for i, n in enumerate(ns)])
    allowed = min(guard.max_evictions_per_job_per_hour, max(1, int(guard.max_evicted_fraction * 4)))
    past = sum(_past_cap(_evictions(actions, rec.job), allowed) for rec, _ in jobs)
    return {"evictions_past_job_cap": past,
            "jobs_without_an_eviction": sum(1 for rec, _ in jobs if not _evictions(actions, rec.job))}


def _online_fleet(jobs: int, xids: int, cap: int, instances: int) -> tuple[int, int]:
    """The fleet attack through ``instances`` real online diagnosis services on the embedded broker:
    (evictions past the fleet cap, evictions the instances decided)."""
    import dataclasses

    from faultlens import schema
    from faultlens.config import BusConfig, Config, DiagnosisConfig, GuardConfig
    from faultlens.diagnosis.online import DiagnosisService
    from faultlens.stream.bus import Consumer, Producer, ensure_topics
    from faultlens.stream.bus.embedded_broker import EmbeddedBroker

    fleet, records = _fleet_records(jobs, xids, minutes=26.0 * xids / 80)
    with EmbeddedBroker() as broker:
        bus = BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix="redteam", linger_ms=5)
        config = Config(bus=bus, diagnosis=DiagnosisConfig(group_id="redteam-diag", max_evidence_age_s=0),
                        guard=GuardConfig(max_evictions_fleet_per_hour=cap, storm_nodes=10_000))
        ensure_topics(bus)
        with Producer(bus) as producer:
            for rec, _ in fleet:
                producer.send(rec)
            for r in records:
                producer.send(r)
            producer.flush(10)
        services = [DiagnosisService(dataclasses.replace(config), from_beginning=True, tick_interval_s=0.2).start()
                    for _ in range(instances)]
        actions: dict[str, Any] = {}
        try:
            with Consumer(bus, ["actions"], group_id=None) as c:
                deadline, quiet = time.monotonic() + 120.0, time.monotonic()
                # every Xid gets an action (an eviction or the notify that says why not); then 3 s of quiet
                while time.monotonic() < deadline and (len(actions) < xids or time.monotonic() - quiet < 3.0):
                    for m in c.poll(200):
                        a = schema.decode("actions", m.value)
                        if a.id not in actions:
                            actions[a.id] = a
                            quiet = time.monotonic()
        finally:
            for s in services:
                s.stop(timeout_s=20)
    evictions = _evictions(list(actions.values()))
    return _past_cap(evictions, cap), len(evictions)


@attack("fleet_cap")
def attack_fleet_cap(scale: Scale) -> dict[str, int]:
    """80 Xid 79 across 30 jobs in 26 simulated minutes: evictions past the fleet cap, with the storm
    detector on (default) and off (the cap alone), in one engine and across two online instances."""
    from faultlens.config import GuardConfig

    counts: dict[str, int] = {}
    fleet, records = _fleet_records()
    for label, guard in (("", GuardConfig()), ("_storm_off", GuardConfig(storm_nodes=10_000))):
        engine = _caps_engine(guard, fleet)
        actions, _ = _caps_run(engine, records)
        counts[f"evictions_past_fleet_cap{label}"] = _past_cap(_evictions(actions), guard.max_evictions_fleet_per_hour)
        counts[f"breaker_not_open{label}"] = int(engine.guard_log.book.fleet_breaker is None)
    jobs, xids, cap = (6, 16, 4) if scale.name == "smoke" else (30, 80, 16)
    past, decided = _online_fleet(jobs, xids, cap, instances=2)
    counts["evictions_past_fleet_cap_two_instances"] = past
    counts["two_instances_evicted_nothing"] = int(decided == 0)
    return counts


@attack("breaker_reset")
def attack_breaker_reset(scale: Scale) -> dict[str, int]:
    """The breaker persists across a restart, holds for hours, and closes only by `faultlens guard reset`."""
    import contextlib
    import io
    import tempfile

    from faultlens.cli import main as faultlens
    from faultlens.config import GuardConfig

    counts = {"breaker_lost_on_restart": 0, "breaker_closed_without_a_person": 0, "reset_not_applied": 0,
              "reset_not_recorded": 0, "reset_without_reason_accepted": 0}
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/guard.jsonl"
        guard = GuardConfig(max_evictions_fleet_per_hour=2, storm_nodes=10_000, state_path=path)
        jobs = [_caps_job(f"brk{j}", 8) for j in range(4)]
        first = _caps_engine(guard, jobs)
        _caps_run(first, [_caps_xid(ns[0], CAPS_T0 + 60.0 * k) for k, (_, ns) in enumerate(jobs[:3])])
        restarted = _caps_engine(guard, jobs)
        if restarted.guard_log.book.fleet_breaker is None:
            counts["breaker_lost_on_restart"] = 1
        for hours in (2, 30):  # past the hour's window: the breaker is not a window
            actions, _ = _caps_run(restarted, [_caps_xid(jobs[3][1][hours % 8], CAPS_T0 + hours * 3600.0)])
            counts["breaker_closed_without_a_person"] += sum(a.type == "evict_nodes" for a in actions)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            if faultlens(["guard", "reset", "--fleet", "--state-path", path]) == 0:
                counts["reset_without_reason_accepted"] = 1
            faultlens(["guard", "reset", "--fleet", "--reason", "redteam: fabric checked", "--by", "redteam",
                       "--state-path", path])
        actions, _ = _caps_run(restarted, [_caps_xid(jobs[3][1][5], CAPS_T0 + 31 * 3600.0)])
        # the new Xid's machine is evicted (an eviction the breaker refused on a still-open incident may be
        # claimed again as well: issue 37.6)
        evicted = {n for a in actions if a.type == "evict_nodes" for n in a.nodes}
        counts["reset_not_applied"] = int(jobs[3][1][5] not in evicted)
        resets = restarted.guard_log.book.resets
        counts["reset_not_recorded"] = int(not resets or resets[-1]["by"] != "redteam" or not resets[-1]["wall"])
    return counts


def _suppression_scenarios() -> list[tuple[Any, list[Any], list[Any]]]:
    """(engine, actions, incidents) of the job-cap, fleet and duplicate inputs."""
    from faultlens.config import GuardConfig

    out = []
    four = [_caps_job("sup4", 4)]
    engine = _caps_engine(GuardConfig(), four)
    out.append((engine, *_caps_run(engine, [_caps_xid(n, CAPS_T0 + 60.0 * i) for i, n in enumerate(four[0][1])])))
    fleet, records = _fleet_records()
    engine = _caps_engine(GuardConfig(storm_nodes=10_000), fleet)
    out.append((engine, *_caps_run(engine, records)))
    engine = _caps_engine(GuardConfig(), fleet)
    out.append((engine, *_caps_run(engine, records)))
    dup = [_caps_job("dup", 8)]
    node = dup[0][1][2]
    engine = _caps_engine(GuardConfig(), dup)  # the same machine again after its first incident closed
    out.append((engine, *_caps_run(engine, [_caps_xid(node, CAPS_T0), _caps_xid(node, CAPS_T0 + 600.0)])))
    return out


@attack("silent_suppressions")
def attack_silent_suppressions(scale: Scale) -> dict[str, int]:
    """Every refusal of the guard log and every duplicate must be on an incident (and counted)."""
    counts = {"refusals_without_trace": 0, "duplicates_without_trace": 0, "guarded_actions_without_trace": 0}
    for engine, actions, incidents in _suppression_scenarios():
        traced: dict[str, int] = {}
        for i in incidents:
            for reason, n in i.suppressed_counts.items():
                traced[reason] = traced.get(reason, 0) + n
        refused = engine.guard_log.book.counts["refused"]
        counts["refusals_without_trace"] += max(0, refused - sum(traced.get(r, 0) for r in CAP_REASONS))
        counts["duplicates_without_trace"] += max(0, engine.counts.get("suppressed_duplicate", 0)
                                                  - traced.get("duplicate", 0))
        by_id = {i.id: i for i in incidents}
        counts["guarded_actions_without_trace"] += sum(
            1 for a in actions if "[guard:" in a.reason and not by_id[a.incident_id].suppressed)
    return counts


@attack("refused_marked_mitigated")
def attack_refused_marked_mitigated(scale: Scale) -> dict[str, int]:
    """An incident whose remedy the guard refused (and that got no other remedy) must not read `mitigated`."""
    remedies = {"evict_nodes", "restart_job", "rollback_code", "run_diagnostics"}
    n = 0
    for engine, actions, _ in _suppression_scenarios():
        engine.tick(engine.now + 1e6, final=True)
        taken: dict[str, set[str]] = {}
        for a in actions:
            taken.setdefault(a.incident_id, set()).add(a.type)
        for i in engine.incidents():
            refused = any(r in CAP_REASONS for r in i.suppressed_counts)
            if refused and not (taken.get(i.id, set()) & remedies) and i.status == "mitigated":
                n += 1
    return {"refused_incidents_marked_mitigated": n}


def _hang_records(nodes: list[str], job: str) -> list[Any]:
    """A job whose steps stop at 300 s while its GPUs stay busy: a hang, and no stacks to pin it."""
    from faultlens.schema import GpuSample, GpuState, StepTiming

    ranks = [(r, nodes[r // 8]) for r in range(8 * len(nodes))]
    recs: list[Any] = [StepTiming(ts=CAPS_T0 + s, job=job, rank=r, node=n, step=s, duration_s=1.0, loss=2.0)
                       for s in range(300) for r, n in ranks]
    recs += [GpuSample(ts=CAPS_T0 + t, node=n, gpus=[GpuState(index=i, sm_clock_mhz=1980) for i in range(8)])
             for t in range(0, 1500, 10) for n in nodes]
    return recs


@attack("empty_node_actions")
def attack_empty_node_actions(scale: Scale) -> dict[str, int]:
    """No evict_nodes or run_diagnostics may name no node: an unpinned hang (no stacks), and every
    action of the other cap attacks."""
    from faultlens.config import GuardConfig

    rec, nodes = _caps_job("hang", 4)
    engine = _caps_engine(GuardConfig(), [(rec, nodes)])
    actions, _ = _caps_run(engine, _hang_records(nodes, "hang"))
    for _, more, _ in _suppression_scenarios():
        actions += more
    empty = [a for a in actions if a.type in ("evict_nodes", "run_diagnostics") and not a.nodes]
    return {"node_targeted_actions_with_no_node": len(empty),
            "hang_without_action": int(not any(a.job == "hang" for a in actions))}


# ---------------------------------------------------------------------------
# Poison messages and checkpoints without pickle (issue 24 items 4, 5)
# ---------------------------------------------------------------------------
# Each attack starts its own embedded broker and runs the real commands (`faultlens diagnose`,
# `faultlens stream`, `faultlens runner`, `faultlens report`) as processes against it.

_TRACEBACK = "Traceback (most recent call last)"


class _Services:
    """An embedded broker, a scratch directory, and `faultlens` processes configured for both."""

    def __init__(self, name: str):
        import tempfile

        from faultlens.stream.bus.embedded_broker import EmbeddedBroker

        self.tmp = Path(tempfile.mkdtemp(prefix=f"redteam-{name}-"))
        self.broker = EmbeddedBroker().start()
        self.prefix = f"rt{name.replace('_', '')}{int(time.time())}"
        from faultlens.config import BusConfig

        self.bus = BusConfig(bootstrap_servers=self.broker.bootstrap, topic_prefix=self.prefix, linger_ms=5)
        self.logs: list[Path] = []
        self.extra_env: dict[str, str] = {}

    def env(self) -> dict[str, str]:
        import os

        env = {k: v for k, v in os.environ.items() if not k.startswith("FAULTLENS_")}
        env.update(FAULTLENS_BOOTSTRAP=self.broker.bootstrap, FAULTLENS_BUS_TOPIC_PREFIX=self.prefix,
                   FAULTLENS_DIAGNOSIS_GROUP_ID=f"{self.prefix}-diag",
                   FAULTLENS_DIAGNOSIS_CATALOG_PATH=str(self.tmp / "health.duckdb"),
                   FAULTLENS_RUNNER_GROUP_ID=f"{self.prefix}-runner",
                   FAULTLENS_RUNNER_STATE_PATH=str(self.tmp / "ledger.jsonl"),
                   FAULTLENS_LAKE_GROUP_ID=f"{self.prefix}-stream", PYTHONPATH=str(REPO))
        env.update(self.extra_env)
        return env

    def start(self, *args: str, log_name: str) -> Any:
        import subprocess

        log = self.tmp / f"{log_name}-{len(self.logs)}.log"
        self.logs.append(log)
        out = log.open("w")
        return lifeline.spawn([sys.executable, "-m", "faultlens.cli", *args], signum=signal.SIGTERM, env=self.env(),
                              cwd=self.tmp, stdout=out, stderr=subprocess.STDOUT)

    def run(self, *args: str, log_name: str, timeout_s: float = 120) -> int:
        proc = self.start(*args, log_name=log_name)
        try:
            return proc.wait(timeout_s)
        except Exception:  # noqa: BLE001 - a hang is a failure too
            proc.kill()
            proc.wait()
            return -9

    def tracebacks(self) -> int:
        """Tracebacks through faultlens's code in the processes' logs. One wholly inside kafka-python
        (its IO thread racing a socket close at shutdown, logged by the client itself) is not ours."""
        n = 0
        for p in self.logs:
            for block in p.read_text(errors="replace").split(_TRACEBACK)[1:]:
                frames = [ln for ln in block.splitlines()[1:40] if ln.startswith('  File "')]
                n += not frames or any("/site-packages/kafka/" not in f for f in frames)
        return n

    def producer(self) -> Any:
        from faultlens.stream.bus import Producer, ensure_topics

        ensure_topics(self.bus)
        return Producer(self.bus)

    def consumer(self, *kinds: str) -> Any:
        from faultlens.stream.bus import Consumer

        return Consumer(self.bus, list(kinds), group_id=None)

    def close(self) -> None:
        import os
        import shutil

        self.broker.stop()
        if os.environ.get("REDTEAM_KEEP"):  # the processes' logs, to read what an attack did
            print(f"kept {self.tmp}", file=sys.stderr)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)


def _diagnose(svc: _Services, name: str, timeout_s: float = 90) -> tuple[Any, bool]:
    """`faultlens diagnose` (online) started; (process, True) once it owns its partitions."""
    proc = svc.start("diagnose", "--detectors", "none", "--max-seconds", "300", log_name=name)
    log = svc.logs[-1]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if "took partition" in log.read_text(errors="replace"):
            return proc, True
        time.sleep(0.2)
    return proc, False


def _stop_rc(proc: Any) -> int:
    """SIGTERM (the service finishes its round and exits 0), then the exit status."""
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except Exception:  # noqa: BLE001 - a service that does not stop is a failure
        proc.kill()
        return proc.wait()


def _xid_round(svc: _Services, job: str, node: str, extra: Any = None, timeout_s: float = 45) -> list[Any]:
    """A job's topology, then (after ``extra`` records) a real Xid 79 on ``node``: the actions for ``job``."""
    from faultlens import schema
    from faultlens.stream.topology import Topology

    topo = Topology.packed(tp=8, pp=1, dp=4, gpus_per_node=8, job=job, node_fmt=f"{job}-n{{:03d}}")
    actions = svc.consumer("actions")
    try:
        with svc.producer() as p:
            p.send(schema.JobTopology(ts=time.time(), job=job, **{k: v for k, v in topo.to_job_dict().items()
                                                                   if k != "job"}))
            p.flush(10)
            time.sleep(1.5)  # the jobs reader learns node -> job
            for send in (extra or ()):
                send(p)
            p.send(schema.KernelEvent(ts=time.time(), node=node, kind="xid", xid=79,
                                      raw="NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."))
            p.flush(10)
        got: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while not got and time.monotonic() < deadline:
            got = [a for a in (schema.decode("actions", m.value) for m in actions.poll(300) if m.value) if a.job == job]
        return got
    finally:
        actions.close()


class _Touch:
    """Unpickling this opens (creates) a file: code run by whoever can write the changelog."""

    def __init__(self, target: Path):
        self.target = str(target)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.target, "w"))


def _pickle_bomb(target: Path) -> bytes:
    """A checkpoint value whose unpickling would create ``target`` (the attack's payload, never loaded here)."""
    import pickle
    import zlib

    return zlib.compress(pickle.dumps({"format": 1, "key": "x", "engine": _Touch(target)}), 1)


def _poison_changelog(svc: _Services, job: str, target: Path) -> None:
    from faultlens.stream.topics import REPARTITION_PARTITIONS

    with svc.producer() as p:
        for part in range(REPARTITION_PARTITIONS):
            for key, value in (("~mark", None), ("~mark", b"\x00garbage"), ("~mark", b'{"next_offset": "x"}'),
                               (job, b"garbage"), (job, _pickle_bomb(target)), ("other-job", None)):
                p.send_raw("diag-changelog", key, value, partition=part)
        p.flush(10)


@attack("poison_changelog")
def poison_changelog(scale: Scale) -> dict[str, int]:
    """Null, garbage and pickled markers and checkpoints on diag-changelog before every (re)start of
    `faultlens diagnose`; each round a real Xid 79 must still be acted on."""
    svc = _Services("changelog")
    counts = {"crash_loops": 0, "missed_actions": 0, "tracebacks": 0, "pickle_effects": 0}
    try:
        for r in range(scale.n(3, minimum=1)):
            job, target = f"rtjob{r}", svc.tmp / f"pwned-{r}"
            _poison_changelog(svc, job, target)
            proc, ready = _diagnose(svc, f"diagnose-{r}")
            if not ready:
                counts["crash_loops"] += 1
                counts["missed_actions"] += 1
                _stop_rc(proc)
                continue
            got = _xid_round(svc, job, f"{job}-n001")
            counts["missed_actions"] += 0 if [a for a in got if a.type == "evict_nodes"] else 1
            counts["crash_loops"] += _stop_rc(proc) != 0
            counts["pickle_effects"] += target.exists()
        counts["tracebacks"] = svc.tracebacks()
    finally:
        svc.close()
    return counts


def _gpu_json(ts: float, node: str) -> bytes:
    return b'{"v":1,"ts":%r,"node":"%s","job":"rt","gpus":[{"index":0,"util":97.0,"temp_c":71.0}]}' % (ts, node.encode())


@attack("poison_timestamps")
def poison_timestamps(scale: Scale) -> dict[str, int]:
    """GPU samples stamped in ms and us, at 2100 and at 1970 (JSON and the agent's MessagePack) into
    the stream processor (twice: a restart) and into diagnosis, then a real Xid 79."""
    from faultlens import decode, schema
    from faultlens.config import Config
    from faultlens.stream.catalog import open_lake

    svc = _Services("timestamps")
    counts = {"crash_loops": 0, "lake_stops": 0, "good_rows_lost": 0, "bad_rows_stored": 0, "missed_actions": 0,
              "actions_in_future": 0, "incidents_closed_at_once": 0, "tracebacks": 0}
    now = time.time()
    bad_ts = [now * 1e3, now * 1e6, 4102444800.0, 12.5]
    good = scale.n(200, minimum=10)
    try:
        with svc.producer() as p:
            for i in range(good):
                p.send_raw("gpu", f"good{i % 7}", _gpu_json(now - good + i, f"good{i % 7}"))
                if i % max(1, good // len(bad_ts)) == 0 and bad_ts:
                    ts = bad_ts.pop()
                    p.send_raw("gpu", "bad", _gpu_json(ts, "bad"))
                    p.send_raw("gpu", "bad", decode.encode_wire(schema.GpuSample(
                        ts=ts, node="bad", gpus=[schema.GpuState(index=0, util=1.0)])))
            p.flush(10)
        lake, catalog = svc.tmp / "lake", svc.tmp / "catalog.duckdb"
        for r in range(2):  # the processor, and its restart
            rc = svc.run("stream", "--lake", str(lake), "--catalog", str(catalog), "--exit-when-idle-s", "2",
                         "--flush-interval-s", "0.5", log_name=f"stream-{r}")
            counts["crash_loops"] += rc != 0
        if lake.is_dir():
            db = open_lake(lake)
            stored = db.execute("SELECT count(*) FROM gpu WHERE node LIKE 'good%'").fetchone()[0]
            bounds = decode.time_bounds()
            counts["bad_rows_stored"] = db.execute("SELECT count(*) FROM gpu WHERE ts < ? OR ts > ?",
                                                   [bounds.earliest_ts, bounds.latest()]).fetchone()[0]
            db.close()
        else:
            stored = 0
        counts["good_rows_lost"] = good - stored
        counts["lake_stops"] = int(stored == 0)

        proc, ready = _diagnose(svc, "diagnose")
        if not ready:
            counts["crash_loops"] += 1
            counts["missed_actions"] += 1
        else:
            job = "rtclock"
            skew = Config().time.max_clock_skew_s

            def future(p: Any) -> None:  # one in the decoder's window (6 h ahead), one past it (2100)
                for ts in (time.time() + 6 * 3600, 4102444800.0, time.time() * 1e3):
                    p.send(schema.GpuSample(ts=ts, node=f"{job}-n002", job=job,
                                            gpus=[schema.GpuState(index=0, util=90.0)]))

            got = _xid_round(svc, job, f"{job}-n001", extra=[future])
            evictions = [a for a in got if a.type == "evict_nodes"]
            counts["missed_actions"] += 0 if evictions else 1
            counts["actions_in_future"] += sum(a.ts > time.time() + skew for a in got)
            time.sleep(2.0)  # a clock in 2100 would close the incident at the next tick
            incidents = svc.consumer("incidents")
            latest: dict[str, str] = {}
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                for m in incidents.poll(300):
                    if not m.value:
                        continue
                    inc = schema.decode("incidents", m.value)
                    if inc.job == job:
                        latest[inc.id] = inc.status
            incidents.close()
            counts["incidents_closed_at_once"] = sum(s == "resolved" for s in latest.values())
            counts["crash_loops"] += _stop_rc(proc) != 0
        counts["tracebacks"] = svc.tracebacks()
    finally:
        svc.close()
    return counts


@attack("forged_member_heartbeats")
def forged_member_heartbeats(scale: Scale) -> dict[str, int]:
    """Someone who can write diag-members but holds no diagnosis key claims every partition with a huge
    epoch (unsigned, and signed with a key of their own) while a real Xid 79 arrives: diagnosis must go on."""
    from faultlens.stream import topics
    from faultlens.stream.signing import Keyring, new_key, write_key

    svc = _Services("members")
    counts = {"diagnosis_stopped": 0, "crash_loops": 0, "tracebacks": 0}
    try:
        svc.extra_env["FAULTLENS_KEYS_FILES"] = str(write_key(new_key("rt-diag"), svc.tmp / "diag-key.toml"))
        proc, ready = _diagnose(svc, "diagnose")
        if not ready:
            counts["crash_loops"] += 1
            counts["diagnosis_stopped"] += 1
            return counts
        theirs = Keyring([new_key("mallory")])
        owns = {f"{topics.topic(k, svc.prefix)}:{p}": 10**15 for k, n in topics.DEFAULT_PARTITIONS.items()
                for p in range(n)}
        owns.update({f"{topics.topic('diag-repartition', svc.prefix)}:{p}": 10**15
                     for p in range(topics.REPARTITION_PARTITIONS)})

        stop = threading.Event()

        def forge() -> None:  # all along the Xid round: a forged holder wins only while it keeps beating
            with svc.producer() as p:
                i = 0
                while not stop.is_set():
                    beat = {"v": 1, "group": f"{svc.prefix}-diag", "member": f"mallory{i % 2}", "ts": time.time(),
                            "left": False, "owns": owns}
                    for value in (beat, theirs.sign(beat)):
                        p.send_raw("diag-members", f"mallory{i % 2}", json.dumps(value).encode(), partition=0)
                    p.flush(5)
                    i += 1
                    stop.wait(0.1)

        forger = threading.Thread(target=forge, daemon=True)
        forger.start()
        time.sleep(2.5)  # past the member timeout: a forged holder would own everything by now
        try:
            got = _xid_round(svc, "rtmembers", "rtmembers-n001", timeout_s=20)
        finally:
            stop.set()
            forger.join(10)
        counts["diagnosis_stopped"] = 0 if any(a.type == "evict_nodes" for a in got) else 1
        counts["crash_loops"] += _stop_rc(proc) != 0
        counts["tracebacks"] = svc.tracebacks()
    finally:
        svc.close()
    return counts


@attack("forged_changelog_marker")
def forged_changelog_marker(scale: Scale) -> dict[str, int]:
    """Someone who can write diag-changelog but holds no diagnosis key writes, on every partition, a
    marker with a huge offset (unsigned, and sealed with a key of their own) before `faultlens diagnose`
    starts: obeyed, the new owner would skip every record below it. A real Xid 79 must still be acted
    on, and each forged marker dead-lettered as unverified."""
    from faultlens.diagnosis.online.state import MARK_KEY, changelog_context, mark_value
    from faultlens.stream.signing import Keyring, new_key, seal, write_key
    from faultlens.stream.topics import REPARTITION_PARTITIONS

    svc = _Services("marker")
    counts = {"records_skipped": 0, "crash_loops": 0, "tracebacks": 0, "forgeries_unaccounted": 0,
              "genuine_refused": 0}
    try:
        svc.extra_env["FAULTLENS_KEYS_FILES"] = str(write_key(new_key("rt-diag"), svc.tmp / "diag-key.toml"))
        theirs = Keyring([new_key("mallory")])
        rounds = scale.n(2, minimum=1)
        per_partition = 2 * rounds  # forgeries written to each partition, from its offset 0
        with svc.producer() as p:
            for _ in range(rounds):
                for part in range(REPARTITION_PARTITIONS):
                    mark = mark_value(10**12, time.time())
                    for value in (mark, seal(theirs, mark, changelog_context(part, MARK_KEY))):
                        p.send_raw("diag-changelog", MARK_KEY, value, partition=part)
            p.flush(10)
        proc, ready = _diagnose(svc, "diagnose")
        if ready:
            got = _xid_round(svc, "rtmark", "rtmark-n002")
            counts["records_skipped"] += 0 if any(a.type == "evict_nodes" for a in got) else 1
        else:
            counts["records_skipped"] += 1
        counts["crash_loops"] += (not ready) + (_stop_rc(proc) != 0)
        # Only the newest records of a key are examined (the first that verifies wins): each partition
        # must say so for its newest forgery at least.
        said = svc.logs[-1].read_text(errors="replace").count("is unverified")
        counts["forgeries_unaccounted"] = max(0, REPARTITION_PARTITIONS - said)
        # A restart reads what the first run sealed: its markers and the job's checkpoint verify (newer
        # than the forgeries, so those are not even examined) and the job's incident is still open.
        proc, ready = _diagnose(svc, "diagnose-again")
        time.sleep(2.0)  # every partition taken (the first "took partition" says ready)
        counts["crash_loops"] += (not ready) + (_stop_rc(proc) != 0)
        second = svc.logs[-1].read_text(errors="replace") if ready else ""
        # (partitions the first run did not write keep only forgeries, at offsets below per_partition)
        refused = [int(o) for o in re.findall(r"diag-changelog\[\d+\]@(\d+) is unverified", second)]
        restored_jobs = re.findall(r"took partition \d+: ([1-9]\d*) job\(s\) to restore", second)
        counts["genuine_refused"] = sum(o >= per_partition for o in refused) + (not restored_jobs)
        counts["tracebacks"] = svc.tracebacks()
    finally:
        svc.close()
    return counts


@attack("poison_tombstones")
def poison_tombstones(scale: Scale) -> dict[str, int]:
    """A null value and an empty one on every topic each service consumes (processor, diagnosis with
    its internal topics, runner); each service runs over them, and diagnosis still acts on an Xid 79."""
    import re

    from faultlens.stream import topics
    from faultlens.stream.processor import CONSUMED_KINDS

    svc = _Services("tombstones")
    counts = {"crash_loops": 0, "tracebacks": 0, "missed_actions": 0, "tombstones_unaccounted": 0}
    kinds = sorted({*CONSUMED_KINDS, "jobs", *topics.INTERNAL, "actions"})
    try:
        with svc.producer() as p:
            for _ in range(scale.n(5, minimum=1)):
                for kind in kinds:
                    p.send_raw(kind, "rt-key", None)
                    p.send_raw(kind, "rt-key", b"")
            p.flush(10)
        proc, ready = _diagnose(svc, "diagnose")
        if ready:
            got = _xid_round(svc, "rttomb", "rttomb-n003")
            counts["missed_actions"] += 0 if [a for a in got if a.type == "evict_nodes"] else 1
        else:
            counts["missed_actions"] += 1
        counts["crash_loops"] += (not ready) + (_stop_rc(proc) != 0)
        counts["crash_loops"] += svc.run("runner", "--duration-s", "8", log_name="runner") != 0
        counts["crash_loops"] += svc.run("stream", "--lake", str(svc.tmp / "lake"), "--catalog",
                                         str(svc.tmp / "catalog.duckdb"), "--exit-when-idle-s", "2",
                                         log_name="stream") != 0
        counts["tracebacks"] = svc.tracebacks()
        # every service says it dead-lettered them (counted, with the reason), none skips them silently
        said = re.compile(r"dead.letter.*\btombstone\b")
        counts["tombstones_unaccounted"] = sum(not said.search(p.read_text(errors="replace")) for p in svc.logs)
    finally:
        svc.close()
    return counts


@attack("pickle_checkpoint")
def pickle_checkpoint(scale: Scale) -> dict[str, int]:
    """A pickle whose ``__reduce__`` creates a file, as every checkpoint and marker of diag-changelog,
    read by `faultlens diagnose` on start; and every pickle load left in the package's code."""
    import re

    svc = _Services("pickle")
    target = svc.tmp / "pwned"
    counts = {"pickle_effects": 0, "crash_loops": 0, "pickle_loads_in_code": 0}
    try:
        from faultlens.stream.topics import REPARTITION_PARTITIONS

        with svc.producer() as p:
            for part in range(REPARTITION_PARTITIONS):
                for key in ("~mark", "job-a", "~nodes/0", f"job-{part}"):
                    p.send_raw("diag-changelog", key, _pickle_bomb(target), partition=part)
            p.flush(10)
        for r in range(scale.n(2, minimum=1)):
            proc, ready = _diagnose(svc, f"diagnose-{r}")
            counts["crash_loops"] += (not ready) + (_stop_rc(proc) != 0)
        counts["pickle_effects"] = int(target.exists())
    finally:
        svc.close()
    loads = re.compile(r"\b(pickle|joblib|cloudpickle|dill)\.loads?\(")
    for part in ("faultlens", "collectors", "stream", "diagnosis", "models", "ui", "datasets"):
        for path in (REPO / part).rglob("*.py"):
            counts["pickle_loads_in_code"] += len(loads.findall(path.read_text(errors="replace")))
    return counts


@attack("quoted_lake_path")
def quoted_lake_path(scale: Scale) -> dict[str, int]:
    """A lake (and catalog) whose path holds ``'``, ``"`` and spaces: the processor writes it, the
    catalog's views, the explorer's connection and `faultlens report` read it."""
    from faultlens import schema
    from faultlens.stream.catalog import open_lake

    svc = _Services("quoted")
    counts = {"stream_failures": 0, "rows_missing": 0, "view_failures": 0, "report_failures": 0}
    n = scale.n(500, minimum=20)
    t0 = time.time() - n
    try:
        base = svc.tmp / "it's a \"quoted\" dir"
        lake, catalog = base / "o'lake", base / "cat 'x'.duckdb"
        with svc.producer() as p:
            for i in range(n):
                p.send(schema.GpuSample(ts=t0 + i, node=f"n{i % 4}", job="j'1",
                                        gpus=[schema.GpuState(index=0, util=50.0)]))
            p.send(schema.KernelEvent(ts=t0 + n, node="n0", kind="xid", xid=79, raw="NVRM: Xid 79 it's 'quoted'"))
            p.flush(10)
        rc = svc.run("stream", "--lake", str(lake), "--catalog", str(catalog), "--exit-when-idle-s", "2",
                     log_name="stream")
        counts["stream_failures"] += rc != 0
        try:
            db = open_lake(lake)
            counts["rows_missing"] = n - db.execute("SELECT count(*) FROM gpu").fetchone()[0]
            db.close()
        except Exception:  # noqa: BLE001 - a view that breaks on the path is the finding
            counts["view_failures"] += 1
        try:
            from faultlens.ui.lake import connect

            con = connect(lake)
            con.execute("SELECT count(*) FROM gpu_1m_parts").fetchone()
            con.close()
        except ImportError:
            pass  # the [ui] extra is not installed: nothing to attack
        except Exception:  # noqa: BLE001
            counts["view_failures"] += 1
        rc = svc.run("report", "--lake", str(lake), "--job", "j'1", "--since", str(int(t0 - 60)), "--until",
                     str(int(time.time() + 60)), "--out", str(base / "report 'x'.md"), log_name="report")
        counts["report_failures"] += rc != 0
    finally:
        svc.close()
    return counts


# ---------------------------------------------------------------------------
# Safe text: reports and explorer (issue 24 item 8)
# ---------------------------------------------------------------------------


@attack("safe_text")
def safe_text(scale: Scale) -> dict[str, int]:
    """Log text that is markup (``<script>``, ``<img onerror>``, Markdown images, backticks) in a
    kernel line, an incident and a node name, in a lake whose path holds a quote: ``faultlens
    report`` (Markdown and HTML) and the explorer in a real headless Chromium must show it as text.
    The same case at every scale (one lake, two reports, four pages)."""
    import tempfile

    from faultlens.cli import main as faultlens
    from tests.browser import explorer
    from tests.hostile_text import EVIL, hostile_lake, html_markup, markdown_markup

    with tempfile.TemporaryDirectory(prefix="redteam-text-") as tmp:
        root = Path(tmp)
        lake = hostile_lake(root)
        counts: dict[str, int] = {}
        md_out, html_out = root / "report.md", root / "report.html"
        failed = sum(faultlens(["report", "--lake", str(lake.path), "--job", lake.job, "--out", str(out)]) != 0
                     for out in (md_out, html_out))
        counts["quoted_lake_path_failures"] = failed
        md = markdown_markup(md_out.read_text() if md_out.exists() else "", spans=lake.texts)
        counts["raw_html_in_report_md"] = md["raw_html"]
        counts["images_in_report_md"] = md["images"]
        counts["broken_evidence_spans_in_report_md"] = md["broken_spans"]
        counts["markup_in_report_html"] = sum(html_markup(html_out.read_text() if html_out.exists() else "").values())
        with explorer(lake.path, root) as ui:
            q = urllib.parse.quote
            ui.visit(f"/incident?id={q(lake.incident_id)}", lambda t: "Culprit: n666" in t and "Evidence" in t)
            ui.visit(f"/machine?node={q(lake.node)}", lambda t: "Kernel events" in t)
            ui.visit("/", lambda t: "Open incidents" in t)
            ui.visit(f"/labels?id={q(lake.incident_id)}", lambda t: "Diagnosis:" in t)
            counts["explorer_remote_images"] = len(ui.remote_images())
            counts["explorer_remote_fetches"] = len(ui.remote_requests())
            # the explorer's own URLs carry the node name in their query string: only other hosts count
            counts["explorer_fetches_of_images_in_log_text"] = sum(EVIL in u for u in ui.remote_requests())
        return counts



# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller volumes")
    ap.add_argument("--smoke", action="store_true", help="one small case per attack (seconds)")
    ap.add_argument("--only", default="", help="comma-separated attack names")
    args = ap.parse_args(argv)
    scale = Scale("smoke", 0.01) if args.smoke else Scale("quick", 0.1) if args.quick else Scale("full", 1.0)
    names = [n for n in args.only.split(",") if n] or list(ATTACKS)
    unknown = [n for n in names if n not in ATTACKS]
    if unknown:
        ap.error(f"unknown attack(s): {', '.join(unknown)}; known: {', '.join(ATTACKS)}")
    figures: dict[str, Any] = {"bench": "redteam", "scale": scale.name}
    total = 0
    print(f"{'attack':<28} {'count':<40} {'value':>8}")
    for name in names:
        started = time.monotonic()
        try:
            counts = ATTACKS[name](scale)
        except Exception:  # an attack that breaks is itself a finding: count it, go on
            traceback.print_exc()
            counts = {"attack_failed": 1}
        for key, value in counts.items():
            print(f"{name:<28} {key:<40} {value:>8}")
            figures[f"{name}.{key}"] = value
            total += int(value)
        print(f"{name:<28} {'(seconds)':<40} {time.monotonic() - started:>8.1f}")
    figures["total"] = total
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
