"""One signature catalog per family, one verdict everywhere.

* Every catalog file of collectors/catalogs is loaded, and every entry is reachable:
  each rule matches a recorded real line, each Xid code of the catalog is recognised
  from a printed Xid line, and no line of the negative set produces a finding.
* Every recorded line walks the agent's ship filter, ``faultlens explain`` and the
  online/batch engine: one verdict (the engine's finding is explain's classification,
  the agent ships every record the classifier finds something in, and the engine
  signals only on records the agent ships).
* Variant tolerance by family: the same message behind every printed prefix form
  (dmesg, -T, iso, /dev/kmsg, syslog, journald, RFC 5424, <PRI>, launcher ranks,
  "message repeated N times") gets the same catalog entry.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from faultlens import schema
from faultlens.collectors.kernel import KernelParser
from faultlens.collectors.nccl import NcclParser
from faultlens.collectors.signatures import (
    CATALOGS,
    ClassifyContext,
    all_rules,
    catalogs,
    classify,
    is_ordinary,
    to_finding,
)
from faultlens.config import Config
from faultlens.diagnosis.engine import DiagnosisEngine
from faultlens.diagnosis.explain import explain_lines

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _recorded(source: str) -> list[tuple[str, list[str]]]:
    out = []
    for d in sorted((FIXTURES / source).iterdir()):
        if d.is_dir() and d.name != "negative" and (d / "input.log").exists():
            out.append((f"{source}/{d.name}", (d / "input.log").read_text(encoding="utf-8").splitlines()))
    return out


def _parser(source: str) -> KernelParser | NcclParser:
    return KernelParser(year=2024) if source == "kernel" else NcclParser(year=2024)


# --------------------------------------------------------------------------- loaded and reachable


def test_every_catalog_file_is_loaded() -> None:
    cats = catalogs()
    on_disk = {p.name for p in CATALOGS.glob("*.toml")}
    assert on_disk == {Path(f).name for f in cats.files}, "a catalog file nobody loads"
    assert cats.xid and cats.sxid and cats.kernel and cats.nccl
    assert {r.result.family for r in cats.kernel} == {"kernel"}
    assert {r.result.family for r in cats.sxid} == {"sxid"}
    assert {r.result.family for r in cats.nccl} == {"nccl"}
    assert {e.result.family for e in cats.xid.values()} == {"xid"}
    # every entry says where its reason comes from
    assert not [r.id for r in all_rules() if not r.result.reference]
    assert not [c for c, e in cats.xid.items() if not e.result.reference]


def test_every_rule_is_reachable_from_a_recorded_line() -> None:
    hit: set[str] = set()
    for source in ("kernel", "nccl"):
        for _, lines in _recorded(source):
            ctx = ClassifyContext()
            for rec in _parser(source).parse(lines):
                c = classify(rec, ctx)
                if c.rule:
                    hit.add(c.rule)
    for f in sorted((FIXTURES / "nvsmi" / "families").glob("*.txt")):
        hit.update(e.c.rule for e in explain_lines(f.read_text().splitlines()) if e.c.rule)
    missing = sorted(r.id for r in all_rules() if r.id not in hit)
    assert not missing, f"entries without a recorded line: {missing}"


def test_every_xid_code_is_recognised_from_a_printed_line() -> None:
    cats = catalogs()
    lines = [f"[ 10.{i:06d}] NVRM: Xid (PCI:0000:3b:00): {code}, pid=42, name=python, test" for i, code in enumerate(cats.xid)]
    recs = list(KernelParser(year=2024).parse(lines))
    assert [r.xid for r in recs] == list(cats.xid)
    for r in recs:
        c = classify(r)
        assert (c.family, c.xid) == ("xid", r.xid) and c.rule and c.rule.startswith(f"xid.{r.xid}")


def test_negative_lines_produce_no_finding_and_are_not_shipped() -> None:
    lines = (FIXTURES / "kernel" / "negative" / "input.log").read_text().splitlines()
    for rec in KernelParser(year=2024).parse(lines):
        assert to_finding(rec) is None, rec.raw
        if rec.kind == "other":
            assert is_ordinary(rec), rec.raw


# --------------------------------------------------------------------------- one verdict


def _agent_shipped(source: str, lines: list[str]) -> set[str]:
    """What the agent ships: its fast path (feed_many/finish) and ship filter (is_ordinary)."""
    p = _parser(source)
    items = p.feed_many(lines) + p.finish()
    return {it.raw for it in items if not isinstance(it, int) and not is_ordinary(it)}


def _one_verdict(source: str, lines: list[str]) -> int:
    """Walk ``lines`` through explain, the agent's path and the engine; assert one verdict.
    Returns how many records had something to say."""
    explained = list(explain_lines(lines, source, year=2024))
    records = list(_parser(source).parse(lines))
    shipped = _agent_shipped(source, lines)

    engine = DiagnosisEngine(Config(), batch=True)
    seen: list = []
    real = engine._classify

    def spy(rec, ctx):  # the engine's own classify call, context and all
        f = real(rec, ctx)
        seen.append(f)
        return f

    engine._classify = spy
    at = 0
    checked = 0
    for rec in records:
        first = rec.raw.split("\n")[0]
        while explained[at].text != first:
            at += 1
        verdict = explained[at].c
        seen.clear()
        engine.observe(schema.replace(rec))
        finding = seen[0] if seen else to_finding(rec)
        # explain and the engine: the same entry and answer
        if verdict.rule is None or verdict.benign or verdict.category == "none":
            assert finding is None, (rec.raw, verdict.rule, finding and finding.rule)
        else:
            assert finding is not None, (rec.raw, verdict.rule)
            assert (finding.rule, finding.category, finding.severity, finding.action) == \
                (verdict.rule, verdict.category, verdict.severity, verdict.action), rec.raw
            # the agent ships every record the classifier finds something in
            assert rec.raw in shipped, (rec.raw, verdict.rule)
            checked += 1
        # the engine never signals on a record the agent would have dropped
        if engine.matcher.match_record(rec, "j", finding=finding) is not None:
            assert rec.raw in shipped, rec.raw
    return checked


@pytest.mark.parametrize(("source", "name"), [(s, n) for s in ("kernel", "nccl") for n, _ in _recorded(s)])
def test_agent_explain_and_engine_give_one_verdict(source: str, name: str) -> None:
    assert _one_verdict(source, dict(_recorded(source))[name]), name


def test_one_verdict_on_the_conformance_corpus() -> None:
    """The same walk over every kernel and NCCL entry of datasets/conformance (real lines)."""
    from faultlens.datasets import realworld
    from faultlens.diagnosis.explain import detect_format

    entries = [e for e in realworld.load() if e["family"] != "nvsmi" and not e["text"].lstrip().startswith("=")]
    assert len(entries) >= 250
    checked = 0
    for e in entries:
        lines = e["text"].split("\n")
        fmt = detect_format(lines)
        if fmt in ("kernel", "nccl"):
            checked += _one_verdict(fmt, lines)
    assert checked >= 200


def test_hfi1_link_down_is_one_verdict() -> None:
    """Issue 14: dropped by the agent's filter yet alerting in batch; now one verdict."""
    line = "[ 9700.000000] hfi1_0: Link down"
    rec = next(iter(KernelParser(year=2024).parse([line])))
    assert not is_ordinary(rec)
    c = classify(rec)
    assert (c.rule, c.category, c.action) == ("kernel.ib.link_down", "network", "notify")
    assert line in {e.text for e in explain_lines([line], "kernel") if e.c.rule == "kernel.ib.link_down"}


