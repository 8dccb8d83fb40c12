"""What plugs into the engine besides the policy: detectors (models/) and the log-line classifier.

``Detector`` is the structural interface a models/ detector offers; ``default_detectors``
builds the installed ones; ``load_classify`` finds diagnosis.classify (log-line meaning,
the same verdict explain gives) when it is present.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from faultlens.diagnosis import classify
from faultlens.diagnosis.classify import ClassifyContext
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
    # models/ needs numpy, which only the [server] extra installs: without it, no detector
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
    """One classify context per engine."""
    return ClassifyContext()


def load_classify() -> Any:
    """diagnosis.classify.to_finding: a log line's meaning as a finding."""
    return classify.to_finding
