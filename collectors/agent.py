"""The node agent: runs the enabled sources and ships their records through the spool.

One loop thread polls the followers (kernel, nccl, steps), samples NVML every
``agent.nvml_interval_s``, pumps delivery and logs health; two helper threads
block where blocking is the API: NVML's event wait, and the ``commands``
consumer that answers ``dump_stacks`` requests.

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

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from faultlens.collectors.follow import FileFollower, JournalReader, KmsgReader
from faultlens.collectors.kernel import KernelParser
from faultlens.collectors.nccl import NcclParser
from faultlens.collectors.nvml_backend import NvmlBackend, NvmlEvent
from faultlens.collectors.spool import Delivery, Spool
from faultlens.collectors.steps import StepLogParser, step_fields_duration
from faultlens.config import Config
from faultlens.errors import BusError, FaultlensError, NoData, SchemaError
from faultlens.stream import schema, topics
from faultlens.stream.decode import encode_wire
from faultlens.stream.schema import (
    Command,
    DeadLetter,
    GpuSample,
    KernelEvent,
    NcclEvent,
    StackDump,
    StepTiming,
)

log = logging.getLogger(__name__)

StacksProvider = Callable[[str, str, str], list[StackDump]]  # (job, node, request_id) -> dumps
# A record held for its continuation lines is shipped once its log has been quiet this
# long: printk and NCCL write a record's lines together, so a short wait suffices. While a
# parser holds one, the loop wakes this often instead of every tick, so that a fault line
# is not held back a whole tick after it was read.
RECORD_QUIET_S = 0.1
KERNEL_FILES = ("/var/log/kern.log", "/var/log/messages", "/var/log/syslog")
RESCAN_S = 5.0  # how often a follower looks for new/rotated files (a glob is a directory listing)
PERIODIC_KINDS = ("gpu", "steps")  # telemetry that comes every second anyway: never urgent (a lost GPU is)
METRICS_S = 1.0  # gauges that mirror counters are refreshed this often, not every tick


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


def boot_time() -> float | None:
    """Unix time of boot (/proc/stat btime): turns dmesg/kmsg uptimes into timestamps."""
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        return None
    return None


def _default_stacks(job: str, node: str, request_id: str) -> list[StackDump]:
    from faultlens.collectors.stacks import dump_job

    return dump_job(job, node, request_id=request_id)


class Agent:
    """The faultlens node agent. ``run(stop)`` until ``stop`` is set; ``run_for(seconds)``."""

    def __init__(
        self,
        config: Config,
        *,
        bootstrap: str | None = None,
        node: str | None = None,
        nvml_backend: NvmlBackend | None = None,
        kernel_source: str | None = None,
        nccl_glob: str | None = None,
        steps_glob: str | None = None,
        stacks_provider: StacksProvider | None = None,
        sources: tuple[str, ...] | None = None,
        tick_s: float | None = None,
        from_end: bool = True,
        clock: Callable[[], float] = time.time,
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
        self.kernel_source = kernel_source or ac.kernel_follow
        self.nccl_glob = nccl_glob if nccl_glob is not None else ac.nccl_glob
        self.steps_glob = steps_glob if steps_glob is not None else ac.steps_glob
        self.stacks_provider = stacks_provider or _default_stacks
        self._nvml_backend = nvml_backend
        self.health = {name: SourceHealth(name) for name in self.sources}
        self.spool = Spool(ac.spool_dir, max_bytes=ac.spool_max_bytes)
        self.metrics: Any = None
        self._metrics_server: Any = None
        self._extra_metrics: dict[str, Any] = {}
        self.delivery = Delivery(self._producer, self.spool, on_sent=self._on_sent,
                                 min_send_interval_s=ac.min_send_interval_s)
        self._followers: dict[str, Any] = {}
        self._parsers: dict[str, Any] = {}
        self._last_line: dict[str, float] = {}
        self._nvml: NvmlBackend | None = None
        self._next_sample = 0.0
        self._sample_now = threading.Event()
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._said: set[str] = set()
        self._seen_commands: set[str] = set()
        self._positions_path = Path(ac.spool_dir) / "positions.json"
        self.ship_ordinary = ac.ship_ordinary_lines
        self._next_metrics = 0.0
        self._step_parsers: dict[str, StepLogParser] = {}

    # ------------------------------------------------------------------ plumbing
    def _producer(self) -> Any:
        from faultlens.stream.bus import Producer, ensure_topics

        try:
            ensure_topics(self.config.bus, self.bootstrap, names=topics.TELEMETRY + ("deadletter",))
        except BusError as exc:  # no rights to create topics is fine; the producer tells if the bus is down
            log.debug("ensure_topics: %s", exc)
        # kafka-python's own metrics (sensors updated on every request) are a third of its
        # CPU per produce request; the agent counts what it sends itself (health, Prometheus).
        return Producer(self.config.bus, self.bootstrap, max_block_ms=5000, request_timeout_ms=5000,
                        delivery_timeout_ms=15000, retries=2, bootstrap_timeout_ms=5000, reconnect_backoff_max_ms=2000,
                        metrics_enabled=False)

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
        within ``agent.min_send_interval_s`` (see ``Delivery``).
        """
        entries = []
        urgent = False
        for record in records:
            kind = type(record).KIND
            if kind in ("kernel", "nccl") and record.ts <= 0:
                record = schema.replace(record, ts=self.clock())
            entries.append((kind, getattr(record, topics.KEY_FIELD[kind], None), encode_wire(record)))
            urgent = urgent or kind not in PERIODIC_KINDS or (kind == "gpu" and any(g.lost for g in record.gpus))
        if entries:
            self.delivery.put_many(entries, urgent=urgent)

    def _say_once(self, key: str, level: int, msg: str, *args: Any) -> None:
        if key not in self._said:
            self._said.add(key)
            log.log(level, msg, *args)

    def _set_state(self, name: str, state: str, detail: str = "") -> None:
        h = self.health[name]
        if h.state != state or h.detail != detail:
            level = logging.INFO if state == "ok" else logging.WARNING
            log.log(level, "source %s: %s%s", name, state, f" ({detail})" if detail else "")
        h.state, h.detail = state, detail
        if self.metrics is not None:
            self.metrics.source_up.labels(source=name).set(1 if state == "ok" else 0)

    def _success(self, name: str, lines: int = 0, records: int = 0) -> None:
        h = self.health[name]
        h.lines += lines
        h.records += records
        h.last_success_ts = time.time()
        if self.metrics is not None and (lines or records):
            self.metrics.last_event_ts.labels(source=name).set(h.last_success_ts)

    def _parse_failure(self, name: str) -> None:
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
                "sent": self.delivery.sent, "last_bus_error": self.delivery.last_error}

    # ------------------------------------------------------------------ start
    def _start_metrics(self) -> None:
        from prometheus_client import Counter, Gauge

        from faultlens.metrics import MetricsServer, ServiceMetrics

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
        if "nvml" in self.sources:
            self._start_nvml()
        if "kernel" in self.sources:
            self._start_kernel(positions.get("kernel", {}))
        for name, pattern in (("nccl", self.nccl_glob), ("steps", self.steps_glob)):
            if name not in self.sources:
                continue
            if not pattern:
                self._set_state(name, "off", "no glob configured")
                continue
            f = FileFollower(pattern, from_end=self.from_end, rescan_interval_s=RESCAN_S)
            f.restore(positions.get(name, {}))
            self._followers[name] = f
            if name == "nccl":
                self._parsers[name] = NcclParser(self.node, job=self.job)
            self._set_state(name, "ok", f"following {pattern}")
        if "stacks" in self.sources:
            t = threading.Thread(target=self._stacks_loop, name="faultlens-stacks", daemon=True)
            self._threads.append(t)
            t.start()

    def _start_nvml(self) -> None:
        backend = self._nvml_backend
        if backend is None:
            from faultlens.collectors.nvml import PynvmlBackend

            backend = PynvmlBackend()
        try:
            backend.open()
        except NoData as exc:
            self._say_once("nvml.nodata", logging.WARNING, "nvml: no data on this host: %s; the other sources go on", exc)
            self._set_state("nvml", "no_data", str(exc))
            return
        except FaultlensError as exc:
            self._set_state("nvml", "error", str(exc))
            return
        self._nvml = backend
        self._set_state("nvml", "ok", f"{backend.device_count()} GPUs")
        t = threading.Thread(target=self._events_loop, name="faultlens-nvml-events", daemon=True)
        self._threads.append(t)
        t.start()

    def _start_kernel(self, positions: dict[str, Any]) -> None:
        src = self.kernel_source
        reader: Any = None
        detail = ""
        tried = []
        try:
            if src in ("auto", "kmsg"):
                try:
                    reader, detail = KmsgReader("/dev/kmsg", from_end=self.from_end), "/dev/kmsg"
                except NoData as exc:
                    tried.append(str(exc))
                    if src == "kmsg":
                        raise
            if reader is None and src in ("auto", "journal"):
                try:
                    reader, detail = JournalReader(), "journalctl -k -f"
                except NoData as exc:
                    tried.append(str(exc))
                    if src == "journal":
                        raise
            if reader is None and src == "auto":
                path = next((p for p in KERNEL_FILES if os.access(p, os.R_OK)), None)
                if path is None:
                    raise NoData("no readable kernel log: " + "; ".join(tried + [f"none of {', '.join(KERNEL_FILES)}"]))
                src = path
            if reader is None:
                if not os.path.exists(src) and not any(c in src for c in "*?["):
                    self._say_once("kernel.missing", logging.WARNING, "kernel: %s does not exist yet; waiting for it", src)
                f = FileFollower(src, from_end=self.from_end, rescan_interval_s=RESCAN_S)
                f.restore(positions)
                reader, detail = f, src
        except NoData as exc:
            self._set_state("kernel", "no_data", str(exc))
            return
        self._followers["kernel"] = reader
        self._parsers["kernel"] = KernelParser(self.node, boot_time=boot_time())
        self._set_state("kernel", "ok", f"following {detail}")

    # ------------------------------------------------------------------ loop
    def run(self, stop: threading.Event | None = None) -> None:
        """Run until ``stop`` is set; then deliver or spool what is left."""
        stop = stop or self._stop
        self._stop = stop
        self._start_metrics()
        self._start_sources()
        ac = self.config.agent
        next_health = time.monotonic() + ac.health_interval_s
        next_positions = time.monotonic() + 5.0
        try:
            while not stop.is_set():
                now = time.monotonic()
                self.tick(now)
                if now >= next_health:
                    next_health = now + ac.health_interval_s
                    self.log_health()
                if now >= next_positions:
                    next_positions = now + 5.0
                    self._save_positions()
                stop.wait(RECORD_QUIET_S if self._holding_a_record() else self.tick_s)
        finally:
            self.shutdown()

    def _holding_a_record(self) -> bool:
        """A parser holds a parsed record open, waiting to see if the next line continues it."""
        return any(getattr(p, "_pending", None) is not None for p in self._parsers.values())

    def run_for(self, seconds: float) -> dict[str, Any]:
        """Run for ``seconds`` (tests, benchmarks); returns the final health report."""
        stop = threading.Event()
        timer = threading.Timer(seconds, stop.set)
        timer.start()
        try:
            self.run(stop)
        finally:
            timer.cancel()
        return self.health_report()

    def tick(self, now: float) -> None:
        """One round: NVML sample when due, followers, parser idle flush, delivery."""
        if self._nvml is not None and (now >= self._next_sample or self._sample_now.is_set()):
            self._sample_now.clear()
            self._next_sample = now + self.config.agent.nvml_interval_s
            self._sample()
        for name in ("kernel", "nccl", "steps"):
            f = self._followers.get(name)
            if f is not None:
                self._poll_source(name, f, now)
        self.delivery.pump()
        if now >= self._next_metrics:
            self._next_metrics = now + METRICS_S
            self._update_metrics()

    def _sample(self) -> None:
        assert self._nvml is not None
        try:
            gpus = self._nvml.read()
        except NoData as exc:
            self._set_state("nvml", "no_data", str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a backend bug must not stop the other sources
            self._set_state("nvml", "error", f"{type(exc).__name__}: {exc}")
            return
        self.emit(GpuSample(self.clock(), self.node, gpus, self.job))
        lost = [g.index for g in gpus if g.lost]
        self._set_state("nvml", "ok", f"{len(gpus)} GPUs" + (f", lost: {lost}" if lost else ""))
        self._success("nvml", records=1)
        kp = self._parsers.get("kernel")
        if kp is not None and not kp.gpu_map:
            from faultlens.collectors.kernel import normalize_pci

            kp.gpu_map = {normalize_pci(g.pci_bus): g.index for g in gpus if g.pci_bus}

    def _poll_source(self, name: str, follower: Any, now: float) -> None:
        try:
            lines = follower.poll()
        except FaultlensError as exc:
            self._set_state(name, "error", str(exc))
            return
        except OSError as exc:
            self._set_state(name, "error", f"{exc}")
            return
        if getattr(follower, "last_error", None):
            self._set_state(name, "error", follower.last_error)
            follower.last_error = None
        elif self.health[name].state == "error":
            self._set_state(name, "ok")
        if lines:
            self._last_line[name] = now
            n = self._feed_steps(lines) if name == "steps" else self._feed_log(name, lines)
            self._success(name, lines=len(lines), records=n)
            w = self.health[name]._window
            w.append((now, self.health[name].lines))
            if len(w) > 512:
                del w[:256]
        elif name in self._parsers and now - self._last_line.get(name, now) >= RECORD_QUIET_S:
            parser = self._parsers[name]
            n = self._ship(name, parser, parser.flush() if self.ship_ordinary else parser.finish())
            self._last_line[name] = now
            if n:
                self._success(name, records=n)

    def _feed_log(self, name: str, lines: list[str]) -> int:
        """Parse a batch of lines; ship what is recognised (and bad input); count ordinary lines."""
        parser = self._parsers[name]
        unparsed: list[Any] = []

        def bad_line(line: str, exc: Exception) -> None:  # a bad line is counted and kept, never fatal
            self._parse_failure(name)
            self._say_once(f"{name}.parse.{type(exc).__name__}", logging.WARNING, "%s: a line did not parse (%s): %r",
                           name, exc, line[:200])
            cls = KernelEvent if name == "kernel" else NcclEvent
            unparsed.append(cls(ts=self.clock(), node=self.node, kind="unparsed", raw=line, message=line,
                                fields={"parse_error": f"{type(exc).__name__}: {exc}"[:300]}))

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
        self.emit_many(unparsed)
        return len(unparsed) + self._ship(name, parser, items)

    def _ship(self, name: str, parser: Any, items: list[Any]) -> int:
        """Emit the records among ``items`` that are not ordinary; count the ordinary lines."""
        ordinary = 0
        out = []
        table = parser.kinds
        for it in items:
            if isinstance(it, int):
                ordinary += it
            elif not self.ship_ordinary and table.is_ordinary(it.kind, it.message, it.raw):
                ordinary += it.raw.count("\n") + 1
            else:
                out.append(it)
        self.emit_many(out)
        if ordinary:
            self.health[name].ordinary_lines += ordinary
            if self._extra_metrics:
                self._extra_metrics["ordinary"].labels(source=name).inc(ordinary)
        return len(out)

    def _feed_steps(self, lines: list[str]) -> int:
        n = 0
        for line in lines:
            s = line.strip()
            if not s:
                continue
            if s.startswith("{"):
                try:
                    obj = orjson.loads(s)
                    if isinstance(obj, dict):
                        obj.setdefault("v", schema.SCHEMA_VERSION)
                        obj.setdefault("node", self.node)
                    rec = schema.from_dict("steps", obj)
                except (orjson.JSONDecodeError, SchemaError) as exc:
                    self._parse_failure("steps")
                    reason = exc.reason if isinstance(exc, SchemaError) else "malformed_json"
                    self.emit(DeadLetter(self.clock(), topics.topic("steps", self.config.bus.topic_prefix), -1, -1, reason,
                                         str(exc)[:300], self.node, s[:10000], len(s)))
                    continue
                self.emit(rec)
                n += 1
                continue
            parser = self._step_parsers.setdefault("log", StepLogParser())
            for fw, f in parser.feed(line):
                rec = self._step_from_log(fw, f)
                if rec is not None:
                    self.emit(rec)
                    n += 1
        return n

    def _step_from_log(self, fw: str, f: dict[str, Any]) -> StepTiming | None:
        dur = step_fields_duration(f)
        step = f.get("iteration", f.get("step", f.get("global_step")))
        if dur is None or step is None:
            return None  # a line without a step time (DeepSpeed lr lines...) is not a timing
        loss = f.get("lm_loss", f.get("loss"))
        return StepTiming(ts=self.clock(), job=self.job or "", rank=0, node=self.node, step=int(step), duration_s=float(dur),
                          loss=float(loss) if isinstance(loss, (int, float)) else None,
                          grad_norm=float(f["grad_norm"]) if isinstance(f.get("grad_norm"), (int, float)) else None)

    # ------------------------------------------------------------------ threads
    def _events_loop(self) -> None:
        backend = self._nvml
        assert backend is not None
        while not self._stop.is_set():
            try:
                events = backend.wait_events(1.0)
            except Exception as exc:  # noqa: BLE001 - an event failure must not kill sampling
                self._say_once("nvml.events", logging.WARNING, "nvml events stopped: %s", exc)
                return
            for ev in events:
                self._on_nvml_event(ev)

    def _on_nvml_event(self, ev: NvmlEvent) -> None:
        if ev.kind == "xid":
            text = f"NVML event: Xid {ev.xid} on GPU {ev.gpu} (PCI:{ev.pci_bus}). {ev.detail}".strip()
            self.emit(KernelEvent(ev.ts, self.node, "xid", text, text, ev.xid, _pci(ev.pci_bus), ev.gpu,
                                  fields={"via": "nvml_event"}))
        elif ev.kind == "gpu_lost":
            text = f"NVML event: GPU {ev.gpu} (PCI:{ev.pci_bus}) has fallen off the bus ({ev.detail or 'GPU is lost'})."
            self.emit(KernelEvent(ev.ts, self.node, "fell_off_bus", text, text, None, _pci(ev.pci_bus), ev.gpu,
                                  fields={"via": "nvml_event"}))
        self._sample_now.set()  # the counters that go with the event, without waiting a full interval

    def _stacks_loop(self) -> None:
        from faultlens.stream.bus import Consumer

        consumer = None
        backoff = 1.0
        while not self._stop.is_set():
            if consumer is None:
                try:
                    consumer = Consumer(self.config.bus, ["commands"], group_id=f"faultlens-agent-{self.node}",
                                        bootstrap=self.bootstrap, from_beginning=False)
                    backoff = 1.0
                except (BusError, OSError) as exc:
                    self._set_state("stacks", "error", f"commands consumer: {exc}")
                    self._stop.wait(backoff)
                    backoff = min(30.0, backoff * 2)
                    continue
            try:
                msgs = consumer.poll(timeout_ms=500)
            except BusError as exc:
                self._set_state("stacks", "error", str(exc))
                consumer.close()
                consumer = None
                continue
            if consumer.raw.assignment():
                if self.health["stacks"].state != "ok":
                    self._set_state("stacks", "ok", "listening on commands")
                self.health["stacks"].last_success_ts = time.time()
            for m in msgs:
                self._on_command(m.value)
            if msgs:
                try:
                    consumer.commit()
                except BusError:
                    pass
        if consumer is not None:
            consumer.close()

    def _on_command(self, value: bytes) -> None:
        try:
            cmd: Command = schema.decode("commands", value)
        except SchemaError as exc:
            self._parse_failure("stacks")
            log.warning("a command that does not decode: %s", exc)
            return
        if cmd.kind != "dump_stacks" or (cmd.nodes and self.node not in cmd.nodes) or cmd.id in self._seen_commands:
            return
        self._seen_commands.add(cmd.id)
        t0 = time.monotonic()
        try:
            dumps = self.stacks_provider(cmd.job, self.node, cmd.id)
        except Exception as exc:  # noqa: BLE001 - report it, as a dump with an error
            dumps = [StackDump(self.clock(), cmd.job, self.node, None, None, "", cmd.id, f"stack collection failed: {exc}")]
        if not dumps:
            dumps = [StackDump(self.clock(), cmd.job, self.node, None, None, "", cmd.id,
                               f"no training process of job {cmd.job} found on {self.node}")]
        for d in dumps:
            self.emit(d)
        failed = sum(1 for d in dumps if d.error)
        self._success("stacks", records=len(dumps))
        log.info("dump_stacks %s for job %s: %d dumps (%d failed) in %.1f s", cmd.id, cmd.job, len(dumps), failed,
                 time.monotonic() - t0)

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

    def _save_positions(self) -> None:
        state = {n: f.state() for n, f in self._followers.items() if isinstance(f, FileFollower)}
        try:
            tmp = self._positions_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(state))
            os.replace(tmp, self._positions_path)
        except OSError as exc:
            self._say_once("positions", logging.WARNING, "cannot save follower positions: %s", exc)

    def shutdown(self) -> None:
        self._stop.set()
        for name, p in self._parsers.items():
            self._ship(name, p, p.flush() if self.ship_ordinary else p.finish())
        for t in self._threads:
            t.join(timeout=5)
        self.delivery.close()
        self._save_positions()
        for f in self._followers.values():
            f.close()
        if self._nvml is not None:
            try:
                self._nvml.close()
            except Exception:  # noqa: BLE001
                pass
        if self._metrics_server is not None:
            self._metrics_server.stop()
        self.log_health()


def _pci(bus: str) -> str | None:
    from faultlens.collectors.kernel import normalize_pci

    return normalize_pci(bus) if bus else None
