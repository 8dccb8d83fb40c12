"""``faultlens.torch``: the one thing a training script adds (torch is imported lazily).

>>> mon = TrainingMonitor(job="llm-7b")          # before init_process_group (Flight Recorder)
>>> for step, batch in enumerate(loader):
...     with mon.step(step, lengths=batch["lengths"]) as s:
...         loss = model(batch).loss; s.mark("fwd")
...         loss.backward(); s.mark("bwd")
...         opt.step(); s.update(loss=loss, grad_norm=gn)

What it does, always off the training step's path:

* **step records**: one StepReporter line per step (DESIGN.md: ``v, ts, job, rank, node, step,
  duration_s, n_seqs, sum_len, sum_len_sq, tokens`` and ``loss, grad_norm, fwd_s, bwd_s,
  comm_s``) appended by a background thread to ``FAULTLENS_STEPS_FILE`` (else
  ``FAULTLENS_STEPS_DIR/steps-<job>-<rank>.jsonl``, else /tmp), the file the node agent's
  ``steps`` source follows (``--steps-glob``). Tensors given as loss or grad norm are turned
  into numbers by that thread, so the training thread never waits on the device for them;
  ``comm_s`` comes from a DDP communication hook (``watch_ddp``) timing its buckets: DDP's
  ``backward()`` returns only when its all-reduce is done, so with the hook ``bwd_s`` ends when
  the rank's last bucket was ready (its own compute) and ``comm_s`` is the rest of backward (the
  wait for its peers): a slow rank computes longer and waits less, its peers the reverse.
* **stall watchdog**: when no step completed for ``stall_s`` (and again every ``stall_s`` while
  the stall lasts), the rank writes its own Flight Recorder dump (``torch._C._distributed_c10d._dump_fr_trace``; gloo and NCCL keep one when
  ``TORCH_FR_BUFFER_SIZE`` > 0, which the monitor sets if unset) to
  ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>``; the agent's ``flight_recorder`` source
  (``agent.flight_recorder_glob``) ships it unasked: a stalled rank's own word that it is
  alive and where it waits.
* **dump on request**: the agent answering ``dump_stacks`` touches ``<that path>.request``;
  the watchdog thread sees it within ``poll_s`` and writes a fresh dump (a stopped or dead
  rank does not: collectors/flight_recorder.py reports that as evidence).

It never blocks or raises into the training loop: what it cannot write is counted
(``errors``, ``dropped``, ``dump_errors``) and shown by ``stats()``. The torchrun error file
(``TORCHELASTIC_ERROR_FILE``, written by torch's ``@record``) is read by the agent's
``elastic`` source, not here. Imports only the standard library and orjson.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import orjson

SCHEMA_VERSION = 1  # faultlens.schema.SCHEMA_VERSION (the schema module is not imported: import-light)
FR_PREFIX_ENV = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
FR_DEFAULT_PREFIX = "/tmp/nccl_trace_rank_"  # PyTorch's default, and collectors/flight_recorder.py's
REQUEST_SUFFIX = ".request"  # <dump path>.request: the agent asks for a fresh dump
MONITOR_SUFFIX = ".monitor"  # <dump path>.monitor: {pid, job, rank, node}; the agent asks only ranks that have one
FR_BUFFER_DEFAULT = "2000"  # entries the Flight Recorder keeps when the job did not say


def workload(lengths: Sequence[int] | Any) -> dict[str, int]:
    """n_seqs, sum_len, sum_len_sq, tokens of a batch from its sequence lengths (a list or a CPU
    tensor; a device tensor would cost a sync: pass the lengths the loader had on the host)."""
    if hasattr(lengths, "tolist"):
        lengths = lengths.tolist()
    ls = [int(x) for x in lengths]
    s = sum(ls)
    return {"n_seqs": len(ls), "sum_len": s, "sum_len_sq": sum(x * x for x in ls), "tokens": s}


def _number(v: Any) -> float | None:
    """A float for JSON (a tensor's ``item()`` here, on the writer thread); NaN/Inf -> None (JSON has none)."""
    if v is None:
        return None
    if hasattr(v, "item"):
        v = v.detach().float().item() if hasattr(v, "detach") else v.item()
    x = float(v)
    return x if math.isfinite(x) else None


class StepTimer:
    """What ``TrainingMonitor.step`` yields: ``mark('fwd'|'bwd')`` splits the step, ``update``
    adds loss, grad norm or workload figures."""

    __slots__ = ("_t0", "_last", "bwd_end", "fields")

    def __init__(self, t0: float, fields: dict[str, Any]):
        self._t0 = self._last = t0
        self.bwd_end = 0.0  # perf_counter at mark("bwd")
        self.fields = fields

    def mark(self, phase: str) -> None:
        """The phase since the previous mark (or the step's start) ended now: ``fwd`` or ``bwd``."""
        now = time.perf_counter()
        self.fields[f"{phase}_s"] = now - self._last
        self._last = now
        if phase == "bwd":
            self.bwd_end = now

    def update(self, **fields: Any) -> None:
        self.fields.update(fields)


def _split_backward(timer: StepTimer, comm: list[float]) -> None:
    """``bwd_s`` to the last bucket's launch (the rank's own compute) and ``comm_s`` the rest of backward
    (waiting for the all-reduce), when ``bwd`` was marked after the buckets; else ``comm_s`` is the
    buckets' span. A rank capped at 5% of a CPU in a real 8-rank job showed bwd_s as long as its
    peers' (they waited for it inside backward): no machine stood out until the split."""
    bwd = timer.fields.get("bwd_s")
    if isinstance(bwd, float) and comm[0] <= comm[3] <= timer.bwd_end:
        wait = timer.bwd_end - comm[3]
        timer.fields["bwd_s"] = max(0.0, bwd - wait)
        timer.fields["comm_s"] = wait
    else:
        timer.fields["comm_s"] = max(0.0, comm[1] - comm[0])


class TrainingMonitor:
    """Step records, a stall watchdog and Flight Recorder dumps for one rank (see the module doc)."""

    def __init__(self, *, job: str | None = None, rank: int | None = None, node: str | None = None,
                 steps_path: str | None = None, stall_s: float = 60.0, poll_s: float = 0.5,
                 flush_interval_s: float = 0.5, max_buffer: int = 10_000, flight_recorder: bool = True):
        env = os.environ
        self.job = job or env.get("FAULTLENS_JOB") or env.get("TORCHELASTIC_RUN_ID", "")
        self.rank = int(rank if rank is not None else env.get("RANK", "0") or 0)
        self.node = node or env.get("FAULTLENS_NODE") or socket.gethostname()
        self.path = steps_path or env.get("FAULTLENS_STEPS_FILE") or os.path.join(
            env.get("FAULTLENS_STEPS_DIR", "/tmp"), f"steps-{self.job or 'job'}-{self.rank}.jsonl")
        self.dump_path = env.get(FR_PREFIX_ENV, FR_DEFAULT_PREFIX) + str(self.rank)
        if flight_recorder:
            env.setdefault("TORCH_FR_BUFFER_SIZE", FR_BUFFER_DEFAULT)  # read when the process group starts
        self.stall_s = stall_s
        self.poll_s = poll_s
        self.flush_interval_s = flush_interval_s
        self._buf: deque[dict[str, Any]] = deque()
        self._max = max_buffer
        self.errors = self.dropped = self.written = 0
        self.dumps = self.dump_errors = self.failed_steps = 0
        self.last_dump_error = ""
        self._last_step_mono = time.monotonic()
        self._next_stall_dump = 0.0
        self._request_seen = 0.0
        # this step's DDP buckets: first launched, last done, how many, last launched
        self._comm: list[float] = [0.0, 0.0, 0.0, 0.0]
        try:  # tells the agent this pid answers dump requests
            with open(self.dump_path + MONITOR_SUFFIX, "wb") as f:
                f.write(orjson.dumps({"pid": os.getpid(), "job": self.job, "rank": self.rank, "node": self.node}))
        except OSError:
            self.errors += 1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="faultlens-monitor", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the training thread's side
    @contextmanager
    def step(self, step: int, *, lengths: Sequence[int] | Any = None, **fields: Any) -> Iterator[StepTimer]:
        """Time the block as step ``step``; ``lengths`` (host-side) gives its workload."""
        t0 = time.perf_counter()
        timer = StepTimer(t0, dict(fields))
        self._comm[:] = [0.0, 0.0, 0.0, 0.0]
        try:
            yield timer
        except BaseException:
            self.failed_steps += 1  # a step that raised did not complete: no record (its loss would read as missing)
            raise
        else:
            try:
                if lengths is not None:
                    timer.fields.update(workload(lengths))
                if self._comm[2]:
                    _split_backward(timer, self._comm)
                self.record(step, time.perf_counter() - t0, **timer.fields)
            except Exception:  # noqa: BLE001 - the training loop must never see our errors
                self.errors += 1

    def record(self, step: int, duration_s: float, **fields: Any) -> None:
        """Queue one step record (converted and written by the background thread). Never raises."""
        try:
            self._last_step_mono = time.monotonic()
            if len(self._buf) >= self._max:
                self.dropped += 1
                return
            self._buf.append({"ts": time.time(), "step": int(step), "duration_s": float(duration_s), **fields})
        except Exception:  # noqa: BLE001
            self.errors += 1

    def watch_ddp(self, ddp_model: Any) -> bool:
        """Time DDP's gradient buckets (``comm_s``: first launch to last completion in the step) with a
        communication hook around the default allreduce. False (and nothing changed) when it cannot."""
        try:
            # lazy: torch only here
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        except ImportError:
            return False
        comm = self._comm

        def timed_allreduce(state, bucket):  # type: ignore[no-untyped-def]  # DDP refuses annotations it does not know
            now = time.perf_counter()
            if not comm[2]:
                comm[0] = now
            comm[2] += 1
            comm[3] = now  # the rank's gradients of this bucket are ready: its compute reached here
            fut = default_hooks.allreduce_hook(state, bucket)

            def done(f: Any) -> Any:
                comm[1] = time.perf_counter()
                return f.value()

            return fut.then(done)

        try:
            ddp_model.register_comm_hook(None, timed_allreduce)
        except Exception:  # noqa: BLE001 - a hook already registered, not DDP: no comm split
            return False
        return True

    # ------------------------------------------------------------------ the monitor thread
    def _run(self) -> None:
        next_flush = 0.0
        while not self._stop.wait(self.poll_s):
            now = time.monotonic()
            if now >= next_flush:
                self.flush()
                next_flush = now + self.flush_interval_s
            self._watch(now)
        self.flush()

    def _watch(self, now: float) -> None:
        try:
            req = os.stat(self.dump_path + REQUEST_SUFFIX).st_mtime
        except OSError:
            req = 0.0
        if req and req != self._request_seen:
            self._request_seen = req
            self.dump_flight_recorder()
        stalled = now - self._last_step_mono
        if stalled > self.stall_s and now >= self._next_stall_dump:
            # Again every stall_s while it lasts: each dump says where the rank waits now, and on a
            # host without GPU samples it is the only record that moves the job's event time on.
            self._next_stall_dump = now + self.stall_s
            self.dump_flight_recorder()

    def flush(self) -> None:
        """Write what is queued (the monitor thread calls it). Never raises."""
        if not self._buf:
            return
        lines = []
        while self._buf:
            rec = self._buf.popleft()
            try:
                for k in ("loss", "grad_norm"):
                    if k in rec:
                        rec[k] = _number(rec[k])
                head = {"v": SCHEMA_VERSION, "ts": rec.pop("ts"), "job": self.job, "rank": self.rank, "node": self.node}
                lines.append(orjson.dumps({**head, "n_seqs": 0, "sum_len": 0, "sum_len_sq": 0, "tokens": 0, **rec}))
            except Exception:  # noqa: BLE001 - one record that does not convert
                self.errors += 1
        try:
            with open(self.path, "ab") as f:
                f.write(b"\n".join(lines) + b"\n")
            self.written += len(lines)
        except OSError:
            self.errors += 1
            self.dropped += len(lines)

    def dump_flight_recorder(self) -> str | None:
        """Write this rank's Flight Recorder dump (atomically) where the agent reads it; its path or None."""
        try:
            import torch.distributed as dist  # lazy: torch only here

            if not (dist.is_available() and dist.is_initialized()):
                return None
            from torch._C import _distributed_c10d as c10d

            dump = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)
            if dump is None:
                raise RuntimeError("this torch has no Flight Recorder dump function")
            data = dump()
            tmp = f"{self.dump_path}.tmp{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, self.dump_path)
            self.dumps += 1
            return self.dump_path
        except Exception as exc:  # noqa: BLE001 - counted, never raised into training
            self.dump_errors += 1
            self.last_dump_error = f"{type(exc).__name__}: {exc}"[:300]
            return None

    def stats(self) -> dict[str, Any]:
        return {"written": self.written, "dropped": self.dropped, "errors": self.errors, "failed_steps": self.failed_steps,
                "dumps": self.dumps,
                "dump_errors": self.dump_errors, "last_dump_error": self.last_dump_error}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self.flush()

    def __enter__(self) -> TrainingMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------- framework callbacks
