"""The shipped classification catalogs, loaded through the production loader.

Every kernel/NCCL rule must match at least one recorded line (the fixtures under
tests/fixtures/{kernel,nccl}/) and no negative line; every Xid of NVIDIA's
catalog (tests/fixtures/nvidia/xid_catalog.csv, a copy) must be present, converted
to faultlens' vocabulary.
"""

from __future__ import annotations

import csv
import tomllib
from pathlib import Path

import pytest

from faultlens.collectors.kernel import KernelParser
from faultlens.collectors.nccl import NcclParser
from faultlens.collectors.signatures import CATALOGS
from faultlens.diagnosis.classify import (
    CATEGORIES,
    LINE_ACTIONS,
    ClassifyContext,
    classify,
    load_catalogs,
    load_rules,
    to_finding,
)
from faultlens.errors import CatalogError

FIXTURES = Path(__file__).resolve().parent / "fixtures"
CAT = {"unused": "unknown", "user_application": "user_software", "driver": "driver", "memory": "gpu_memory",
       "nvlink": "nvlink", "power_thermal": "thermal_power", "pcie_bus": "pcie", "hardware": "gpu_hardware",
       "informational": "none", "hardware_or_driver": "gpu_hardware"}
ACT = {"drain_node": {"evict_node"}, "investigate": {"notify", "run_diagnostics"}, "unknown": {"notify"}}


def _rules_hit(source: str) -> set[str]:
    hit = set()
    for d in sorted((FIXTURES / source).iterdir()):
        if d.name == "negative":
            continue
        parser = KernelParser("n", year=2024) if source == "kernel" else NcclParser("n", year=2024)
        ctx = ClassifyContext()
        with open(d / "input.log", encoding="utf-8") as f:
            for rec in parser.parse(f):
                hit.add(classify(rec, ctx).rule)
    return hit


def test_catalogs_load_and_use_the_vocabulary() -> None:
    cats = load_catalogs()
    for rule in cats.kernel + cats.nccl:
        assert rule.result.category in CATEGORIES and rule.result.action in LINE_ACTIONS
    assert all(e.result.category in CATEGORIES for e in cats.xid.values())


@pytest.mark.parametrize("source", ["kernel", "nccl"])
def test_every_rule_matches_a_recorded_line(source: str) -> None:
    cats = load_catalogs()
    rules = {r.id for r in (cats.kernel if source == "kernel" else cats.nccl)}
    missing = rules - _rules_hit(source)
    assert not missing, f"rules without a recorded line: {sorted(missing)}"


def test_negative_lines_produce_no_finding() -> None:
    ctx = ClassifyContext()
    with open(FIXTURES / "kernel" / "negative" / "input.log", encoding="utf-8") as f:
        for rec in KernelParser("n", year=2024).parse(f):
            assert to_finding(rec, ctx) is None, rec.raw


def test_every_nvidia_xid_is_in_the_catalog() -> None:
    cats = load_catalogs()
    rows = list(csv.DictReader(open(FIXTURES / "nvidia" / "xid_catalog.csv", encoding="utf-8")))
    raw_xid = tomllib.loads((CATALOGS / "xid.toml").read_text())["xid"]
    assert rows
    for row in rows:
        code = int(row["code"])
        assert code in cats.xid, code
        got = cats.xid[code].result
        assert got.category == CAT[row["category"]], code
        if code in (64, 79):  # README: row-remap failure and fallen-off-the-bus -> drain
            assert got.action == "evict_node"
        elif "differs" in raw_xid[str(code)]:  # a deliberate difference, stated (and why) in the entry
            assert got.action != "none" or raw_xid[str(code)]["differs"]
        else:
            assert got.action in ACT.get(row["expected_action_label"], {row["expected_action_label"]}), code
        assert got.meaning and got.rule == f"xid.{code}"


def test_bad_entry_fails_naming_file_and_entry(tmp_path) -> None:
    bad = tmp_path / "k.toml"
    bad.write_text('[[rule]]\nid = "x.bad"\nkind = "other"\nmatch = "("\ncategory = "none"\nseverity = "info"\naction = "none"\nmeaning = "m"\n')
    with pytest.raises(CatalogError, match=r"k\.toml.*x\.bad.*regex"):
        load_rules(bad)
    bad.write_text('[[rule]]\nid = "x.cat"\nkind = "other"\ncategory = "weird"\nseverity = "info"\naction = "none"\nmeaning = "m"\n')
    with pytest.raises(CatalogError, match="x.cat"):
        load_rules(bad)


def test_context_rules() -> None:
    p = KernelParser("n", year=2024)
    lines = [
        "[Fri Jan 29 23:42:34 2021] NVRM: Xid (PCI:0000:db:00): 31, pid=13641, Ch 00000008, intr 00000000. MMU Fault",
        "[Sat Jan 30 00:05:20 2021] NVRM: Xid (PCI:0000:db:00): 31, pid=14323, Ch 00000008, intr 00000000. MMU Fault",
        "[Sat Jan 30 00:32:48 2021] NVRM: Xid (PCI:0000:db:00): 31, pid=33275, Ch 00000008, intr 00000000. MMU Fault",
        "Mar 27 17:40:36 kernel: NVRM: Xid (PCI:0000:01:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error",
        "Mar 27 17:40:36 kernel: NVRM: Xid (PCI:0000:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)",
        "Mar 27 17:40:36 kernel: NVRM: Xid (PCI:0000:01:00): 45, pid=12542, name=VLLM::Worker, channel 0x00000002",
        "kwi 15 07:56:59 testowy kernel: NVRM: Xid (PCI:0000:07:00): 109, pid=326, name=modprobe, channel 0x00000007, errorString CTX SWITCH TIMEOUT",
    ]
    ctx = ClassifyContext()
    got = [classify(r, ctx) for r in p.parse(lines)]
    assert [c.category for c in got[:3]] == ["user_software", "user_software", "gpu_hardware"]
    assert got[2].rule == "xid.31.recurring" and got[2].action == "run_diagnostics"
    assert (got[4].action, got[4].category, got[4].companion) == ("evict_node", "gpu_memory", True)
    assert (got[5].rule, got[5].category, got[5].action) == ("xid.45.after_xid", "gpu_memory", "none")
    assert (got[6].category, got[6].rule) == ("driver", "xid.109.driver_process")
    # without a context each record stands alone
    assert classify(list(KernelParser("n").parse(lines[2:3]))[0]).category == "user_software"


def test_to_finding_carries_evidence() -> None:
    rec = list(KernelParser("node-7", year=2024, gpu_map={"0000:3b:00": 3}).parse(
        ["[ 5021.114402] NVRM: Xid (PCI:0000:3b:00): 79, pid=48211, name=python, GPU has fallen off the bus."]))[0]
    f = to_finding(rec)
    assert f is not None
    assert (f.kind, f.category, f.action, f.severity, f.source, f.rule) == ("gpu_lost", "pcie", "evict_node", "critical", "kernel", "xid.79")
    assert (f.node, f.gpu, f.figures["xid"], f.figures["pci_bus"]) == ("node-7", 3, 79, "0000:3b:00")
    assert "fallen off the bus" in f.text