def test_engine_uses_the_same_context_as_explain() -> None:
    """Xid 13 on one GPU from three processes: explain and the engine both say xid.13.recurring."""
    lines = [f"[ {100 + i}.000000] NVRM: Xid (PCI:0000:3b:00): 13, pid={500 + i}, name=python, Graphics Exception" for i in range(3)]
    assert [e.c.rule for e in explain_lines(lines, "kernel", year=2024)][-1] == "xid.13.recurring"
    engine = DiagnosisEngine(Config(), batch=True)
    got: list = []
    real = engine._classify
    engine._classify = lambda rec, ctx: got.append(real(rec, ctx)) or got[-1]
    for rec in KernelParser(year=2024).parse(lines):
        engine.observe(rec)
    assert got[-1].rule == "xid.13.recurring"


# --------------------------------------------------------------------------- context


def test_derived_xids_take_the_root_verdict() -> None:
    lines = [
        "[ 100.0] NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python, GPU has fallen off the bus.",
        "[ 100.1] NVRM: Xid (PCI:0000:3b:00): 43, pid=1, name=python, Ch 00000010",
        "[ 100.2] NVRM: Xid (PCI:0000:3b:00): 45, pid=1, name=python, Ch 00000010",
        "[ 200.0] NVRM: Xid (PCI:0000:5e:00): 45, pid=1, name=python, Ch 00000010, caused by previous Xid 48",
    ]
    ctx = ClassifyContext()
    got = [classify(r, ctx) for r in KernelParser(year=2024).parse(lines)]
    assert got[0].rule == "xid.79"
    for c in got[1:3]:
        assert (c.category, c.action, c.companion) == ("pcie", "none", True) and c.rule.endswith(".after_xid")
        assert "Xid 79" in c.meaning
    # the named root was not seen in this log: nothing else speaks for it, so the line carries its verdict
    assert (got[3].category, got[3].rule, got[3].action) == ("gpu_memory", "xid.45.caused_by", "reset_gpu")
    assert "Xid 48" in got[3].meaning


