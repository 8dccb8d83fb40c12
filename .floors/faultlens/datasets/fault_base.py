"""The base of every injected fault: parameters in, effects and ground truth out.

A fault kind is one module ``datasets/fault_<kind>.py`` holding one subclass
of ``Fault`` and one line in ``datasets/faults.py``. ``inject`` declares the
fault's multi-signal footprint on a ``FaultContext`` and returns its ground
truth (the truth.json entry).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from faultlens.datasets.effects import FaultContext


@dataclass
class Fault:
    """Parameters shared by all kinds; ``params`` holds kind-specific ones."""

    KIND: ClassVar[str] = ""
    EXPECTED_ACTION: ClassVar[str] = "none"
    FOOTPRINT: ClassVar[str] = ""  # one line for the README: which signals show it

    id: str = "f1"
    onset_s: float | None = None  # seconds after the scenario start; None: random
    node: str | None = None
    gpu: int | None = None
    params: dict[str, Any] = field(default_factory=dict)

    def inject(self, ctx: FaultContext) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def truth(self, ctx: FaultContext, *, onset_ts: float, end_ts: float | None, gpus: list[tuple[str, int]] = (),  # type: ignore[assignment]
              ranks: list[int] = (), nodes: list[str] | None = None, slowdown: float | None = None,  # type: ignore[assignment]
              expected_action: str | None = None) -> dict[str, Any]:
        nodes = sorted({n for n, _ in gpus}) if nodes is None else sorted(nodes)
        return {
            "id": self.id, "kind": self.KIND, "nodes": nodes,
            "gpus": [{"node": n, "gpu": g} for n, g in gpus],
            "ranks": sorted(int(r) for r in ranks),
            "onset_ts": round(onset_ts, 6), "end_ts": None if end_ts is None else round(end_ts, 6),
            "expected_action": expected_action or self.EXPECTED_ACTION,
            "slowdown": slowdown,
        }


def crash_then_watchdog(ctx: FaultContext, node: str, rank: int, crash_ts: float, exitcode: int,
                        op: str = "ALLREDUCE") -> float:
    """A worker on ``node`` dies at ``crash_ts``; torchrun stops the node's other workers; every
    other rank waits in a collective until its watchdog fires one timeout later. Returns the fire time."""
    ctx.stop_training(crash_ts)
    ctx.kill_node_ranks_after(node, crash_ts, rank, exitcode)
    others = [r for r in range(ctx.topology.world_size) if ctx.topology.node_of(r) != node]
    fire = crash_ts + ctx.timeout_s + 0.06 + float(ctx.rng.uniform(0, 0.5))
    ctx.watchdog(others, fire, op)
    return fire
