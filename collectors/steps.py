"""Step timings: ``StepReporter`` for training loops, and parsers for framework step logs.

``StepReporter`` is what a training loop imports: standard library only (orjson
when present), a context manager or a ``record`` call per step, buffered and
written by a background thread to a local JSON-lines file that the agent follows.
It never blocks the training step and never raises into it: failures are
counted (``errors``), and what does not fit the bounded buffer is counted
(``dropped``).

The parsers turn Megatron-LM / Megatron-DeepSpeed, DeepSpeed, torchtitan and NeMo
step lines into a framework name and a dict of fields.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from faultlens import schema
from faultlens.collectors.container_logs import unwrap_container  # standard library only
from faultlens.collectors.follow import FollowedSource
from faultlens.collectors.sources import register_source
from faultlens.collectors.unparsed import to_int  # standard library only
from faultlens.errors import SchemaError
from faultlens.schema import StepTiming
from faultlens.stream import topics

try:  # import-light: orjson only when present
    import orjson as _orjson

    def _dumps(obj: dict[str, Any]) -> bytes:
        return _orjson.dumps(obj)
except ImportError:  # pragma: no cover - depends on the training environment
    import json as _json

    def _dumps(obj: dict[str, Any]) -> bytes:
        return _json.dumps(obj, separators=(",", ":")).encode()


SCHEMA_VERSION = 1  # faultlens.schema.SCHEMA_VERSION; not imported to stay import-light


class StepReporter:
    """Report one rank's step timings with their workload; safe in the hot loop.

    >>> rep = StepReporter("/tmp/steps.jsonl", job="j1", rank=0)
    >>> with rep.step(12, n_seqs=8, sum_len=16384, sum_len_sq=33554432, tokens=16384):
    ...     pass  # forward, backward, optimizer
    >>> rep.close()
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        job: str | None = None,
        rank: int | None = None,
        node: str | None = None,
        flush_interval_s: float = 1.0,
        max_buffer: int = 100_000,
        background: bool = True,
    ):
        self.job = job or os.environ.get("FAULTLENS_JOB", "")
        self.rank = int(rank if rank is not None else os.environ.get("RANK", "0") or 0)
        self.node = node or socket.gethostname()
        self.path = os.fspath(path) if path is not None else os.environ.get(
            "FAULTLENS_STEPS_FILE", f"/tmp/faultlens-steps-{self.job or 'job'}-{self.rank}.jsonl")
        self.flush_interval_s = flush_interval_s
        self._buf: deque[bytes] = deque()
        self._max = max_buffer
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.errors = 0
        self.dropped = 0
        self.written = 0
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="faultlens-steps", daemon=True)
            self._thread.start()

    def record(self, step: int, duration_s: float, **extra: Any) -> None:
        """Queue one step (workload and optional loss/grad_norm/fwd_s/bwd_s/comm_s). Never raises."""
        try:
            obj = {"v": SCHEMA_VERSION, "ts": time.time(), "job": self.job, "rank": self.rank, "node": self.node,
                   "step": int(step), "duration_s": float(duration_s), "n_seqs": 0, "sum_len": 0, "sum_len_sq": 0,
                   "tokens": 0}
            for k, v in extra.items():
                obj[k] = float(v) if hasattr(v, "item") and not isinstance(v, (int, float)) else v
            line = _dumps(obj) + b"\n"
            if len(self._buf) >= self._max:
                self.dropped += 1
                return
            self._buf.append(line)
            if self._thread is None:
                self.flush()
        except Exception:  # noqa: BLE001 - the training loop must never see our errors
            self.errors += 1

    @contextmanager
    def step(self, step: int, **workload: Any) -> Iterator[dict[str, Any]]:
        """Time the block as one step; extra figures may be put into the yielded dict."""
        extra = dict(workload)
        t0 = time.perf_counter()
        try:
            yield extra
        finally:
            self.record(step, time.perf_counter() - t0, **extra)

    def flush(self) -> None:
        """Write what is buffered (called by the background thread). Never raises."""
        if not self._buf:
            return
        with self._lock:
            chunk = []
            while self._buf:
                chunk.append(self._buf.popleft())
            try:
                with open(self.path, "ab") as f:
                    f.write(b"".join(chunk))
                self.written += len(chunk)
            except Exception:  # noqa: BLE001
                self.errors += 1
                self.dropped += len(chunk)

    def _run(self) -> None:
        while not self._closed.wait(self.flush_interval_s):
            self.flush()
        self.flush()

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self.flush()

    def __enter__(self) -> StepReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- framework log lines