def test_nvlink5_xids_follow_the_printed_severity() -> None:
    lines = ["NVRM: Xid (PCI:0000:04:00): 145, RLW_REMAP Fatal XC0 i0 Link 00 (0x00000004 0x00000040 0x00000000 0x00000000)",
             "NVRM: Xid (PCI:0000:04:00): 145, RLW_REMAP Nonfatal XC0 i0 Link 00 (0x00000004 0x00000001 0x00000000 0x00000000)"]
    fatal, nonfatal = (classify(r) for r in KernelParser(year=2024).parse(lines))
    assert (fatal.rule, fatal.action, fatal.severity) == ("xid.145.fatal", "evict_node", "critical")
    assert (nonfatal.rule, nonfatal.action, nonfatal.severity) == ("xid.145.nonfatal", "run_diagnostics", "warning")


def test_unknown_xid_says_so_and_is_never_dropped() -> None:
    rec = next(iter(KernelParser(year=2024).parse(["[ 1.0] NVRM: Xid (PCI:0000:3b:00): 4321, pid=1, name=x, new"])))
    c = classify(rec)
    assert c.meaning.startswith("Xid 4321, not in the catalog") and (c.action, c.rule, c.family) == ("notify", "xid.unknown", "xid")
    assert to_finding(rec) is not None and not is_ordinary(rec)
    engine = DiagnosisEngine(Config(), batch=True)
    assert engine.matcher.match_record(rec, "j", finding=to_finding(rec)) is not None


def test_repeats_in_a_window_escalate() -> None:
    line = "[ {t}.0] pcieport 0000:00:01.0: AER: Corrected error received: 0000:01:00.0"
    ctx = ClassifyContext()
    got = [classify(r, ctx) for r in KernelParser(year=2024).parse([line.format(t=100 + i) for i in range(25)])]
    assert got[0].rule == "kernel.pcie_aer.corrected" and got[0].benign
    assert got[-1].rule == "kernel.pcie_aer.corrected.repeated" and got[-1].action == "notify"
    # "message repeated N times" counts N
    rep = KernelParser(year=2024).parse(["Nov 21 10:00:05 h kernel: message repeated 30 times: [ pcieport 0000:00:01.0: AER: Corrected error received: 0000:01:00.0]"])
    rec = next(iter(rep))
    assert rec.fields["repeated"] == 30 and classify(rec, ClassifyContext()).rule == "kernel.pcie_aer.corrected.repeated"


# --------------------------------------------------------------------------- variants


def _variants(msg: str) -> dict[str, list[str]]:
    return {
        "dmesg": [f"[ 5021.114402] {msg}"],
        "dmesg -T": [f"[Fri Aug 30 11:43:09 2024] {msg}"],
        "dmesg iso": [f"2024-08-30T11:43:09,114402+00:00 {msg}"],
        "dmesg --decode": [f"kern  :err   : [ 5021.114402] {msg}"],
        "kmsg": [f"3,1234,5021114402,-;{msg}"],
        "kmsg caller": [f"3,1234,5021114402,-,caller=T123;{msg}"],
        "syslog": [f"Aug 30 11:43:09 gpu-n1 kernel: {msg}"],
        "syslog dmesg stamp": [f"Aug 30 11:43:09 gpu-n1 kernel: [ 5021.114402] {msg}"],
        "journal short-precise": [f"Aug 30 11:43:09.114402 gpu-n1 kernel: {msg}"],
        "journal short-iso": [f"2024-08-30T11:43:09+0000 gpu-n1 kernel: {msg}"],
        "journal short-monotonic": [f"[ 5021.114402] gpu-n1 kernel: {msg}"],
        "rsyslog facility": [f"Aug 30 11:43:09 gpu-n1 kern.err kernel: {msg}"],
        "rfc5424": [f"<3>1 2024-08-30T11:43:09.114402+00:00 gpu-n1 kernel - - - {msg}"],
        "pri": [f"<3>[ 5021.114402] {msg}"],
        "launcher rank": [f"[default3]:[ 5021.114402] {msg}"],
        "message repeated": [f"Aug 30 11:43:14 gpu-n1 kernel: message repeated 2 times: [ {msg}]"],
    }


