"""Python exceptions on the ranks: which ones say the user's code failed, and their fingerprint.

A traceback whose final line names the infrastructure (NCCL, a CUDA ECC error, a broken
connection, a timeout) is never rolled back as user code; any other exception is
normalised (numbers and addresses stripped) so that the same exception on many ranks
groups into one fingerprint (STYLE 12: aggregate by fingerprint, not raw text).
"""

from __future__ import annotations

import re

from faultlens.schema import NcclEvent

# Exceptions that say the infrastructure failed, not the user's code: never rolled back. A CUDA error that
# names the GPU (uncorrectable ECC, "unknown error" (cudaErrorUnknown, 999: what a rank sees when its GPU
# fails under it), devices unavailable) is the machine's; the application's own CUDA errors (an illegal
# memory access / instruction, a misaligned address, an unspecified launch failure, a device-side assert:
# NVIDIA's Xid 13/31/43 are these seen from the driver) are the code's and stay user exceptions.
INFRA_EXCEPTION_RE = re.compile(
    r"NCCL|DistBackendError|ProcessGroup|Watchdog|ncclRemoteError|ncclSystemError|ncclInternalError|"
    r"CUDA error: (?:uncorrectable ECC|ECC|unknown error|all CUDA-capable devices are busy|"
    r"CUDA-capable device\(s\) is/are busy)|uncorrectable ECC|Xid|"
    r"Connection (?:reset|refused|closed)|Broken pipe|BrokenPipeError|TCPStore|SIGKILL|Signals?\.SIGKILL|"
    r"ChildFailedError|timed out|timeout|"
    # torchrun's elastic agent stopped by its scheduler: the launcher's signal, not the training code
    r"SignalException|got signal:? ?\d+", re.IGNORECASE)
EXCEPTION_LINE_RE = re.compile(r"^\s*(?:\[rank\d+\]:\s*)?(?P<exc>[A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\b:?.*)$")
_NUM_RE = re.compile(r"0x[0-9a-fA-F]+|\d+")
_TRACEBACK_KINDS = frozenset({"exception", "traceback", "python_exception"})


def exception_fingerprint(record: NcclEvent) -> str | None:
    """The normalised final exception line of a traceback record, or None."""
    text = record.exception
    if not text:
        if record.kind not in _TRACEBACK_KINDS and "Traceback" not in record.raw:
            return None
        lines = [m["exc"] for m in map(EXCEPTION_LINE_RE.match, record.raw.splitlines()) if m]
        if not lines:
            return None
        text = lines[-1]
    return _NUM_RE.sub("#", text.strip())[:300]


def user_exception(record: NcclEvent) -> str | None:
    """The fingerprint of an exception raised by the user's code (not the infrastructure's), or None."""
    fp = exception_fingerprint(record)
    return fp if fp is not None and not INFRA_EXCEPTION_RE.search(fp) else None
