"""``faultlens agent --check``: what this node's agent would see, before it runs for real.

An operator rolling the agent onto a new GPU type, driver or container image wants to
know, in one screen, which NVML counters this GPU answers (an unsupported one is
sent as null, never as 0), whether NVML's own Xid/ECC events can be waited on, and
which kernel log the agent would follow: the gaps that otherwise show up weeks later
as a fault nobody saw. The probes are the agent's own code paths (PynvmlBackend,
KmsgReader, JournalReader), not a second implementation. No broker is needed.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

from faultlens.collectors.kernel_follow import KERNEL_FILES, JournalReader, KmsgReader
from faultlens.collectors.nvml import COUNTERS, PynvmlBackend
from faultlens.errors import FaultlensError, NoData


@dataclass
class Finding:
    """One probe's result: ``ok`` False only for a source that is there but broken."""

    source: str
    ok: bool
    summary: str
    details: list[str] = field(default_factory=list)


def check_nvml(backend: Any = None, reads: int = 3) -> Finding:
    """Open NVML as the agent does, read every GPU ``reads`` times and say which counters answered."""
    b = backend if backend is not None else PynvmlBackend()
    try:
        b.open()
    except NoData as exc:
        return Finding("nvml", True, f"no GPU here: {exc} (the agent runs its other sources)")
    except FaultlensError as exc:
        return Finding("nvml", False, f"NVML is broken: {exc}")
    try:
        t0 = time.perf_counter()
        states: list[Any] = []
        for _ in range(max(1, reads)):
            states = b.read()
        per_read_ms = (time.perf_counter() - t0) * 1000 / max(1, reads)
        events = b.wait_events(0.0)
        details = []
        for g in states:
            answered = [c for c in COUNTERS if getattr(g, c) is not None]
            missing = [c for c in COUNTERS if getattr(g, c) is None]
            state = "LOST" if g.lost else f"{len(answered)}/{len(COUNTERS)} counters"
            details.append(f"GPU {g.index} {g.pci_bus or '?'} {g.uuid or '?'}: {state}; "
                           f"util {g.util} %, power {g.power_w} W, temp {g.temp_c} C, "
                           f"ecc sbe/dbe {g.ecc_sbe}/{g.ecc_dbe}, remapped rows {g.remapped_rows_corr}/"
                           f"{g.remapped_rows_unc}, nvlink errors {g.nvlink_errors}")
            if missing:
                details.append(f"  not answered (sent as null): {', '.join(missing)}")
        info: dict[str, str] = getattr(b, "describe", dict)()
        for k, v in info.items():
            details.append(f"{k}: {v}")
        details.extend(f"pending NVML event: {e.kind} on GPU {e.gpu} ({e.detail})" for e in events)
        lost = sum(1 for g in states if g.lost)
        summary = f"{len(states)} GPU(s), one read of all {per_read_ms:.1f} ms" + (f", {lost} LOST" if lost else "")
        return Finding("nvml", lost == 0, summary, details)
    finally:
        b.close()


def check_kernel_log(kernel_follow: str = "auto") -> Finding:
    """Which kernel log the agent would follow, opened as the agent opens it."""

    tried = []
    if kernel_follow in ("auto", "kmsg"):
        try:
            reader = KmsgReader("/dev/kmsg", from_end=True)
            writable = os.access("/dev/kmsg", os.W_OK)
            reader.close()
            return Finding("kernel", True, "/dev/kmsg (event-driven; Xid lines read as they are logged)",
                           [f"/dev/kmsg writable by this user: {writable}"])
        except NoData as exc:
            tried.append(str(exc))
    if kernel_follow in ("auto", "journal"):
        try:
            journal = JournalReader()
            journal.close()
            return Finding("kernel", True, "journalctl -k -f", tried)
        except NoData as exc:
            tried.append(str(exc))
    if kernel_follow not in ("auto", "kmsg", "journal"):
        ok = os.access(kernel_follow, os.R_OK)
        return Finding("kernel", ok, f"{kernel_follow} ({'readable' if ok else 'not readable'})", tried)
    path = next((p for p in KERNEL_FILES if os.access(p, os.R_OK)), None)
    if path is not None and kernel_follow == "auto":
        return Finding("kernel", True, f"{path} (file)", tried)
    return Finding("kernel", False, "no readable kernel log: Xid lines will not be seen", tried)


def check_tools() -> Finding:
    """py-spy answers dump_stacks commands; inotify makes file following event-driven."""
    details = [f"py-spy: {shutil.which('py-spy') or 'not found (dump_stacks commands will fail)'}"]
    try:
        import inotify_simple  # noqa: F401

        details.append("inotify: yes (log files are read when written)")
    except ImportError:
        details.append("inotify: no (log files are polled every agent.tick_s)")
    return Finding("tools", True, "; ".join(d.split(" (")[0] for d in details), details)


def check_node(kernel_follow: str = "auto", *, nvml: bool = True) -> list[Finding]:
    """Every probe, in the order an operator reads them."""
    out = [check_nvml()] if nvml else [Finding("nvml", True, "skipped (--no-nvml)")]
    out.append(check_kernel_log(kernel_follow))
    out.append(check_tools())
    return out


def render(findings: list[Finding]) -> str:
    lines = []
    for f in findings:
        lines.append(f"{'ok ' if f.ok else 'BAD'} {f.source:<7} {f.summary}")
        lines.extend(f"            {d}" for d in f.details)
    return "\n".join(lines)
