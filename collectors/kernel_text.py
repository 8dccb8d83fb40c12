"""The text of kernel log lines: prefix grammars (dmesg, -T, iso, kmsg, syslog, journald,
RFC 5424, <PRI>, rsyslog repeats), PCI ids, dump continuation lines, timestamps.

Split from collectors/kernel.py (the stateful parser) so that each stays under the
project's module size; KernelParser is the only user besides the tests.
"""

from __future__ import annotations

import calendar
import datetime as dt
import re
import time
from collections.abc import Mapping

LAUNCHER_RE = re.compile(r"^(?:\[\d+\]\s+)?\[(?:default|rank|Rank )(\d+)\]:\s?")
KMSG_RE = re.compile(r"^(\d+),(\d+),(\d+),[^;]*;(.*)$")
DECODE_RE = re.compile(r"^([a-z]+)\s*:([a-z]+)\s*: (.*)$")
ISO_RE = re.compile(r"^(\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d)(?:[,.](\d+))?(Z|[+-]\d\d:?\d\d)?\s(.*)$")
BRACKET_RE = re.compile(r"^\[\s*([+-]?)(\d+\.\d+)\]\s?(.*)$")
CTIME_RE = re.compile(r"^\[([A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4})\]\s?(.*)$")
SYSLOG_RE = re.compile(r"^(\S+)\s+(\d{1,2}) (\d\d):(\d\d):(\d\d)(?:\.\d+)?\s+(?:(\S+)\s+)?(?:[a-z0-9]+\.[a-z]+\s+)?kernel(?:\[\d+\])?:\s?(.*)$")
# RFC 5424 (rsyslog/syslog-ng forwarding): <PRI>1 TIMESTAMP HOST APP PROCID MSGID [SD|-] MSG
RFC5424_RE = re.compile(r"^<(\d{1,3})>1 (\S+) (\S+) (\S+) \S+ \S+ (?:-|\[.*?\])\s?(.*)$")
PRI_RE = re.compile(r"^<(\d{1,3})>\s?")
YEAR_SYSLOG_RE = re.compile(r"^(\d{4}) (?=[A-Z][a-z]{2}\s+\d{1,2} \d\d:\d\d:\d\d)")
REPEATED_RE = re.compile(r"^(?:last )?message repeated (\d+) times?:? \[\s?(.*?)\s?\]\s*$")
PCI_ID_RE = re.compile(r"^[0-9A-Fa-f]{1,8}:[0-9A-Fa-f]{1,2}(?::[0-9A-Fa-f]{1,2})?(?:\.[0-7])?$")
SYSLOG_ANY_RE = re.compile(r"^(\S+)\s+(\d{1,2}) (\d\d):(\d\d):(\d\d)(?:\.\d+)?\s+(\S+)\s+(\S+?)(?:\[\d+\])?:\s?(.*)$")
HOST_KERNEL_RE = re.compile(r"^(?:(\S+)\s+)?kernel(?:\[\d+\])?:\s?(.*)$")
# journalctl -o short-iso of another program: "host prog[pid]: msg" (the [pid] tells it from a kernel driver's "x y: msg")
HOST_PROGRAM_PID_RE = re.compile(r"^(\S+)\s+([A-Za-z][^\s\[\]:]{0,63})\[\d+\]:\s?(.*)$")
PCI_GPU_RE = re.compile(r"(?:GPU at PCI:|The NVIDIA GPU |GPU )(?:PCI:)?([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})")
PCI_ANY_RE = re.compile(r"\b([0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\b")
XID_TAIL_RE = re.compile(r"^,\s*pid=(?P<pid>'?<?[\w]+>?'?)(?:,\s*name=(?P<name>[^,]*))?(?:,\s*(?P<text>.*))?$", re.S)
RECOVERY_RE = re.compile(r"recovery action changed from (0x[0-9a-fA-F]+) \(([^)]*)\) to (0x[0-9a-fA-F]+) \(([^)]*)\)")
SXID_SEV_RE = re.compile(r"\b(Non-fatal|Fatal|Non-Fatal|fatal)\b")
MONTHS = {m.lower(): i for i, m in enumerate(calendar.month_abbr) if m}
# Lines of a kernel dump (hung task, lockup, oops) that are printed without
# indentation but belong to the report above them.
DUMP_CONT_RE = re.compile(r"^(?:Call [Tt]race:|<TASK>|</TASK>|<IRQ>|</IRQ>|task:\S+\s+state:|CPU: \d+ (?:PID|UID): |Hardware name: |RIP: |RSP: |RAX: |RDX: |RBP: |R\d+: |FS: |CS: |CR2: |Code: |Modules linked in:|Tainted: |\"echo 0 > /proc/sys/kernel/hung_task_timeout_secs\"|#PF: |PGD |P4D |PUD |PMD |---\[ end (?:trace|Kernel panic)|Kernel Offset: |Workqueue: |pc : |lr : |sp : |x\d+ ?: |Internal error: |Process \S+ \(pid: |IP: \[<)")
# The task-state line of an older kernel's hung-task report, unindented: "nvc:[driver]    D ffff883f2cc43bd8     0
# 5403   5396 0x00000084" (comm, state D, [task address], stack, pid, ppid, flags).
TASK_STATE_RE = re.compile(r"^\S.{0,40}?\s D\s+(?:[0-9a-f]{16}\s+)?\d+\s+\d+\s+\d+\s+0x[0-9a-f]+\s*$")
# The detail lines of a device report (AER): "<driver> <pci id>:" then an indented field.
DEVICE_DETAIL_RE = re.compile(r"^\S+ [0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]: {2,}\S")
# An oops's "Oops: 0000 [#1] SMP" line continues the report its first line began.
OOPS_HEADS = ("BUG: ", "general protection fault", "divide error", "invalid opcode", "Unable to handle kernel")
DUMP_CONT_FIRST = frozenset("CRt<TH\"MF#P-KWplsxI")


