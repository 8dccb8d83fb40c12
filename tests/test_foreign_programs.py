"""Issue 36, item 6: quiet on what is not ours.

A real Linux syslog (LogHub's Linux sample, tests/fixtures/kernel/linux_syslog) is mostly
other daemons' lines: sshd's "authentication failure", klogind's "Kerberos authentication
failed", ftpd. ``faultlens explain`` calls them info (rule kernel.foreign); the kernel's own
lines in the same file keep their verdicts, and a foreign program's line never becomes a
finding the engine could act on.
"""

from __future__ import annotations

import re
from pathlib import Path

from faultlens.collectors.kernel import KernelParser
from faultlens.collectors.signatures import classify, is_ordinary, to_finding
from faultlens.diagnosis.explain import explain_lines

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "kernel" / "linux_syslog" / "input.log"
PROGRAM_RE = re.compile(r"^\w{3} +\d+ [\d:]{8} \S+ ([^\s:\[(]+)")


def test_daemon_lines_of_a_real_syslog_are_info() -> None:
    lines = FIXTURE.read_text().splitlines()
    assert len(lines) >= 250
    explained = [e for e in explain_lines(lines) if e.c.rule != "empty"]
    raised = [e for e in explained if e.c.severity != "info"]
    programs = {m.group(1) for e in raised if (m := PROGRAM_RE.match(e.text))}
    assert programs <= {"kernel"}, programs
    # the file has 100+ daemon lines with an error word (authentication failure, failed, abort) ...
    worded = [ln for ln in lines if re.search(r"(?i)fail|abort|error", ln) and " kernel: " not in ln]
    assert len(worded) >= 100
    # ... and the kernel's own "failed" lines are still raised
    assert len(raised) == 2 and all(" kernel: " in e.text for e in raised)


def test_the_program_field_decides_not_the_words() -> None:
    sshd = "Jun 15 02:04:59 combo sshd(pam_unix)[20882]: authentication failure; logname= uid=0 euid=0 tty=NODEVssh ruser= rhost=220-135-151-1.hinet-ip.hinet.net  user=root"
    journal = "2025-11-21T04:12:01+0000 gpu-a100-017 sshd[40121]: error: kex_exchange_identification: Connection closed by remote host"
    kernel = "Jun 15 02:04:59 combo kernel: blk_update_request: I/O error, dev nvme0n1, sector 1234 op 0x0:(READ) flags 0x0 phys_seg 1 prio class 0"
    recs = list(KernelParser(year=2024).parse([sshd, journal, kernel]))
    assert [r.fields.get("program") for r in recs] == ["sshd(pam_unix)", "sshd", None]
    for r in recs[:2]:
        c = classify(r)
        assert (c.rule, c.severity, c.action) == ("kernel.foreign", "info", "none")
        assert to_finding(r) is None and is_ordinary(r)
    assert classify(recs[2]).severity != "info"  # the kernel's storage error is ours
