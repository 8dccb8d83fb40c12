"""The interface between the nvml source and whatever answers NVML questions.

The real backend (collectors/nvml.py) calls nvidia-ml-py; the simulator's
backend (datasets/) answers from a virtual cluster, so the real agent code runs
against virtual GPUs in tests and in the demo. Both satisfy ``NvmlBackend``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from faultlens.schema import GpuState


@dataclass(frozen=True, slots=True)
class NvmlEvent:
    """A device event from the NVML event set (Xid critical error, DBE, GPU lost...)."""

    ts: float
    gpu: int
    kind: str  # xid | ecc_dbe | ecc_sbe | gpu_lost | recovery_action | other
    xid: int | None = None
    pci_bus: str = ""
    detail: str = ""


@runtime_checkable
class NvmlBackend(Protocol):
    def open(self) -> None:
        """Initialise; raise ``faultlens.errors.NoData`` when there is no driver or no GPU."""

    def device_count(self) -> int: ...

    def read(self) -> list[GpuState]:
        """One state per GPU. A lost GPU is a state with ``lost=True``, never an exception."""

    def wait_events(self, timeout_s: float) -> list[NvmlEvent]:
        """Events since the last call, waiting at most ``timeout_s`` for the first."""

    def close(self) -> None: ...
