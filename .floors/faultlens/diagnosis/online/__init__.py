"""The online diagnosis service (bus in, bus out) and what only it needs.

* ``service.py``: ``DiagnosisService``, the repartition and diagnosis stages in one thread;
* ``repartition.py``: node-keyed telemetry re-keyed by job onto ``diag-repartition``;
* ``state.py``: one engine per job, checkpointed to ``diag-changelog`` and restored on assignment.
"""

from faultlens.diagnosis.online.service import DiagnosisService

__all__ = ["DiagnosisService"]