_NUM = r"[-+]?(?:\d[\d,]*\.?\d*(?:[eE][-+]?\d+)?|nan|inf|NaN|Inf)"
_MEGATRON_KEYS = {
    "consumed samples": "consumed_samples", "consumed tokens": "consumed_tokens", "learning rate": "lr",
    "global batch size": "global_batch_size", "lm loss": "lm_loss", "lm_loss": "lm_loss", "loss scale": "loss_scale",
    "grad norm": "grad_norm", "num zeros": "num_zeros", "number of skipped iterations": "skipped_iterations",
    "number of nan iterations": "nan_iterations", "samples per second": "samples_per_sec", "samples/sec": "samples_per_sec",
    "TFLOPs": "tflops", "tokens per second": "tokens_per_sec", "throughput per GPU (TFLOP/s/GPU)": "tflops",
}
ITER_RE = re.compile(r"iteration\s+(\d+)\s*/\s*(\d+)")
ELAPSED_RE = re.compile(r"elapsed time per iteration \((ms|s)\):\s*(" + _NUM + ")")
FLOPS_RE = re.compile(r"approx flops per GPU:\s*(" + _NUM + r")\s*TFLOPS")
DS_STEP_RE = re.compile(r"\bstep=(\d+), skipped=(\d+), lr=(\[[^\]]*\]|" + _NUM + ")")
DS_TIMER_RE = re.compile(r"micro_step=(\d+)/global_step=(\d+), RunningAvgSamplesPerSec=(" + _NUM + r"), CurrSamplesPerSec=(" + _NUM + r")(?:, MemAllocated=(" + _NUM + r")GB, MaxMemAllocated=(" + _NUM + r")GB)?")
TIMES_RE = re.compile(r"time \(ms\)\s*\|(.*)$")
TITAN_RE = re.compile(r"step:\s*(\d+)\s+loss:\s*(" + _NUM + ")")
TITAN_KV_RE = re.compile(r"(memory|tps|tflops|mfu|grad_norm):\s*(" + _NUM + ")")
NEMO_RE = re.compile(r"(?<!\d)(\d+)/(\d+) \[([\d:]+)<([\d:?]+),\s*(" + _NUM + r")(s/it|it/s)(.*)\]")
ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")


def _num(s: str) -> float | int:
    s = s.replace(",", "")
    try:
        return int(s)
    except ValueError:
        return float(s)


def _int(s: str) -> int:
    """A step counter; a mangled one (more digits than any run has steps) is no step line."""
    n = to_int(s)
    if n is None:
        raise ValueError(f"not a step number: {s[:40]!r}")
    return n


def parse_step_line(text: str) -> tuple[str, dict[str, Any]] | None:
    """One framework log line -> (framework, fields), or None when it is not a step line
    (a line whose numbers do not read, e.g. a cut or mangled one, is none either)."""
    try:
        return _parse_step_line(text)
    except (ValueError, OverflowError, IndexError, ZeroDivisionError):
        return None


def _parse_step_line(text: str) -> tuple[str, dict[str, Any]] | None:
    text = unwrap_container(text)[0]  # a container runtime's file on the node: the process's own line
    if "\x1b" in text:
        text = ANSI_RE.sub("", text)
    if "iteration" in text and "|" in text:
        m = ITER_RE.search(text)
        if m:
            f: dict[str, Any] = {"iteration": _int(m.group(1)), "train_iters": _int(m.group(2))}
            e = ELAPSED_RE.search(text)
            if e:
                f["elapsed_ms" if e.group(1) == "ms" else "elapsed_s"] = float(e.group(2))
            for part in text.split("|"):
                key, sep, val = part.partition(":")
                key = key.strip()
                if sep and key in _MEGATRON_KEYS:
                    v = val.strip().split()[0] if val.strip() else ""
                    try:
                        f[_MEGATRON_KEYS[key]] = _num(v)
                    except ValueError:
                        pass
            fl = FLOPS_RE.search(text)
            if fl:
                f["approx_tflops_per_gpu"] = float(fl.group(1))
            for k in ("lr", "lm_loss", "grad_norm", "loss_scale", "num_zeros", "samples_per_sec", "tflops"):
                if k in f:
                    f[k] = float(f[k])
            return "megatron", f
    if "global_step=" in text:
        m = DS_TIMER_RE.search(text)
        if m:
            f = {"micro_step": _int(m.group(1)), "global_step": _int(m.group(2)),
                 "RunningAvgSamplesPerSec": float(m.group(3)), "CurrSamplesPerSec": float(m.group(4))}
            if m.group(5):
                f["MemAllocated"] = float(m.group(5))
                f["MaxMemAllocated"] = float(m.group(6))
            return "deepspeed", f
    if "step=" in text and "skipped=" in text:
        m = DS_STEP_RE.search(text)
        if m:
            lr = m.group(3)
            lrv: Any = [float(x) for x in lr.strip("[]").split(",") if x.strip()] if lr.startswith("[") else float(lr)
            return "deepspeed", {"step": _int(m.group(1)), "skipped": _int(m.group(2)), "lr": lrv}
    if "time (ms)" in text:
        m = TIMES_RE.search(text)
        if m:
            timers = {}
            for part in m.group(1).split("|"):
                k, sep, v = part.partition(":")
                if sep:
                    try:
                        timers[k.strip()] = float(v.strip())
                    except ValueError:
                        pass
            if timers:
                if "[Rank" in text or "log_dist" in text or "rank=" in text:
                    return "deepspeed", {"deepspeed_timers_ms": timers}
                return "megatron_timers", {"timers_ms": timers}
    if "step:" in text and "loss:" in text:
        m = TITAN_RE.search(text)
        if m:
            f = {"step": _int(m.group(1)), "loss": float(m.group(2))}
            for k, v in TITAN_KV_RE.findall(text[m.end():]):
                f[k] = float(v.replace(",", ""))
            return "torchtitan", f
    if "it]" in text or "s/it" in text or "it/s" in text:
        m = NEMO_RE.search(text)
        if m:
            f = {"batch": _int(m.group(1)), "batches_per_epoch": _int(m.group(2)), "elapsed": m.group(3), "eta": m.group(4)}
            rate = float(m.group(5))
            f["sec_per_it" if m.group(6) == "s/it" else "it_per_sec"] = rate
            for kv in m.group(7).split(","):
                k, sep, v = kv.partition("=")
                if sep and v.strip():
                    try:
                        f[k.strip()] = float(v.strip())
                    except ValueError:
                        pass
            return "nemo", f
    return None


