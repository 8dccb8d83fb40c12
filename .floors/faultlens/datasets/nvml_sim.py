"""An NVML backend answered by the simulator, so the real agent runs against virtual GPUs.

``SimulatedNvml(scenario, node, clock)`` satisfies
``faultlens.collectors.nvml_backend.NvmlBackend``: ``read()`` returns the
node's GPUs at the clock's simulated time (a lost GPU is a state with
``lost=True``), ``wait_events`` returns the Xid / ECC / GPU-lost events that
became due since the last call.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from faultlens.collectors.nvml_backend import NvmlBackend, NvmlEvent
from faultlens.datasets.scenario import Scenario
from faultlens.errors import NoData
from faultlens.schema import GpuState


class SimClock:
    """Simulated epoch seconds: ``start_ts`` plus wall time elapsed since creation, times ``speed``."""

    def __init__(self, start_ts: float, speed: float = 1.0):
        self.start_ts, self.speed = start_ts, speed
        self._t0 = time.monotonic()

    def __call__(self) -> float:
        return self.start_ts + (time.monotonic() - self._t0) * self.speed


class SimulatedNvml:
    def __init__(self, scenario: Scenario, node: str, clock: Callable[[], float] | None = None):
        self.scenario = scenario
        self.node = node
        self.clock = clock or SimClock(scenario.start_ts)
        self._events: list[NvmlEvent] = []
        self._next_event = 0
        self._open = False

    def open(self) -> None:
        if self.node not in self.scenario.cluster.node_names:
            raise NoData(f"node {self.node} is not part of scenario {self.scenario.spec.name}")
        self._events = self.scenario.nvml_events(self.node)
        self._next_event = 0
        self._open = True

    def device_count(self) -> int:
        return self.scenario.cluster.gpus_per_node

    def read(self) -> list[GpuState]:
        if not self._open:
            raise NoData("SimulatedNvml.read() before open()")
        return self.scenario.gpu_states(self.node, self.clock())

    def wait_events(self, timeout_s: float) -> list[NvmlEvent]:
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            now = self.clock()
            due = []
            while self._next_event < len(self._events) and self._events[self._next_event].ts <= now:
                due.append(self._events[self._next_event])
                self._next_event += 1
            if due or time.monotonic() >= deadline:
                return due
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def close(self) -> None:
        self._open = False


def _check_protocol(backend: SimulatedNvml) -> NvmlBackend:
    return backend  # the type checker confirms SimulatedNvml satisfies NvmlBackend
