"""Kernel log text in the three forms a node may hand us, plus ordinary background noise.

* ``dmesg``: ``[ 1843.308145] NVRM: ...`` (seconds since boot); continuation lines
  of a multi-line record are indented to the width of the prefix;
* ``iso``: ``dmesg --time-format iso``: ``2025-11-21T10:00:00,123456+00:00 NVRM: ...``;
* ``syslog``: ``Nov 21 10:00:00 n001 kernel: NVRM: ...``, one prefix per line.

A record is ``(ts, [line, continuation...])``. Message texts copy what the
drivers print (see ../shared/reference/real-logs/kernel.jsonl).
"""

from __future__ import annotations

import datetime as dt

import numpy as np

FORMATS = ("dmesg", "iso", "syslog")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


class KernelFormatter:
    """Renders one node's records in its format."""

    def __init__(self, fmt: str, node: str, boot_ts: float):
        if fmt not in FORMATS:
            raise ValueError(f"kernel log format {fmt!r} not in {FORMATS}")
        self.fmt, self.node, self.boot_ts = fmt, node, boot_ts

    def prefix(self, ts: float) -> str:
        if self.fmt == "dmesg":
            return f"[{ts - self.boot_ts:12.6f}] "
        t = dt.datetime.fromtimestamp(ts, dt.UTC)
        if self.fmt == "iso":
            return t.strftime("%Y-%m-%dT%H:%M:%S,") + f"{t.microsecond:06d}+00:00 "
        return f"{_MONTHS[t.month - 1]} {t.day:2d} {t:%H:%M:%S} {self.node} kernel: "

    def render(self, ts: float, lines: list[str]) -> str:
        """The record's text (lines joined by newlines, no trailing newline)."""
        p = self.prefix(ts)
        if self.fmt == "syslog":
            return "\n".join(p + line for line in lines)
        pad = " " * len(p)
        return "\n".join([p + lines[0]] + [pad + line for line in lines[1:]])


# ----------------------------------------------------------------------------- background noise

def boot_lines(driver: str, pci_buses: list[str]) -> list[list[str]]:
    """Lines a node printed while its GPU driver came up (benign)."""
    out = [[f"NVRM: loading NVIDIA UNIX x86_64 Kernel Module  {driver}  Thu Jun 20 19:53:01 UTC 2024"],
           ["nvidia-nvlink: Nvlink Core is being initialized, major device number 236"],
           ["nvidia-uvm: Loaded the UVM driver, major device number 508."]]
    out += [[f"mlx5_core {bus}: firmware version: 28.39.1002"] for bus in pci_buses]
    return out


def noise_records(rng: np.random.Generator, start_ts: float, duration_s: float, per_hour: float = 12.0
                  ) -> list[tuple[float, list[str]]]:
    """Ordinary lines a busy training node prints that are NOT faults."""
    n = int(rng.poisson(per_hour * duration_s / 3600.0))
    out = []
    for ts in np.sort(rng.uniform(start_ts, start_ts + duration_s, n)):
        k = int(rng.integers(0, 6))
        veth = f"veth{int(rng.integers(0x100000, 0xffffff)):06x}"
        if k == 0:
            rate = int(rng.integers(40000, 90000))
            msg = f"perf: interrupt took too long ({2500 + int(rng.integers(1, 900))} > 2500), lowering kernel.perf_event_max_sample_rate to {rate}"
        elif k == 1:
            msg = f"docker0: port {int(rng.integers(1, 9))}({veth}) entered forwarding state"
        elif k == 2:
            msg = f"loop{int(rng.integers(0, 12))}: detected capacity change from 0 to {int(rng.integers(8, 300000))}"
        elif k == 3:
            msg = f"workqueue: ib_cache_event_task [ib_core] hogged CPU for >10000us {int(rng.integers(4, 64))} times, consider switching to WQ_UNBOUND"
        elif k == 4:
            msg = f"IPv6: ADDRCONF(NETDEV_CHANGE): {veth}: link becomes ready"
        else:
            msg = f"EXT4-fs (nvme0n1p{int(rng.integers(1, 4))}): mounted filesystem with ordered data mode. Quota mode: none."
        out.append((float(ts), [msg]))
    return out