FAMILY_LINES = {
    "xid.79": "NVRM: Xid (PCI:0000:3b:00): 79, pid=48211, name=python, GPU has fallen off the bus.",
    "xid.79 pid unknown": "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
    "xid.79 no pci prefix": "NVRM: Xid (0000:3b:00): 79, GPU has fallen off the bus.",
    "xid.79 with function": "NVRM: Xid (PCI:0000:3b:00.0): 79, GPU has fallen off the bus.",
    "xid.79 redacted": "NVRM: Xid (PCI:XXXX:XX:XX): 79, pid=1, name=python, GPU has fallen off the bus.",
    "xid.79 legacy": "NVRM: Xid (0003:00): 79, GPU has fallen off the bus.",
    "sxid.fatal": "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 24007, Fatal, Link 32 sourcetrack TCEN0 crumbstore ECC DBE Error (First)",
    "kernel.pcie_aer.fatal": "nvidia 0000:3b:00.0: PCIe Bus Error: severity=Uncorrected (Fatal), type=Transaction Layer, (Receiver ID)",
    "kernel.nvlink.discovery_wedge": "NVRM: knvlinkDiscoverPostRxDetLinks_GH100: Getting peer0's postRxDetLinkMask failed!",
    "kernel.mlx5.port_module_error": "mlx5_core 0000:12:00.0: Port module event: module 0, Cable unplugged",
    "kernel.nvme.gone": "nvme nvme0: controller is down; will reset: CSTS=0xffffffff, PCI_STATUS=0xffff",
    "kernel.netdev_watchdog": "NETDEV WATCHDOG: eth2 (igb): transmit queue 4 timed out",
    "kernel.oops": "BUG: kernel NULL pointer dereference, address: 0000000000000008",
    "kernel.hung_task": "INFO: task python:4242 blocked for more than 120 seconds.",
}


@pytest.mark.parametrize("family", sorted(FAMILY_LINES))
def test_every_printed_form_gives_the_same_entry(family: str) -> None:
    msg = FAMILY_LINES[family]
    want = None
    for form, lines in _variants(msg).items():
        recs = list(KernelParser(year=2024).parse(lines))
        assert len(recs) == 1, (form, recs)
        c = classify(recs[0], ClassifyContext())
        want = want or c.rule
        assert c.rule == want == family.split(" ")[0], (form, c.rule)
        if form == "message repeated":
            assert recs[0].fields.get("repeated") == 2
        if c.family == "xid" and "redacted" not in family and "legacy" not in family:
            assert recs[0].pci_bus == "0000:3b:00", form


def test_multiline_blocks_are_one_event() -> None:
    hung = [
        "Aug 30 11:43:09 gpu-n1 kernel: INFO: task python:4242 blocked for more than 120 seconds.",
        "Aug 30 11:43:09 gpu-n1 kernel:       Tainted: P           OE     5.15.0-91-generic #101-Ubuntu",
        'Aug 30 11:43:09 gpu-n1 kernel: "echo 0 > /proc/sys/kernel/hung_task_timeout_secs" disables this message.',
        "Aug 30 11:43:09 gpu-n1 kernel: task:python          state:D stack:0     pid:4242  ppid:1      flags:0x00004002",
        "Aug 30 11:43:09 gpu-n1 kernel: Call Trace:",
        "Aug 30 11:43:09 gpu-n1 kernel:  <TASK>",
        "Aug 30 11:43:09 gpu-n1 kernel:  __schedule+0x2cb/0x750",
        "Aug 30 11:43:09 gpu-n1 kernel:  </TASK>",
    ]
    recs = list(KernelParser(year=2024).parse(hung))
    assert len(recs) == 1 and classify(recs[0]).rule == "kernel.hung_task"
    oops = (FIXTURES / "kernel" / "families" / "input.log").read_text().splitlines()
    start = next(i for i, ln in enumerate(oops) if "BUG: unable to handle page fault" in ln)
    recs = list(KernelParser(year=2024).parse(oops[start:start + 12]))
    # its RIP is in the nvidia module (_nv012345rm [nvidia]): the driver's oops, not a generic one
    assert len(recs) == 1 and classify(recs[0]).rule == "kernel.oops.nvidia"
    divide = next(i for i, ln in enumerate(oops) if "divide error: 0000" in ln)
    assert classify(next(iter(KernelParser(year=2024).parse(oops[divide:divide + 1])))).rule == "kernel.oops"


