"""What plugs into the engine besides the policy: detectors (models/) and the log-line classifier.

``Detector`` is the structural interface a models/ detector offers; ``default_detectors``
builds the installed ones; ``load_classify`` finds diagnosis.classify (log-line meaning,
the same verdict explain gives) when it is present.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from faultlens.schema import Finding
from faultlens.stream.topology import Topology


@runtime_checkable
class Detector(Protocol):
    """What a detector (models/) must offer to plug into the engine."""

    name: str

    def set_topology(self, topology: Topology) -> None: ...

    def observe(self, record: Any) -> list[Finding]: ...

    def tick(self, now: float) -> list[Finding]: ...


def default_detectors() -> list[Detector]:
    """The models/ detectors that are installed (fail-slow, peer comparison); empty when none are."""
    out: list[Detector] = []
    try:
        from faultlens.models.failslow import FailSlowDetector

        out.append(FailSlowDetector())
    except ImportError:
        pass
    try:
        from faultlens.models.peer import PeerDetector

        out.append(PeerDetector())
    except ImportError:
        pass
    return out


def new_classify_context() -> Any:
    """One classify context per engine (None when diagnosis.classify is absent)."""
    try:
        from faultlens.diagnosis.classify import ClassifyContext
    except ImportError:
        return None
    return ClassifyContext()


def load_classify() -> Any:
    """diagnosis.classify.to_finding when that module is present (log-line meaning), else None."""
    try:
        from faultlens.diagnosis import classify
    except ImportError:
        return None
    return getattr(classify, "to_finding", None)