# ----------------------------------------------------------------------------- fault records

def xid(pci: str, code: int, text: str, pid: int | None = None, name: str = "pt_main_thread") -> str:
    who = f"pid={pid}, name={name}" if pid is not None else "pid='<unknown>', name=<unknown>"
    return f"NVRM: Xid (PCI:{pci}): {code}, {who}, {text}"


def gpu_header(pci: str, uuid: str, serial: str) -> list[list[str]]:
    """The two lines NVRM prints before the first Xid of a GPU since boot."""
    return [[f"NVRM: GPU at PCI:{pci}: {uuid}"], [f"NVRM: GPU Board Serial Number: {serial}"]]


def fell_off_bus(pci_full: str, device_id: str) -> list[str]:
    """The multi-line record of a GPU that stopped answering on PCIe."""
    return [f"NVRM: The NVIDIA GPU {pci_full}",
            f"NVRM: (PCI ID: {device_id}) installed in this system has",
            "NVRM: fallen off the bus and is not responding to commands."]


def ib_link(nic_pci: str, nic: str, state: str) -> str:
    return f"mlx5_core {nic_pci} {nic}: Port: 1 Link {state}"


def aer_corrected(root_port: str, dev: str, device_id: str, kind: str = "BadDLLP") -> list[list[str]]:
    bit = {"BadTLP": (6, "00000040"), "BadDLLP": (7, "00000080"), "Rollover": (8, "00000100"),
           "Timeout": (12, "00001000")}[kind]
    # each printk line of an AER report carries its own timestamp
    return [[f"pcieport {root_port}: AER: Corrected error received: {dev}"],
            [f"nvidia {dev}: PCIe Bus Error: severity=Corrected, type=Data Link Layer, (Receiver ID)"],
            [f"nvidia {dev}:   device [{device_id}] error status/mask={bit[1]}/00002000"],
            [f"nvidia {dev}:    [{bit[0]:2d}] {kind}"]]


def oom_kill(pid: int, comm: str, rss_kb: int, memcg: str) -> list[list[str]]:
    total_vm = rss_kb + 48_000_000
    return [[f"{comm} invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE|__GFP_COMP), order=0, oom_score_adj=0"],
            [f"oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0-1,global_oom,task_memcg={memcg},task={comm},pid={pid},uid=0"],
            [f"Out of memory: Killed process {pid} ({comm}) total-vm:{total_vm}kB, anon-rss:{rss_kb}kB, file-rss:1184kB, shmem-rss:0kB, UID:0 pgtables:{rss_kb // 480}kB oom_score_adj:0"]]


def hung_task(comm: str, pid: int, ppid: int, seconds: int, kernel_release: str) -> list[str]:
    """The khungtaskd report; every line is its own printk record (its own timestamp)."""
    return [f"INFO: task {comm}:{pid} blocked for more than {seconds} seconds.",
            f"      Tainted: P           OE      {kernel_release}",
            '"echo 0 > /proc/sys/kernel/hung_task_timeout_secs" disables this message.',
            f"task:{comm:<15} state:D stack:0     pid:{pid:<6} ppid:{ppid:<6} flags:0x00004002",
            "Call Trace:",
            " <TASK>",
            " __schedule+0x2e6/0x700",
            " schedule+0x69/0x110",
            " io_schedule+0x46/0x80",
            " folio_wait_bit_common+0x145/0x370",
            " filemap_read+0x2ed/0x350",
            " nfs_file_read+0x79/0xc0 [nfs]",
            " vfs_read+0x1a7/0x340",
            " ksys_read+0x67/0xf0",
            " do_syscall_64+0x59/0x90",
            " entry_SYSCALL_64_after_hwframe+0x6e/0xd8",
            " </TASK>"]


def nfs_not_responding(server: str) -> str:
    return f"nfs: server {server} not responding, still trying"


def nfs_ok(server: str) -> str:
    return f"nfs: server {server} OK"
