"""Explicit machine fault: a kernel, NVML or fabric signal that names a machine (an Xid, ECC, a link down).

Its route decides at once (evict, reset, run diagnostics, notify; policy.toml ``[route.<kind>]``),
after the job-wide hold where a ``[[jobwide]]`` rule watches the kind. It takes every incident
kind no other workflow owns, including the unclassified ones a signature opened.
"""

from __future__ import annotations

from faultlens.diagnosis.workflows.base import BaseWorkflow


class MachineFaultWorkflow(BaseWorkflow):
    name = "machine_fault"