def normalize_pci(bus: str | None) -> str | None:
    """``00000000:3B:00.0`` / ``0000:3b:00`` -> ``0000:3b:00`` (domain:bus:device, lower case)."""
    if not bus:
        return None
    parts = bus.lower().split(":")
    if len(parts) < 3:
        return bus.lower()
    dom, b, dev = parts[-3], parts[-2], parts[-1].split(".")[0]
    return f"{dom[-4:].rjust(4, '0')}:{b}:{dev}"


_KMSG_LEVELS = {0: "emerg", 1: "alert", 2: "crit", 3: "err", 4: "warn", 5: "notice", 6: "info", 7: "debug"}
_FACILITIES = {"kern", "user", "mail", "daemon", "auth", "syslog", "lpr", "news", "uucp", "cron", "authpriv", "ftp", "local0",
               "local1", "local2", "local3", "local4", "local5", "local6", "local7"}


def _kind_text(message: str) -> str:
    """What decides a dump's kind: its report, not its stack frames or module list (a hung task
    whose frames are in nvidia_uvm is a hung task, not an NVIDIA driver message)."""
    for cut in ("\nCall Trace:", "\nCall trace:", "\n<TASK>"):
        i = message.find(cut)
        if i > 0:
            message = message[:i]
    if "\nModules linked in:" in message:
        message = "\n".join(ln for ln in message.split("\n") if not ln.startswith("Modules linked in:"))
    return message


def _pci_id(text: str | None, fields: dict) -> str | None:
    """A printed PCI id, normalised; an elided or redacted one (``XXXX:XX:XX``,
    ``<redacted>``) gives None and is kept as ``fields["pci_id"]``."""
    if not text:
        return None
    t = text.strip()
    if PCI_ID_RE.match(t):
        return normalize_pci(t)
    fields["pci_id"] = t[:40]
    return None


def _split_iso(stamp: str) -> tuple[str, str | None, str | None]:
    m = re.match(r"^(\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d)(?:[,.](\d+))?(Z|[+-]\d\d:?\d\d)?$", stamp)
    if not m:
        raise ValueError(stamp)
    return m.group(1), m.group(2), m.group(3)


def _strip_bracket(rest: str) -> str:
    if rest.startswith("["):
        m = BRACKET_RE.match(rest)
        if m:
            return m.group(3)
    return rest


def _iso_ts(base: str, frac: str | None, tz: str | None, default_tz: dt.tzinfo) -> float:
    t = dt.datetime.strptime(base.replace(" ", "T"), "%Y-%m-%dT%H:%M:%S")
    if tz and tz != "Z":
        sign = 1 if tz[0] == "+" else -1
        hh, mm = int(tz[1:3]), int(tz[-2:])
        t = t.replace(tzinfo=dt.timezone(sign * dt.timedelta(hours=hh, minutes=mm)))
    else:
        t = t.replace(tzinfo=dt.UTC if tz == "Z" else default_tz)
    return t.timestamp() + (float("0." + frac) if frac else 0.0)


def parse_journal_entry(entry: Mapping[str, object]) -> str:
    """A ``journalctl -o json`` object -> one syslog-style line the parser reads."""
    msg = entry.get("MESSAGE", "")
    if isinstance(msg, list):  # journald gives non-UTF-8 messages as byte arrays
        msg = bytes(int(b) for b in msg if isinstance(b, int)).decode("utf-8", "replace")
    usec = entry.get("__REALTIME_TIMESTAMP")
    ts = int(str(usec)) / 1e6 if usec else time.time()
    iso = dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S,%f+00:00")
    host = entry.get("_HOSTNAME") or "localhost"
    return f"{iso} {host} kernel: {msg}"
