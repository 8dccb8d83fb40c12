"""``faultlens demo``: the whole pipeline on a simulated cluster, printing incidents and actions.

Starts (each the real ``faultlens`` command in its own process): the embedded
Kafka-protocol broker when no bootstrap servers are configured, the stream
processor, online diagnosis, the dry-run runner, the explorer, and a simulated
16-node x 8-GPU fleet whose virtual nodes each run the real agent code: five
jobs on disjoint machines (three each, one spare), each given one fault of the
demo's sequence in turn (Xid 79, a thermal fail-slow, a hang with a stuck rank,
a user-code exception, a transient link flap). It prints each incident and
action as it appears, and nothing else unless ``--log-level`` asks for more (the
services' own logs are in WORKDIR/logs). Ctrl-C stops everything, newest first,
so the lake is flushed and readable.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

from faultlens.argtypes import positive_float, positive_int
from faultlens.cli import command_name
from faultlens.config import Config, DiagnosisConfig
from faultlens.datasets.live import DEMO_FAULTS, demo_fleet
from faultlens.stream.bus import Consumer, ensure_topics
from faultlens.stream.bus.embedded_broker import EmbeddedBroker
from faultlens.stream.signing import Ed25519Key, new_key, public_path, write_key
from faultlens.supervise import Supervisor

HELP = __doc__.split("\n\n")[0].split(": ", 1)[1] if __doc__ else "run the demo"
EXAMPLE = "faultlens demo --nodes 16 --speed 20 --workdir demo-run"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=positive_int, default=16, help="virtual nodes (8 GPUs each)")
    p.add_argument("--speed", type=positive_float, default=20.0, help="simulated seconds per real second")
    p.add_argument("--segment", type=positive_float, default=300.0, help="simulated seconds per injected fault")
    p.add_argument("--workdir", default="demo-run", help="lake, catalogs, logs and virtual nodes' files")
    p.add_argument("--no-ui", action="store_true", help="do not start the Streamlit explorer")
    p.add_argument("--port", type=int, default=None, help="explorer port (default: [ui] port, or a free one)")
    p.add_argument("--keep", action="store_true", help="keep an existing workdir (default: start afresh)")
    p.add_argument("--exit-after-s", type=positive_float, default=None,
                   help="stop by itself after this many seconds (default: run until Ctrl-C)")
    # The terminal is for incidents and actions; library chatter (kafka-python's INFO
    # lines) only when asked for with --log-level INFO or DEBUG.
    p.set_defaults(log_level="WARNING")


def _free_port(preferred: int) -> int:
    import socket

    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return s.getsockname()[1]
            except OSError:
                continue
    return preferred


SIMULATED_LEAD_S = 86_400.0  # how far ahead of the wall clock a simulated timeline may run


def demo_key(workdir: Path) -> Path:
    """The run's private signing key (made once per work directory, with its public FILE.pub):
    diagnosis signs with it; the runner and agents get only the .pub (``service_env``)."""

    path = workdir / "signing-key.toml"
    if not path.exists() or not public_path(path).exists():
        key = new_key("demo")
        assert isinstance(key, Ed25519Key)
        write_key(key, path, force=True)
        write_key(key.public_half(), public_path(path), force=True)
    return path


def service_env(workdir: Path, bootstrap: str) -> dict[str, str]:
    """The environment that points every service at one bus, one work directory and one signing key."""
    return {
        "FAULTLENS_KEYS_FILES": f"{demo_key(workdir)}.pub",  # verify only; diagnosis: start_pipeline
        # The simulated cluster plays its timeline at --speed x real time, so its event time (and
        # the actions' and commands' times) runs ahead of the wall clock by design; a real cluster
        # keeps the default bound of 60 s.
        "FAULTLENS_KEYS_MAX_SKEW_S": str(SIMULATED_LEAD_S),
        "FAULTLENS_BOOTSTRAP": bootstrap,
        "FAULTLENS_LAKE_PATH": str(workdir / "lake"),
        "FAULTLENS_LAKE_CATALOG_PATH": str(workdir / "stream-catalog.duckdb"),
        "FAULTLENS_LAKE_FLUSH_INTERVAL_S": "2",
        "FAULTLENS_DIAGNOSIS_CATALOG_PATH": str(workdir / "diagnosis.duckdb"),
        "FAULTLENS_RUNNER_STATE_PATH": str(workdir / "runner-ledger.jsonl"),
        # The simulated cluster plays its scenario at --speed x real time from now, so its clock
        # (and diagnosis's, and the actions it stamps) runs ahead of the wall clock by design:
        # [time] allows a day of lead here, where a real fleet allows minutes.
        "FAULTLENS_TIME_MAX_CLOCK_SKEW_S": "86400",
        "FAULTLENS_TIME_MAX_FUTURE_S": "172800",
        # ...so a quiet partition's clock must not move on by wall seconds: the simulated NVML samples
        # keep every job's time moving, and a job whose segment ended was restarted as hung.
        "FAULTLENS_DIAGNOSIS_IDLE_CLOCK_AFTER_S": "0",
    }


def start_pipeline(sup: Any, *, nodes: int, speed: float, segment: float, workdir: Path,
                   faults: list[str] | None = None) -> None:
    """Processor, diagnosis, runner and the live simulated cluster (the order they must start in)."""
    sup.start("stream", "stream")
    # the one that signs; a hang's dwell in wall time, at the simulated clock's pace
    sup.start("diagnose", "diagnose", "--set", f"keys.files={demo_key(workdir)}",
              "--set", f"diagnosis.hang_dwell_s={DiagnosisConfig.hang_dwell_s / speed:.3f}")
    sup.start("runner", "runner")
    sim = ["simulate", "live", "--nodes", str(nodes), "--speed", str(speed), "--segment", str(segment),
           "--workdir", str(workdir / "cluster")]
    for f in faults or []:
        sim += ["--fault", f]
    sup.start("cluster", *sim)


def _incident_line(data: dict[str, Any]) -> str:
    sus = ", ".join(f"{s.get('node')}" + (f" gpu {s['gpu']}" if s.get("gpu") is not None else "")
                    for s in data.get("suspects", [])[:4])
    status = f"[{data.get('status')}]"
    return (f"[bold red]INCIDENT[/] {esc(data.get('id'))} {esc(status)} {esc(data.get('severity'))} "
            f"{esc(data.get('category'))}/{esc(data.get('kind'))}: {esc(data.get('title'))}"
            + (f"  suspects: {esc(sus)}" if sus else ""))


def _action_line(data: dict[str, Any]) -> str:
    nodes = ",".join(data.get("nodes", []))
    dry = " (dry-run)" if data.get("dry_run") else ""
    return (f"[bold yellow]ACTION[/] {esc(data.get('type'))}{dry} for {esc(data.get('incident_id'))} job "
            f"{esc(data.get('job'))}" + (f" nodes {esc(nodes)}" if nodes else "")
            + f" conf {float(data.get('confidence') or 0):.2f}: {esc(data.get('reason', ''))}")


def esc(value: Any) -> str:
    """A value from the bus as plain text in rich markup (a title with ``[bold]`` stays text)."""
    from rich.markup import escape

    return escape(str(value))


class DemoPrinter:
    """What the demo terminal prints: each incident once when it opens, then one line per change
    (status, suspects, actions), and each action after the incident it answers.

    Incidents and actions come from two topics, so an action can arrive first: it waits until its
    incident has been printed, or ``hold_s`` at most (an action whose incident never comes is shown).
    """

    def __init__(self, hold_s: float = 10.0):
        self.hold_s = hold_s
        self.seen: dict[str, dict[str, Any]] = {}  # incident id -> what was last printed of it (status, lists)
        self.held: list[tuple[float, dict[str, Any]]] = []

    def incident(self, data: dict[str, Any], now: float) -> list[str]:
        inc_id = str(data.get("id"))
        state: dict[str, Any] = {"status": data.get("status"), "actions": list(data.get("actions") or []),
                                 "suspects": [s.get("node") for s in data.get("suspects") or []]}
        before: dict[str, Any] | None = self.seen.get(inc_id)
        if before == state:
            return []
        self.seen[inc_id] = state
        if before is None:
            lines = [_incident_line(data)]
        else:
            changes = []
            if state["status"] != before["status"]:
                changes.append(f"status {esc(before['status'])} -> {esc(state['status'])}")
            if state["suspects"] != before["suspects"]:
                changes.append(f"suspects {esc(', '.join(map(str, state['suspects'][:4])) or 'none')}")
            added = [a for a in state["actions"] if a not in before["actions"]]
            if added:
                changes.append(f"action {esc(', '.join(added))}")
            lines = [f"[bold]UPDATE[/] {esc(inc_id)}: " + "; ".join(changes)] if changes else []
        return lines + self.due(now, answered=inc_id)

    def action(self, data: dict[str, Any], now: float) -> list[str]:
        if str(data.get("incident_id")) in self.seen:
            return [_action_line(data)]
        self.held.append((now, data))
        return []

    def due(self, now: float, answered: str | None = None) -> list[str]:
        """Held actions now printable: their incident was printed, or they waited ``hold_s``."""
        out, keep = [], []
        for since, data in self.held:
            if str(data.get("incident_id")) == answered or str(data.get("incident_id")) in self.seen \
                    or now - since >= self.hold_s:
                out.append(_action_line(data))
            else:
                keep.append((since, data))
        self.held = keep
        return out


def run(args: argparse.Namespace, config: Config) -> int:
    import logging

    import orjson
    from rich.console import Console


    console = Console()
    per_job, spare = demo_fleet(args.nodes, len(DEMO_FAULTS))  # a fleet too small fails before anything starts
    if args.log_level == "WARNING":  # the default: kafka-python's event-loop timing warnings are not the user's
        logging.getLogger("kafka").setLevel(logging.ERROR)
    workdir = Path(args.workdir).resolve()
    if workdir.exists() and not args.keep:
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    broker = None
    bootstrap = config.bus.bootstrap_servers
    if not bootstrap:
        broker = EmbeddedBroker().start()
        bootstrap = broker.bootstrap
        console.print(f"embedded Kafka-protocol broker (Tansu, memory only) at [bold]{bootstrap}[/]")
    ensure_topics(config.bus, bootstrap)
    sup = Supervisor(workdir, service_env(workdir, bootstrap))
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    consumer = None
    try:
        (workdir / "lake").mkdir(exist_ok=True)  # the explorer starts before the first commit
        if not args.no_ui:
            port = args.port or _free_port(config.ui.port)
            sup.start("ui", "ui", "--lake", str(workdir / "lake"), "--port", str(port))
            console.print(f"explorer: [bold]http://127.0.0.1:{port}[/]  (logs in {esc(workdir / 'logs')})")
        start_pipeline(sup, nodes=args.nodes, speed=args.speed, segment=args.segment, workdir=workdir)
        console.print(f"simulating {args.nodes} nodes x 8 GPUs at {args.speed:g}x: {len(DEMO_FAULTS)} jobs of "
                      f"{per_job} nodes each, {spare} spare; one fault per job in turn: Xid 79, thermal "
                      "fail-slow, hang with a stuck rank, user-code exception, transient link flap. Ctrl-C stops.")
        consumer = Consumer(config.bus, ["incidents", "actions"], group_id=None, bootstrap=bootstrap)
        first = None
        sequence_done = False
        printer = DemoPrinter()
        deadline = None if args.exit_after_s is None else started + args.exit_after_s
        while not stop.is_set():
            lines: list[str] = []
            for m in consumer.poll(500):
                try:
                    env = orjson.loads(m.value)
                except orjson.JSONDecodeError:
                    continue
                data = env.get("data", env) if isinstance(env, dict) else {}
                if not isinstance(data, dict):
                    continue
                now = time.monotonic()
                lines += printer.incident(data, now) if m.kind == "incidents" else printer.action(data, now)
            lines += printer.due(time.monotonic())
            if lines and first is None:
                first = time.monotonic() - started
                console.print(f"[dim]first incident or action {first:.0f} s after start[/]")
            for line in lines:
                console.print(line)
            crashed = [c for c in sup.check() if c.name != "cluster"]
            if crashed:
                for c in crashed:
                    code = c.proc.returncode if c.proc is not None else None
                    console.print(f"[red]{c.name} exited ({code}); last lines:[/]\n{sup.tail(c.name)}")
                return 1
            cluster = next(c for c in sup.children if c.name == "cluster")
            if not cluster.alive() and not sequence_done:
                sequence_done = True
                console.print("fault sequence done; the explorer stays up. Ctrl-C stops everything.")
            if deadline is not None and time.monotonic() > deadline:
                break
    finally:
        if consumer is not None:
            consumer.close()
        console.print("stopping services ...")
        sup.stop()
        if broker is not None:
            broker.stop()
        console.print(f"lake kept at {esc(workdir / 'lake')}; explore it again with: "
                      f"{esc(command_name())} ui --lake {esc(workdir / 'lake')}")
    return 0
