"""The node agent: runs the configured sources and ships their records through the spool.

The agent knows no source by name: ``agent.sources`` names them, the registry
(collectors/sources.py) builds each from the module that registered it (nvml,
kernel, nccl, steps, stacks), and one loop thread polls them in that order each
tick, then pumps delivery and logs health. Sources that must block (NVML's event
wait, the ``commands`` consumer that answers ``dump_stacks``) run a thread of
their own. Sources reach the agent only through its services: ``emit_many``,
``set_state``/``success``/``parse_failure`` for health, and ``ship_log_lines`` /
``ship_parsed`` for parsed log lines (the ship filter below).

Per source, health says: state (``ok``, ``no_data``, ``error``, ``starting``),
last success, lines/s, records, parse failures. "No GPU here" is ``no_data``,
said once in the log; the agent is never reported healthy while a source it was
asked to run is blind. A bad line never stops the agent: it is counted and kept
(an ``unparsed`` kernel/nccl record with its raw text, or a dead letter for a
step line that does not decode).

Ordinary log lines (kernel kind ``other``, NCCL INFO narration: noise no pattern
recognises, without an error word or bad bytes) are counted per source
(``ordinary_lines`` in health, ``faultlens_agent_ordinary_lines_total``) instead of
shipped one record each, unless ``agent.ship_ordinary_lines``. The parsers' fast
path (``feed_many``) settles such lines with one Aho-Corasick scan per chunk, so a node's
everyday log volume costs almost nothing; recognised records are always shipped.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from faultlens import schema
from faultlens.collectors.delivery import Delivery
from faultlens.collectors.follow import RECORD_QUIET_S
from faultlens.collectors.signatures import is_ordinary
from faultlens.collectors.sources import Source, log_parsers, source_factory
from faultlens.collectors.spool import Entry, Spool
from faultlens.config import Config
from faultlens.decode import encode_wire, time_bounds
from faultlens.errors import BusError
from faultlens.metrics import MetricsServer, ServiceMetrics
from faultlens.schema import StackDump
from faultlens.stream import topics
from faultlens.stream.bus import Producer, ensure_topics

log = logging.getLogger(__name__)

StacksProvider = Callable[[str, str, str], list[StackDump]]  # (job, node, request_id) -> dumps
PERIODIC_KINDS = ("gpu", "steps")  # telemetry that comes every second anyway: never urgent (a lost GPU is)
METRICS_S = 1.0  # gauges that mirror counters are refreshed this often, not every tick
CHECKPOINT_S = 0.5  # follower positions are saved at most this often (a wake-up per write would write a file each)
REPLAYED_KINDS = ("kernel", "nccl", "steps")  # records of followed files: read again from a saved position
SEQ_STATE_KEY = "~seq"  # in positions.json: kind -> [epoch, seq] at the saved positions
TOPIC_IDS_KEY = "~topics"  # in positions.json: kind -> the broker's topic id last acknowledged
MAX_TICK_GAP_S = 0.5  # while writes keep coming, ticks are min(tick_s, this) apart (the first is at once)
STOP_CHECK_S = 0.5  # the wait looks at the stop event this often (run_for's timer sets it from another thread)
# Keyword arguments written before sources were plugins: (source, option) each sets.
_SHORTHANDS = {"nvml_backend": ("nvml", "backend"), "kernel_source": ("kernel", "path"),
               "nccl_glob": ("nccl", "glob"), "steps_glob": ("steps", "glob"), "stacks_provider": ("stacks", "provider")}


@functools.cache
def _recognised_kinds() -> frozenset[str]:
    """Kernel and NCCL record kinds the catalogs name (``[[kind]]``): fault lines, sent at once."""

    return frozenset(k.name for p in log_parsers() for k in p.kinds().kinds)


@dataclass
class SourceHealth:
    """What one source has done; ``state`` is ok | no_data | error | starting | off (nothing configured)."""

    name: str
    state: str = "starting"
    detail: str = ""
    last_success_ts: float | None = None
    lines: int = 0
    records: int = 0
    parse_failures: int = 0
    ordinary_lines: int = 0
    _window: list[tuple[float, int]] = field(default_factory=list)

    def lines_per_s(self, now: float) -> float:
        self._window = [(t, n) for t, n in self._window if now - t <= 60.0]
        if len(self._window) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._window[0], self._window[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def to_dict(self, now: float) -> dict[str, Any]:
        return {"state": self.state, "detail": self.detail, "last_success_ts": self.last_success_ts,
                "lines": self.lines, "records": self.records, "parse_failures": self.parse_failures,
                "ordinary_lines": self.ordinary_lines, "lines_per_s": round(self.lines_per_s(now), 2)}


class Agent:
    """The faultlens node agent. ``run(stop)`` until ``stop`` is set; ``run_for(seconds)``.

    The sources come from ``agent.sources`` (or ``sources``), each built by its
    registered factory (collectors/sources.py) with ``options[name]``: a fake NVML
    backend, a log path, a stacks provider. The older keyword arguments
    (``nvml_backend``, ``kernel_source``, ``nccl_glob``, ``steps_glob``,
    ``stacks_provider``) set the same options.
    """

    def __init__(
        self,
        config: Config,
        *,
        bootstrap: str | None = None,
        node: str | None = None,
        sources: tuple[str, ...] | None = None,
        options: dict[str, dict[str, Any]] | None = None,
        tick_s: float | None = None,
        from_end: bool = True,
        clock: Callable[[], float] = time.time,
        **shorthands: Any,
    ):
        ac = config.agent
        self.config = config
        self.bootstrap = bootstrap
        self.node = node or ac.node or socket.gethostname()
        self.job = ac.job or None
        self.sources = tuple(sources if sources is not None else ac.sources)
        self.tick_s = tick_s if tick_s is not None else ac.tick_s
        # Timestamps of records the agent makes itself (samples, lines without a
        # time of their own); the simulator passes its accelerated clock.
        self.clock = clock
        self.from_end = from_end
        self.options: dict[str, dict[str, Any]] = {k: dict(v) for k, v in (options or {}).items()}
        for key, value in shorthands.items():
            if key not in _SHORTHANDS:
                raise TypeError(f"Agent() got an unexpected keyword argument {key!r}")
            if value is not None:
                src, opt = _SHORTHANDS[key]
                self.options.setdefault(src, {})[opt] = value
        self.health = {name: SourceHealth(name) for name in self.sources}
        self.spool = Spool(ac.spool_dir, max_bytes=ac.spool_max_bytes)
        self.metrics: Any = None
        self._metrics_server: Any = None
        self._extra_metrics: dict[str, Any] = {}
        self.delivery = Delivery(self._producer, self.spool, on_sent=self._on_sent,
                                 min_send_interval_s=ac.min_send_interval_s, source=self.node,
                                 fault_send_interval_s=ac.fault_send_interval_s,
                                 retained=Spool(Path(ac.spool_dir) / "sent", max_bytes=ac.spool_max_bytes),
                                 retain_s=ac.resend_window_s, on_lost=self._on_broker_lost)
        self._sources: list[Source] = []
        self.gpu_map: dict[str, int] = {}  # PCI bus -> GPU index, from NVML; the kernel parser reads it
        self._stop = threading.Event()
        self._said: set[str] = set()
        self._positions_path = Path(ac.spool_dir) / "positions.json"
        self._saved_positions: dict[str, Any] | None = None
        self.ship_ordinary = ac.ship_ordinary_lines
        self._next_metrics = self._next_checkpoint = self._last_tick = 0.0
        self._loop_thread: int | None = None
        self.ticks = 0
        self._event_tick = False  # the last wake-up came from a source's descriptor
        self._wake_r = self._wake_w = -1  # the loop's self-pipe, opened by run()

    @property
    def stop_event(self) -> threading.Event:
        """Set when the agent stops; source threads watch it."""
        return self._stop

    # ------------------------------------------------------------------ plumbing
    def _producer(self) -> Any:

        try:
            ensure_topics(self.config.bus, self.bootstrap, names=topics.TELEMETRY + ("deadletter",))
        except BusError as exc:  # no rights to create topics is fine; the producer tells if the bus is down
            log.debug("ensure_topics: %s", exc)
        # kafka-python's own metrics (sensors updated on every request) are a third of its
        # CPU per produce request; the agent counts what it sends itself (health, Prometheus).
        return Producer(self.config.bus, self.bootstrap, max_block_ms=5000, request_timeout_ms=5000,
                        delivery_timeout_ms=15000, retries=2, bootstrap_timeout_ms=5000, reconnect_backoff_max_ms=2000,
                        metrics_enabled=False)

    def _on_broker_lost(self) -> None:
        """The broker lost records it had acknowledged (and so its topics): sources that publish
        state (the ``jobs`` source's topology) publish it again."""
        for src in self._sources:
            republish = getattr(src, "republish", None)
            if republish is not None:
                republish()

    def _on_sent(self, kind: str, n: int) -> None:
        if self.metrics is not None:
            self.metrics.messages_produced.labels(topic=topics.topic(kind, self.config.bus.topic_prefix)).inc(n)

    def emit(self, record: Any) -> None:
        """Queue one record for delivery (keyed as stream.topics says)."""
        self.emit_many([record])

    def emit_many(self, records: list[Any]) -> None:
        """Queue records for delivery in one go (one lock, one list).

        Everything but periodic telemetry is urgent: a log record, a stack dump or a
        sample with a lost GPU goes at the next tick unless another urgent send went
        within ``agent.min_send_interval_s`` (see ``Delivery``). A recognised fault line
        (a kernel or NCCL record of a catalog ``[[kind]]``: Xid, SXid, a watchdog
        timeout...) goes at once, whatever went before.
        """
        entries: list[Entry] = []
        urgent = immediate = False
        for record in records:
            kind = type(record).KIND
            if kind in ("kernel", "nccl"):
                if record.ts <= 0 or time_bounds().problem(record.ts) is not None:
                    # No time, or one no reader accepts (another boot's uptime, a year guessed wrong): the
                    # agent's clock, marked estimated, rather than a dead letter downstream.
                    record = schema.replace(record, ts=self.clock(), fields={
                        **record.fields, "ts_estimated": True, "ts_anchor": f"agent clock (line said {record.ts:.0f})"})
                immediate = immediate or record.kind in _recognised_kinds()
            entries.append((kind, getattr(record, topics.KEY_FIELD[kind], None), encode_wire(record)))
            urgent = urgent or kind not in PERIODIC_KINDS or (kind == "gpu" and any(g.lost for g in record.gpus))
        if entries:
            self.delivery.put_many(entries, urgent=urgent, immediate=immediate)
            if urgent and self._loop_thread is not None and threading.get_ident() != self._loop_thread:
                self.wake()  # a source thread (NVML events, the commands consumer): send now, not at the next tick

    def say_once(self, key: str, level: int, msg: str, *args: Any) -> None:
        """Log ``msg`` the first time ``key`` is seen (a blind source says so once, not every tick)."""
        if key not in self._said:
            self._said.add(key)
            log.log(level, msg, *args)

    def set_state(self, name: str, state: str, detail: str = "") -> None:
        """A source's state changed (logged on change, mirrored in ``faultlens_source_up``)."""
        h = self.health[name]
        if h.state != state or h.detail != detail:
            level = logging.INFO if state == "ok" else logging.WARNING
            log.log(level, "source %s: %s%s", name, state, f" ({detail})" if detail else "")
        h.state, h.detail = state, detail
        if self.metrics is not None:
            self.metrics.source_up.labels(source=name).set(1 if state == "ok" else 0)

    def success(self, name: str, lines: int = 0, records: int = 0, now: float | None = None) -> None:
        """A source read ``lines`` and emitted ``records``; ``now`` (monotonic) feeds lines/s."""
        h = self.health[name]
        h.lines += lines
        h.records += records
        h.last_success_ts = time.time()
        if self.metrics is not None and (lines or records):
            self.metrics.last_event_ts.labels(source=name).set(h.last_success_ts)
        if lines and now is not None:
            w = h._window
            w.append((now, h.lines))
            if len(w) > 512:
                del w[:256]

    def parse_failure(self, name: str) -> None:
        """One input unit of ``name`` did not parse (it is kept by the source, never dropped)."""
        self.health[name].parse_failures += 1
        if self.metrics is not None:
            self.metrics.parse_failures.labels(source=name).inc()

    @property
    def healthy(self) -> bool:
        """True only when every requested source delivers (none blind, none failing)."""
        return all(h.state in ("ok", "off") for h in self.health.values())

    def health_report(self) -> dict[str, Any]:
        now = time.monotonic()
        return {"node": self.node, "healthy": self.healthy, "connected": self.delivery.connected,
                "sources": {n: h.to_dict(now) for n, h in self.health.items()},
                "spool": {"records_spooled": self.spool.spooled_records, "records_replayed": self.spool.replayed_records,
                          "bytes": self.spool.bytes, "dropped_records": self.spool.dropped_records,
                          "dropped_bytes": self.spool.dropped_bytes, "max_bytes": self.spool.max_bytes},
                "sent": self.delivery.sent, "send_requests": self.delivery.requests, "ticks": self.ticks,
                "resends": self.delivery.resends, "last_bus_error": self.delivery.last_error}

    # ------------------------------------------------------------------ start
    def _start_metrics(self) -> None:
        from prometheus_client import Counter, Gauge


        self.metrics = ServiceMetrics("agent")
        r = self.metrics.registry
        self._extra_metrics = {
            "healthy": Gauge("faultlens_agent_healthy", "1 when every requested source delivers.", registry=r),
            "spool_bytes": Gauge("faultlens_spool_bytes", "Bytes waiting in the on-disk spool.", registry=r),
            "spool_dropped": Gauge("faultlens_spool_dropped_records",
                                   "Records dropped because the spool exceeded agent.spool_max_bytes (cumulative).", registry=r),
            "spool_spooled": Gauge("faultlens_spool_records", "Records written to the spool (cumulative).", registry=r),
            "ordinary": Counter("faultlens_agent_ordinary_lines", "Ordinary log lines counted, not shipped "
                                "(agent.ship_ordinary_lines=false).", ["source"], registry=r),
        }
        if self.config.agent.metrics_port > 0:
            self._metrics_server = MetricsServer(r, self.config.agent.metrics_port, host=self.config.agent.metrics_host)
            self._metrics_server.start()

    def _start_sources(self) -> None:
        positions: dict[str, Any] = {}
        try:
            positions = json.loads(self._positions_path.read_text())
        except (OSError, ValueError):
            pass
        seqs = positions.get(SEQ_STATE_KEY)
        if isinstance(seqs, dict):
            try:
                self.delivery.restore_seq_state({k: v for k, v in seqs.items() if k in REPLAYED_KINDS})
            except (TypeError, ValueError):
                log.warning("positions: unreadable record seqs; records read again get new keys")
        tids = positions.get(TOPIC_IDS_KEY)
        if isinstance(tids, dict):
            self.delivery.topic_ids.update({str(k): str(v) for k, v in tids.items()})
        for name in self.sources:
            source = source_factory(name)(self, self.options.get(name, {}))
            self._sources.append(source)
            source.start(positions.get(name, {}))

    # ------------------------------------------------------------------ loop
    def run(self, stop: threading.Event | None = None) -> None:
        """Run until ``stop`` is set; then deliver or spool what is left.

        Event-driven: between ticks the loop blocks on the sources' descriptors (/dev/kmsg,
        journalctl's pipe, the inotify watch of followed files) and wakes when one is
        readable, when a record it holds or queued is due, or after ``tick_s`` at most.
        """
        stop = stop or self._stop
        self._stop = stop
        self._loop_thread = threading.get_ident()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._start_metrics()
        self._start_sources()
        ac = self.config.agent
        next_health = time.monotonic() + ac.health_interval_s
        try:
            while not stop.is_set():
                now = time.monotonic()
                self.tick(now)
                if now >= next_health:
                    next_health = now + ac.health_interval_s
                    self.log_health()
                timeout = RECORD_QUIET_S if self._holding_a_record() else self.tick_s
                due = self.delivery.next_due_s()
                self._wait(stop, timeout if due is None else min(timeout, due))
        finally:
            self.shutdown()

    def wake(self) -> None:
        """Make the loop tick now (a source thread emitted records; stop was asked)."""
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full: a wake-up is already pending

    def _wait(self, stop: threading.Event, timeout: float) -> None:
        """Block until a source's descriptor is readable, ``wake()``, ``stop`` or ``timeout``.

        The first change after a quiet spell is read at once. While changes keep coming
        (the tick before was woken by one too), ticks are ``min(tick_s, MAX_TICK_GAP_S)``
        apart: each wake-up of a sleeping process costs about as much as reading a few
        hundred lines (benchmarks/agent_overhead.py), so a busy log is read in batches,
        as often as the polling agent read it.
        """
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        for src in self._sources:
            fileno = getattr(src, "fileno", None)
            fd = fileno() if fileno is not None else None
            if fd is not None:
                poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + timeout
        while not stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            ready = poller.poll(min(left, STOP_CHECK_S) * 1000)
            if ready:
                if any(fd == self._wake_r for fd, _ in ready):
                    try:
                        os.read(self._wake_r, 4096)
                    except (BlockingIOError, OSError):
                        pass
                since = time.monotonic() - self._last_tick
                gap = min(self.tick_s, MAX_TICK_GAP_S)
                if self._event_tick and since < gap:
                    stop.wait(gap - since)  # a stream of writes: read in batches, as often as the polling agent did
                self._event_tick = True
                return
        self._event_tick = False

    def _holding_a_record(self) -> bool:
        """A source holds a parsed record open, waiting to see if the next line continues it."""
        return any(src.holding() for src in self._sources)

    def run_for(self, seconds: float) -> dict[str, Any]:
        """Run for ``seconds`` (tests, benchmarks); returns the final health report."""
        stop = threading.Event()

        def end() -> None:
            stop.set()
            self.wake()

        timer = threading.Timer(seconds, end)
        timer.start()
        try:
            self.run(stop)
        finally:
            timer.cancel()
        return self.health_report()

    def tick(self, now: float) -> None:
        """One round: every source in its configured order, then delivery."""
        self._last_tick = now
        self.ticks += 1
        for source in self._sources:
            source.poll(now)
        self.delivery.pump()
        if now >= self._next_checkpoint and self._checkpoint_positions():
            self._next_checkpoint = now + CHECKPOINT_S
        if now >= self._next_metrics:
            self._next_metrics = now + METRICS_S
            self._update_metrics()
            self.delivery.trim_retained()

    # ------------------------------------------------------------------ log sources
    def ship_log_lines(self, name: str, parser: Any, lines: list[str],
                       unparsed: Callable[[str, Exception], Any]) -> int:
        """Parse a batch of log lines; ship what is recognised (and bad input); count ordinary lines.

        ``unparsed(line, exc)`` makes the record that keeps a line the parser failed on.
        """
        bad: list[Any] = []

        def bad_line(line: str, exc: Exception) -> None:  # a bad line is counted and kept, never fatal
            self.parse_failure(name)
            self.say_once(f"{name}.parse.{type(exc).__name__}", logging.WARNING, "%s: a line did not parse (%s): %r",
                          name, exc, line[:200])
            bad.append(unparsed(line, exc))

        if self.ship_ordinary:
            items: list[Any] = []
            for line in lines:
                try:
                    items += parser.feed(line)
                except Exception as exc:  # noqa: BLE001
                    bad_line(line, exc)
        else:
            items = parser.feed_many(lines, on_error=bad_line)
            items += parser.release()
        self.emit_many(bad)
        return len(bad) + self.ship_parsed(name, parser, items)

    def ship_parsed(self, name: str, parser: Any, items: list[Any]) -> int:
        """Emit the records among ``items`` that are not ordinary; count the ordinary lines."""
        ordinary = 0
        out = []
        for it in items:
            if isinstance(it, int):
                ordinary += it
            elif not self.ship_ordinary and is_ordinary(it):  # the one classifier decides (faultlens.collectors.signatures)
                ordinary += it.raw.count("\n") + 1
            else:
                out.append(it)
        self.emit_many(out)
        if ordinary:
            self.health[name].ordinary_lines += ordinary
            if self._extra_metrics:
                self._extra_metrics["ordinary"].labels(source=name).inc(ordinary)
        return len(out)

    # ------------------------------------------------------------------ health, stop
    def log_health(self) -> None:
        rep = self.health_report()
        now = time.monotonic()
        parts = [f"{n}={h.state}" + (f" {h.lines_per_s(now):.1f}l/s" if h.lines else "") +
                 (f" fail={h.parse_failures}" if h.parse_failures else "") for n, h in self.health.items()]
        sp = rep["spool"]
        log.log(logging.INFO if rep["healthy"] else logging.WARNING,
                "health: %s; %s; sent=%d spool=%dB dropped=%d", "healthy" if rep["healthy"] else "NOT healthy",
                " ".join(parts), rep["sent"], sp["bytes"], sp["dropped_records"])

    def _update_metrics(self) -> None:
        if not self._extra_metrics:
            return
        m = self._extra_metrics
        m["healthy"].set(1 if self.healthy else 0)
        m["spool_bytes"].set(self.spool.bytes)
        m["spool_dropped"].set(self.spool.dropped_records)
        m["spool_spooled"].set(self.spool.spooled_records)

    def _checkpoint_positions(self) -> bool:
        """Save the followers' positions once every record of the lines read so far is sent or spooled.

        A position saved while records of its lines still wait in memory loses them at a
        kill -9 (the restarted agent starts after them); one saved long after they went
        out makes the restarted agent read and send those lines again. So it is saved
        right after a delivery leaves nothing queued and no parser holds a record.
        """
        if self.delivery.pending() or self._holding_a_record():
            return False
        self._save_positions()
        return True

    def _save_positions(self) -> None:
        """Positions, with the record seqs of the followed kinds at that point: an agent restarted
        there reads the same lines again and stamps the same keys, so the lake drops the second copy."""
        state: dict[str, Any] = {src.name: pos for src in self._sources if (pos := src.positions()) is not None}
        state[SEQ_STATE_KEY] = self.delivery.seq_state(REPLAYED_KINDS)
        state[TOPIC_IDS_KEY] = dict(self.delivery.topic_ids)
        if state == self._saved_positions:
            return
        self._saved_positions = state
        try:
            tmp = self._positions_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(state))
            os.replace(tmp, self._positions_path)
        except OSError as exc:
            self.say_once("positions", logging.WARNING, "cannot save follower positions: %s", exc)

    def shutdown(self) -> None:
        self._stop.set()
        for src in self._sources:
            src.drain()
        self.delivery.close()
        self._save_positions()
        for src in self._sources:
            try:
                src.close()
            except Exception as exc:  # noqa: BLE001 - one source's close must not keep the others open
                log.warning("source %s: close failed: %s", src.name, exc)
        if self._metrics_server is not None:
            self._metrics_server.stop()
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
        self.log_health()