def step_fields_duration(fields: dict[str, Any]) -> float | None:
    """Seconds per step from parsed fields, when the line states it."""
    if "elapsed_ms" in fields:
        return float(fields["elapsed_ms"]) / 1000.0
    if "elapsed_s" in fields:
        return float(fields["elapsed_s"])
    if "sec_per_it" in fields:
        return float(fields["sec_per_it"])
    if fields.get("it_per_sec"):
        return 1.0 / float(fields["it_per_sec"])
    return None


class StepLogParser:
    """Framework step lines -> (framework, fields); Megatron's ``time (ms)`` line after an
    iteration line belongs to that iteration, so an iteration is held until the next line."""

    def __init__(self) -> None:
        self._held: tuple[str, dict[str, Any]] | None = None

    def feed(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        got = parse_step_line(text)
        if got is None:
            return []
        out = []
        if got[0] == "megatron_timers" and self._held is not None:
            self._held[1].update(got[1])
            got = None
        if self._held is not None and got is not None:
            out.append(self._held)
            self._held = None
        if got is not None:
            if got[0] == "megatron":
                self._held = got
            else:
                out.append(got)
        return out

    def flush(self) -> list[tuple[str, dict[str, Any]]]:
        held, self._held = self._held, None
        return [held] if held else []


class StepsSource(FollowedSource):
    """The agent's ``steps`` source: StepReporter JSON lines and framework step-log lines.

    Options: ``glob`` (overrides ``agent.steps_glob``). A JSON line that does not decode
    is counted and dead-lettered with its reason; a framework line without a step time
    (DeepSpeed's lr lines...) is not a timing and is skipped.
    """

    name = "steps"

    def __init__(self, agent: Any, options: dict[str, Any]):
        super().__init__(agent, {"glob": agent.config.agent.steps_glob, **options})
        self._log_parser: StepLogParser | None = None

    def feed(self, lines: list[str], now: float) -> int:
        import orjson


        agent = self.agent
        records: list[Any] = []
        for line in lines:
            s = line.strip()
            if not s:
                continue
            if s.startswith('{"log"'):  # Docker's json-file wrapper around the line the trainer wrote
                s = unwrap_container(s)[0].strip()
            if s.startswith("{"):
                try:
                    obj = orjson.loads(s)
                    if isinstance(obj, dict):
                        obj.setdefault("v", schema.SCHEMA_VERSION)
                        obj.setdefault("node", agent.node)
                    rec = schema.from_dict("steps", obj)
                except (orjson.JSONDecodeError, SchemaError, ValueError, TypeError, RecursionError) as exc:
                    agent.parse_failure("steps")
                    reason = exc.reason if isinstance(exc, SchemaError) else "malformed_json"
                    agent.emit_many([schema.DeadLetter(agent.clock(), topics.topic("steps", agent.config.bus.topic_prefix),
                                                       -1, -1, reason, str(exc)[:300], agent.node, s[:10000], len(s))])
                    continue
                records.append(rec)
                continue
            if self._log_parser is None:
                self._log_parser = StepLogParser()
            for _fw, f in self._log_parser.feed(line):
                rec = self._from_log(f)
                if rec is not None:
                    records.append(rec)
        agent.emit_many(records)
        return len(records)

    def _from_log(self, f: dict[str, Any]) -> Any:

        dur = step_fields_duration(f)
        step = f.get("iteration", f.get("step", f.get("global_step")))
        if dur is None or step is None:
            return None
        loss = f.get("lm_loss", f.get("loss"))
        agent = self.agent
        return StepTiming(ts=agent.clock(), job=agent.job or "", rank=0, node=agent.node, step=int(step),
                          duration_s=float(dur), loss=float(loss) if isinstance(loss, (int, float)) else None,
                          grad_norm=float(f["grad_norm"]) if isinstance(f.get("grad_norm"), (int, float)) else None)


register_source("steps", StepsSource)
