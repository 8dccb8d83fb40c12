"""``faultlens agent --check`` and what the NVML backend sends for a counter the GPU does not answer.

A real H200's answers are in tests/fixtures/device_h200 (test_device_capture.py); here a
driver that answers only two counters (as old or virtualised GPUs do) must give null for
the rest, never GpuState's default 0 (0 W reads as a dead GPU, 0 errors as a clean one).
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from faultlens.collectors.check import check_nvml, render
from faultlens.collectors.nvml import COUNTERS, PynvmlBackend

REPO = Path(__file__).resolve().parent.parent


class _NotSupported(Exception):
    pass


def _driver_answering(util: float, temp: float) -> types.ModuleType:
    """A pynvml whose device answers utilisation and temperature and nothing else."""

    class NVMLError(Exception):
        pass

    class Unsupported(NVMLError):
        pass

    class Lost(NVMLError):
        pass

    class Timeout(NVMLError):
        pass

    m: Any = types.ModuleType("pynvml")
    m.NVMLError, m.NVMLError_NotSupported, m.NVMLError_FunctionNotFound = NVMLError, Unsupported, Unsupported
    m.NVMLError_InvalidArgument, m.NVMLError_GpuIsLost, m.NVMLError_Timeout = Unsupported, Lost, Timeout
    m.NVMLError_LibraryNotFound = m.NVMLError_DriverNotLoaded = type("Absent", (NVMLError,), {})
    m.nvmlInit = m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: 1
    m.nvmlDeviceGetHandleByIndex = lambda i: f"h{i}"
    m.nvmlDeviceGetUUID = lambda h: "GPU-0000"
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=b"00000000:1B:00.0")
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=util, memory=5)
    m.nvmlDeviceGetTemperature = lambda h, sensor: temp
    m.nvmlDeviceGetName = lambda h: "Old GPU"

    def no_events() -> None:
        raise NVMLError("events not supported")

    m.nvmlEventSetCreate = no_events

    def unsupported(*_: Any) -> None:
        raise Unsupported()

    m.__getattr__ = lambda name: 0 if name.startswith(("NVML_", "nvmlEventType")) else unsupported
    return m


def test_a_counter_the_driver_does_not_answer_is_null_not_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _driver_answering(util=73.0, temp=41.0))
    backend = PynvmlBackend()
    backend.open()
    gpu = backend.read()[0]
    assert (gpu.util, gpu.temp_c, gpu.pci_bus) == (73.0, 41.0, "00000000:1B:00.0")
    unanswered = [c for c in COUNTERS if getattr(gpu, c) is None]
    assert "power_w" in unanswered and "ecc_dbe" in unanswered and "retired_pages" in unanswered
    assert "nvlink_errors" in unanswered and "remap_pending" in unanswered
    assert len(unanswered) == len(COUNTERS) - 3  # util, mem_util, temp answered
    backend.close()


def test_check_names_the_counters_sent_as_null(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _driver_answering(util=10.0, temp=30.0))
    finding = check_nvml(reads=2)
    text = render([finding])
    assert finding.ok and "1 GPU(s)" in finding.summary
    assert "3/23 counters" in text and "not answered (sent as null): " in text and "power_w" in text
    assert "NVML events waited on: no event set" in text


def test_agent_check_says_what_this_host_has_and_succeeds() -> None:
    """Without a GPU (CI) it says so and succeeds; on a GPU host it names the GPUs and their counters."""
    proc = subprocess.run([sys.executable, "-m", "faultlens.cli", "agent", "--check", "--kernel-log",
                           str(REPO / "tests" / "fixtures" / "device_h200" / "dmesg-nvrm.txt")],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    nvml = next(line for line in proc.stdout.splitlines() if " nvml " in line)
    assert nvml.startswith("ok ") and ("no GPU here" in nvml or "GPU(s), one read of all" in nvml), proc.stdout
    if "GPU(s)" in nvml:
        assert "/23 counters" in proc.stdout and "driver:" in proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok  kernel" in proc.stdout and "dmesg-nvrm.txt (readable)" in proc.stdout


def test_agent_check_reports_an_unreadable_kernel_log_and_fails(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "faultlens.cli", "agent", "--check", "--no-nvml", "--kernel-log",
                           str(tmp_path / "missing.log")], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "BAD kernel" in proc.stdout and "not readable" in proc.stdout