def lightning_callback(monitor: TrainingMonitor | None = None, **kwargs: Any) -> Any:
    """A PyTorch Lightning ``Callback`` over the same monitor (``lightning`` or ``pytorch_lightning``):
    one step record per training batch, with the loss the step returned."""
    try:  # lazy, optional: Lightning only where the job uses it
        from lightning.pytorch import Callback
    except ImportError:
        from pytorch_lightning import Callback  # type: ignore[assignment]  # the older package name, same class
    mon = monitor or TrainingMonitor(**kwargs)

    class FaultlensCallback(Callback):  # type: ignore[misc, valid-type]
        monitor = mon
        _t0 = 0.0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            fields = {"loss": loss.detach() if hasattr(loss, "detach") else loss} if loss is not None else {}
            mon.record(trainer.global_step, time.perf_counter() - self._t0, **fields)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            mon.flush()

    return FaultlensCallback()


def hf_callback(monitor: TrainingMonitor | None = None, **kwargs: Any) -> Any:
    """A Hugging Face ``transformers.TrainerCallback`` over the same monitor: one step record per
    optimizer step; loss and grad norm from the Trainer's logs (``on_log``), on the step after."""
    # lazy, optional: transformers only where the job uses it
    from transformers import TrainerCallback

    mon = monitor or TrainingMonitor(**kwargs)

    class FaultlensHFCallback(TrainerCallback):  # type: ignore[misc, valid-type]
        monitor = mon
        _t0 = 0.0
        _logged: dict[str, Any] = {}

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._t0 = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            fields, self._logged = self._logged, {}
            mon.record(state.global_step, time.perf_counter() - self._t0, **fields)

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
            self._logged = {k: logs[k] for k in ("loss", "grad_norm") if logs and k in logs}

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            mon.flush()

    return FaultlensHFCallback()
