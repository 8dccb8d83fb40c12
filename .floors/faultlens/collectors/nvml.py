"""The real NVML backend (nvidia-ml-py, ``import pynvml``) behind ``NvmlBackend``.

``open()`` raises ``faultlens.errors.NoData`` when there is no NVML library, no
driver or no GPU: "no GPU here" is not a failure. Each counter is read with its
own call; a call the GPU or driver does not support (``NVMLError_NotSupported``,
``NVMLError_FunctionNotFound``) degrades that field only and is remembered per GPU,
so it is not retried every second. ``NVMLError_GpuIsLost`` on any call makes the
GPU a ``GpuState(lost=True)`` plus one ``NvmlEvent(kind="gpu_lost")``: read() never
raises for one GPU's trouble.

``wait_events(timeout_s)`` uses an NVML event set (Xid critical errors, double-
and single-bit ECC where supported) and needs no thread of its own; the agent
calls it from its event thread. ``NVMLError_Timeout`` means no event.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from faultlens.collectors.kernel import normalize_pci
from faultlens.collectors.nvml_backend import NvmlEvent
from faultlens.collectors.sources import register_source
from faultlens.errors import FaultlensError, NoData, SourceError
from faultlens.schema import GpuSample, GpuState, KernelEvent

log = logging.getLogger(__name__)

_NVLINK_COUNTERS = (("nvlink_replay_errors", "NVML_NVLINK_ERROR_DL_REPLAY"),
                    ("nvlink_recovery_errors", "NVML_NVLINK_ERROR_DL_RECOVERY"),
                    ("nvlink_crc_errors", "NVML_NVLINK_ERROR_DL_CRC_FLIT"),
                    ("nvlink_crc_errors", "NVML_NVLINK_ERROR_DL_CRC_DATA"))

# The counters a sample carries (GpuState order). One this GPU or driver does not answer
# is sent as null, never as GpuState's default 0: "no reading" is not "0 errors" or "idle".
COUNTERS = ("util", "mem_util", "mem_used_mb", "temp_c", "power_w", "sm_clock_mhz", "mem_clock_mhz",
            "throttle_reasons", "ecc_sbe", "ecc_dbe", "ecc_sbe_agg", "ecc_dbe_agg", "retired_pages",
            "remap_pending", "remap_failure", "remapped_rows_corr", "remapped_rows_unc", "pcie_replay",
            "nvlink_errors", "nvlink_crc_errors", "nvlink_replay_errors", "nvlink_recovery_errors",
            "recovery_action")


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class _GpuLost(Exception):
    pass


class PynvmlBackend:
    """NVML through nvidia-ml-py. Satisfies ``collectors.nvml_backend.NvmlBackend``."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._static: list[dict[str, Any]] = []
        self._unsupported: list[set[str]] = []
        self._lost: set[int] = set()
        self._events: list[NvmlEvent] = []
        self._event_set: Any = None
        self._nvlinks: list[list[int] | None] = []

    # ------------------------------------------------------------------ lifecycle
    def open(self) -> None:
        try:
            import pynvml
        except ImportError as exc:
            raise NoData(f"nvidia-ml-py is not installed ({exc}); pip install nvidia-ml-py") from None
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound:
            raise NoData("no NVIDIA driver library (libnvidia-ml.so not found): no GPU on this host") from None
        except pynvml.NVMLError_DriverNotLoaded:
            raise NoData("the NVIDIA driver is not loaded: no GPU usable on this host") from None
        except pynvml.NVMLError as exc:
            raise SourceError(f"nvmlInit failed: {exc}") from None
        try:
            n = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            pynvml.nvmlShutdown()
            raise SourceError(f"nvmlDeviceGetCount failed: {exc}") from None
        if n == 0:
            pynvml.nvmlShutdown()
            raise NoData("NVML found no GPU on this host")
        self._handles, self._static, self._unsupported, self._nvlinks = [], [], [], []
        for i in range(n):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            self._handles.append(h)
            self._unsupported.append(set())
            self._nvlinks.append(None)
            static: dict[str, Any] = {"uuid": "", "pci_bus": ""}
            try:
                static["uuid"] = _text(pynvml.nvmlDeviceGetUUID(h))
                static["pci_bus"] = _text(pynvml.nvmlDeviceGetPciInfo(h).busId)
            except pynvml.NVMLError_GpuIsLost:
                self._mark_lost(i)
            except pynvml.NVMLError:
                pass
            self._static.append(static)
        self._open_events()

    def _open_events(self) -> None:
        p = self._nvml
        try:
            self._event_set = p.nvmlEventSetCreate()
        except p.NVMLError as exc:
            log.info("NVML events not available (%s): Xid events come from the kernel log only", exc)
            self._event_set = None
            return
        wanted = p.nvmlEventTypeXidCriticalError | p.nvmlEventTypeDoubleBitEccError | p.nvmlEventTypeSingleBitEccError
        for i, h in enumerate(self._handles):
            try:
                supported = p.nvmlDeviceGetSupportedEventTypes(h)
                mask = wanted & supported
                if mask:
                    p.nvmlDeviceRegisterEvents(h, mask, self._event_set)
            except p.NVMLError as exc:
                log.info("GPU %d: NVML events not registered (%s)", i, exc)

    def device_count(self) -> int:
        return len(self._handles)

    def describe(self) -> dict[str, str]:
        """Driver, NVML and per-GPU identity, and which events are registered (``agent --check``)."""
        p = self._nvml
        if p is None:
            return {}
        out: dict[str, str] = {}
        for key, fn in (("driver", "nvmlSystemGetDriverVersion"), ("nvml", "nvmlSystemGetNVMLVersion"),
                        ("cuda driver", "nvmlSystemGetCudaDriverVersion_v2")):
            try:
                out[key] = _text(getattr(p, fn)())
            except (AttributeError, p.NVMLError):
                out[key] = "?"
        names = {"xid": p.nvmlEventTypeXidCriticalError, "ecc_dbe": p.nvmlEventTypeDoubleBitEccError,
                 "ecc_sbe": p.nvmlEventTypeSingleBitEccError}
        for i, h in enumerate(self._handles):
            try:
                name = _text(p.nvmlDeviceGetName(h))
            except p.NVMLError:
                name = "?"
            try:
                supported = int(p.nvmlDeviceGetSupportedEventTypes(h))
                events = ", ".join(k for k, bit in names.items() if supported & bit) or "none"
            except p.NVMLError as exc:
                events = f"not available ({exc})"
            if self._event_set is None:
                events = "no event set"
            out[f"GPU {i}"] = f"{name}; NVML events waited on: {events}"
        return out

    def close(self) -> None:
        if self._nvml is None:
            return
        p = self._nvml
        try:
            if self._event_set is not None:
                p.nvmlEventSetFree(self._event_set)
        except p.NVMLError:
            pass
        try:
            p.nvmlShutdown()
        except p.NVMLError:
            pass
        self._event_set = None
        self._nvml = None

    # ------------------------------------------------------------------ reading
    def _mark_lost(self, i: int) -> None:
        if i not in self._lost:
            self._lost.add(i)
            bus = self._static[i]["pci_bus"] if i < len(self._static) else ""
            self._events.append(NvmlEvent(time.time(), i, "gpu_lost", None, bus, "NVML_ERROR_GPU_IS_LOST"))

    def _call(self, i: int, name: str, fn: Any, *args: Any) -> Any:
        """One NVML call; None when unsupported (remembered); _GpuLost when the GPU is gone."""
        if name in self._unsupported[i]:
            return None
        p = self._nvml
        try:
            return fn(*args)
        except p.NVMLError_GpuIsLost:
            raise _GpuLost from None
        except (p.NVMLError_NotSupported, p.NVMLError_FunctionNotFound, p.NVMLError_InvalidArgument):
            self._unsupported[i].add(name)
            return None
        except p.NVMLError as exc:  # transient (e.g. Unknown, InsufficientSize): try again next time
            log.debug("GPU %d %s: %s", i, name, exc)
            return None

    def read(self) -> list[GpuState]:
        if self._nvml is None:
            raise NoData("NVML is not open")
        out = []
        for i, h in enumerate(self._handles):
            if i in self._lost:
                out.append(GpuState(index=i, uuid=self._static[i]["uuid"], pci_bus=self._static[i]["pci_bus"], lost=True))
                continue
            try:
                out.append(self._read_gpu(i, h))
            except _GpuLost:
                self._mark_lost(i)
                out.append(GpuState(index=i, uuid=self._static[i]["uuid"], pci_bus=self._static[i]["pci_bus"], lost=True))
        return out

    def _read_gpu(self, i: int, h: Any) -> GpuState:
        p = self._nvml
        c = self._call
        f: dict[str, Any] = dict(self._static[i])
        u = c(i, "util", p.nvmlDeviceGetUtilizationRates, h)
        if u is not None:
            f["util"], f["mem_util"] = float(u.gpu), float(u.memory)
        m = c(i, "memory", p.nvmlDeviceGetMemoryInfo, h)
        if m is not None:
            f["mem_used_mb"] = m.used / (1024 * 1024)
        t = c(i, "temp", p.nvmlDeviceGetTemperature, h, p.NVML_TEMPERATURE_GPU)
        if t is not None:
            f["temp_c"] = float(t)
        pw = c(i, "power", p.nvmlDeviceGetPowerUsage, h)
        if pw is not None:
            f["power_w"] = pw / 1000.0
        sm = c(i, "sm_clock", p.nvmlDeviceGetClockInfo, h, p.NVML_CLOCK_SM)
        if sm is not None:
            f["sm_clock_mhz"] = float(sm)
        mc = c(i, "mem_clock", p.nvmlDeviceGetClockInfo, h, p.NVML_CLOCK_MEM)
        if mc is not None:
            f["mem_clock_mhz"] = float(mc)
        events_fn = getattr(p, "nvmlDeviceGetCurrentClocksEventReasons", None)  # newer name of the same counter
        reasons = c(i, "clocks_event", events_fn, h) if events_fn is not None else None
        if reasons is None:
            reasons = c(i, "throttle", p.nvmlDeviceGetCurrentClocksThrottleReasons, h)
        if reasons is not None:
            f["throttle_reasons"] = int(reasons)
        for field, err, counter in (("ecc_sbe", "NVML_MEMORY_ERROR_TYPE_CORRECTED", "NVML_VOLATILE_ECC"),
                                    ("ecc_dbe", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_VOLATILE_ECC"),
                                    ("ecc_sbe_agg", "NVML_MEMORY_ERROR_TYPE_CORRECTED", "NVML_AGGREGATE_ECC"),
                                    ("ecc_dbe_agg", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_AGGREGATE_ECC")):
            v = c(i, field, p.nvmlDeviceGetTotalEccErrors, h, getattr(p, err), getattr(p, counter))
            if v is not None:
                f[field] = int(v)
        pages = None  # page retirement is pre-Ampere; A100 and later remap rows instead
        for cause in ("NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS", "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR"):
            got = c(i, f"retired.{cause}", p.nvmlDeviceGetRetiredPages, h, getattr(p, cause))
            if got is not None:
                pages = (pages or 0) + len(got)
        f["retired_pages"] = pages
        rr = c(i, "remapped_rows", p.nvmlDeviceGetRemappedRows, h)
        if rr is not None:
            corr, unc, pending, failure = rr
            f.update(remapped_rows_corr=int(corr), remapped_rows_unc=int(unc), remap_pending=bool(pending),
                     remap_failure=bool(failure))
        rp = c(i, "pcie_replay", p.nvmlDeviceGetPcieReplayCounter, h)
        if rp is not None:
            f["pcie_replay"] = int(rp)
        self._read_nvlink(i, h, f)
        if hasattr(p, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"):
            vals = c(i, "recovery_action", p.nvmlDeviceGetFieldValues, h, [p.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])
            if vals is not None and len(vals) and vals[0].nvmlReturn == p.NVML_SUCCESS:
                f["recovery_action"] = int(vals[0].value.uiVal)
            elif vals is not None:
                self._unsupported[i].add("recovery_action")
        for name in COUNTERS:
            f.setdefault(name, None)
        return GpuState(index=i, **f)

    def _read_nvlink(self, i: int, h: Any, f: dict[str, Any]) -> None:
        p = self._nvml
        links = self._nvlinks[i]
        if links is None:  # which links exist is found once
            links = []
            for link in range(getattr(p, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    p.nvmlDeviceGetNvLinkState(h, link)
                    links.append(link)
                except p.NVMLError_GpuIsLost:
                    raise _GpuLost from None
                except p.NVMLError:
                    continue
            self._nvlinks[i] = links
        totals = {"nvlink_replay_errors": 0, "nvlink_recovery_errors": 0, "nvlink_crc_errors": 0}
        any_read = False
        for link in links:
            for field, const in _NVLINK_COUNTERS:
                v = self._call(i, f"nvlink.{link}.{const}", p.nvmlDeviceGetNvLinkErrorCounter, h, link, getattr(p, const))
                if v is not None:
                    totals[field] += int(v)
                    any_read = True
        if any_read:
            f.update(totals)
            f["nvlink_errors"] = sum(totals.values())

    def wait_events(self, timeout_s: float) -> list[NvmlEvent]:
        out, self._events = self._events, []
        if out or self._event_set is None or self._nvml is None:
            if not out and timeout_s > 0:
                time.sleep(min(timeout_s, 1.0))
            return out
        p = self._nvml
        deadline = time.monotonic() + timeout_s
        wait_ms = max(0, int(timeout_s * 1000))
        while True:
            try:
                data = p.nvmlEventSetWait_v2(self._event_set, wait_ms)
            except p.NVMLError_Timeout:
                break
            except p.NVMLError_GpuIsLost:
                for i in range(len(self._handles)):
                    if self._probe_lost(i):
                        self._mark_lost(i)
                out.extend(self._events)
                self._events = []
                break
            except p.NVMLError as exc:
                log.debug("nvmlEventSetWait: %s", exc)
                break
            out.append(self._event(data))
            wait_ms = 0  # drain what else is waiting, without waiting again
            if time.monotonic() > deadline + 1:
                break
        return out

    def _probe_lost(self, i: int) -> bool:
        p = self._nvml
        try:
            p.nvmlDeviceGetUUID(self._handles[i])
            return False
        except p.NVMLError_GpuIsLost:
            return True
        except p.NVMLError:
            return False

    def _event(self, data: Any) -> NvmlEvent:
        p = self._nvml
        gpu = next((i for i, h in enumerate(self._handles) if _same_handle(h, data.device)), -1)
        bus = self._static[gpu]["pci_bus"] if gpu >= 0 else ""
        et = int(data.eventType)
        if et & p.nvmlEventTypeXidCriticalError:
            return NvmlEvent(time.time(), gpu, "xid", int(data.eventData), bus, "NVML Xid critical error event")
        if et & p.nvmlEventTypeDoubleBitEccError:
            return NvmlEvent(time.time(), gpu, "ecc_dbe", None, bus, "NVML double-bit ECC error event")
        if et & p.nvmlEventTypeSingleBitEccError:
            return NvmlEvent(time.time(), gpu, "ecc_sbe", None, bus, "NVML single-bit ECC error event")
        return NvmlEvent(time.time(), gpu, "other", None, bus, f"NVML event type {et:#x}")


def _same_handle(a: Any, b: Any) -> bool:
    """NVML device handles are ctypes pointers: equal when they point at the same device."""
    from ctypes import c_void_p, cast

    try:
        return cast(a, c_void_p).value == cast(b, c_void_p).value
    except (TypeError, ValueError):  # plain objects (a fake pynvml)
        return a is b or a == b


class NvmlSource:
    """The agent's ``nvml`` source: a sample of every GPU each ``agent.nvml_interval_s``,
    plus NVML's own events (Xid, lost GPU) from a thread that blocks on them.

    Options: ``backend`` (an ``NvmlBackend``; default the real ``PynvmlBackend``).
    """

    name = "nvml"

    def __init__(self, agent: Any, options: dict[str, Any]):
        self.agent = agent
        self.backend = options.get("backend")
        self.interval_s = agent.config.agent.nvml_interval_s
        self._open: Any = None
        self._next_sample = 0.0
        self._sample_now = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, positions: dict[str, Any]) -> None:
        backend = self.backend if self.backend is not None else PynvmlBackend()
        try:
            backend.open()
        except NoData as exc:
            self.agent.say_once("nvml.nodata", logging.WARNING, "nvml: no data on this host: %s; the other sources go on", exc)
            self.agent.set_state("nvml", "no_data", str(exc))
            return
        except FaultlensError as exc:
            self.agent.set_state("nvml", "error", str(exc))
            return
        self._open = backend
        self.agent.set_state("nvml", "ok", f"{backend.device_count()} GPUs")
        self._thread = threading.Thread(target=self._events_loop, name="faultlens-nvml-events", daemon=True)
        self._thread.start()

    def poll(self, now: float) -> None:
        if self._open is not None and (now >= self._next_sample or self._sample_now.is_set()):
            self._sample_now.clear()
            self._next_sample = now + self.interval_s
            self._sample()

    def _sample(self) -> None:

        agent = self.agent
        try:
            gpus = self._open.read()
        except NoData as exc:
            agent.set_state("nvml", "no_data", str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a backend bug must not stop the other sources
            agent.set_state("nvml", "error", f"{type(exc).__name__}: {exc}")
            return
        agent.emit_many([GpuSample(agent.clock(), agent.node, gpus, agent.job)])
        lost = [g.index for g in gpus if g.lost]
        agent.set_state("nvml", "ok", f"{len(gpus)} GPUs" + (f", lost: {lost}" if lost else ""))
        agent.success("nvml", records=1)
        if not agent.gpu_map:

            agent.gpu_map.update({normalize_pci(g.pci_bus): g.index for g in gpus if g.pci_bus})

    def _events_loop(self) -> None:
        backend = self._open
        while not self.agent.stop_event.is_set():
            try:
                events = backend.wait_events(1.0)
            except Exception as exc:  # noqa: BLE001 - an event failure must not kill sampling
                self.agent.say_once("nvml.events", logging.WARNING, "nvml events stopped: %s", exc)
                return
            for ev in events:
                self.on_event(ev)

    def on_event(self, ev: NvmlEvent) -> None:
        """An NVML event becomes a kernel record (as the driver's own line would) and a prompt sample."""

        pci = normalize_pci(ev.pci_bus) if ev.pci_bus else None
        if ev.kind == "xid":
            text = f"NVML event: Xid {ev.xid} on GPU {ev.gpu} (PCI:{ev.pci_bus}). {ev.detail}".strip()
            self.agent.emit_many([KernelEvent(ev.ts, self.agent.node, "xid", text, text, ev.xid, pci, ev.gpu,
                                              fields={"via": "nvml_event"})])
        elif ev.kind == "gpu_lost":
            text = f"NVML event: GPU {ev.gpu} (PCI:{ev.pci_bus}) has fallen off the bus ({ev.detail or 'GPU is lost'})."
            self.agent.emit_many([KernelEvent(ev.ts, self.agent.node, "fell_off_bus", text, text, None, pci, ev.gpu,
                                              fields={"via": "nvml_event"})])
        self._sample_now.set()  # the counters that go with the event, without waiting a full interval

    def holding(self) -> bool:
        return False

    def positions(self) -> dict[str, Any] | None:
        return None

    def drain(self) -> None:
        if self._thread is not None:  # the agent has set stop: the thread ends within a second
            self._thread.join(timeout=5)

    def close(self) -> None:
        if self._open is not None:
            try:
                self._open.close()
            except Exception:  # noqa: BLE001
                pass


register_source("nvml", NvmlSource)