def test_bad_dmesg_t_date_does_not_raise() -> None:
    recs = list(KernelParser(year=2024).parse(["[Sat Qct 12 18:35:32 2024] NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus."]))
    assert recs and recs[0].xid == 79


NCCL_LINES = {
    "nccl.ib_completion_error": "gpu-n1:1234:1290 [3] NCCL WARN NET/IB : Got completion from peer 10.0.0.5<53468> with error 12, opcode 0, len 0, vendor err 129",
    "nccl.alloc_failed": "gpu-n1:1234:1290 [3] include/alloc.h:185 NCCL WARN Failed to CUDA calloc 6291456 bytes",
    "nccl.socket_error": "gpu-n1:1234:1290 [3] misc/socket.cc:50 NCCL WARN socketProgressOpt: Call to recv from 10.0.0.2<43215> failed : Connection reset by peer",
}


@pytest.mark.parametrize("entry", sorted(NCCL_LINES))
def test_every_nccl_prefix_gives_the_same_entry(entry: str) -> None:
    msg = NCCL_LINES[entry]
    forms = {
        "bare": msg,
        "torchrun rank": f"[default3]:{msg}",
        "torch rank": f"[rank3]:{msg}",
        "srun --label": f"3: {msg}",
        "mpirun": f"[1,3]<stderr>:{msg}",
        "iso stamp": f"2024-11-21 10:00:00,123 {msg}",
        "bracketed stamp": f"[2024-11-21 10:00:00] {msg}",
    }
    for form, line in forms.items():
        recs = list(NcclParser(year=2024).parse([line]))
        assert len(recs) == 1, form
        assert classify(recs[0]).rule == entry, (form, classify(recs[0]).rule)


def test_long_records_are_judged_by_head_and_tail() -> None:
    """A crafted megabyte line is judged by its bounded head and tail (no quadratic regex
    stall: pytest-timeout guards it), and a long traceback still ends in its exception."""
    from faultlens.collectors.signatures import MATCH_LIMIT, bounded

    assert len(bounded("x" * 10 * MATCH_LIMIT)) <= 2 * MATCH_LIMIT + 1
    for piece in ("NVRM: ", "nvme nvme0: ", "EDAC ", "[EFA]", "md/raid1:md0: "):
        line = "[ 1.0] " + (piece + "a" * 7) * 100_000
        for rec in KernelParser(year=2024).parse([line]):
            classify(rec)
            is_ordinary(rec)
    frames = [f'  File "/opt/conda/lib/python3.10/site-packages/m{i}.py", line {i}, in f{i}' for i in range(300)]
    tb = ["Traceback (most recent call last):", *frames,
          "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"]
    recs = list(NcclParser(year=2024).parse(tb))
    assert len(recs) == 1 and len(recs[0].raw) > 2 * MATCH_LIMIT
    assert classify(recs[0]).rule == "nccl.error.cuda_oom"


NVSMI_WANT = {"nvsmi-001": ("reset_gpu", "warning"), "nvsmi-003": ("reset_gpu", "warning"),
              "nvsmi-004": ("reset_gpu", "critical"), "shipped-034": ("reset_gpu", "critical"),
              "shipped-035": ("none", "info"), "remap-failure": ("evict_node", "critical"),
              "volatile-uncorrectable": ("reset_gpu", "critical")}


@pytest.mark.parametrize("name", sorted(NVSMI_WANT))
def test_nvidia_smi_and_dcgm_text(name: str) -> None:
    """nvidia-smi -q / dcgmi diag text is detected as such and judged by its sections."""
    from faultlens.collectors.signatures import most_significant

    lines = (FIXTURES / "nvsmi" / "families" / f"{name}.txt").read_text().splitlines()
    explained = list(explain_lines(lines))
    assert {e.source for e in explained} == {"nvsmi"}
    v = most_significant(e.c for e in explained if e.c.rule != "empty")
    assert (v.action, v.severity) == NVSMI_WANT[name]
    assert v.family == "nvsmi" and v.category == ("none" if v.action == "none" else "gpu_memory")
