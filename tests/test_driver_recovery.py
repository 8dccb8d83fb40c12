"""Issue 36, item 1: the driver says what to do (Xid 154 and NVML's GPU recovery action).

Real lines (tests/fixtures/kernel/xid154_recovery): each 154 takes the recovery it states, the
wording first, else its code. In a job, NVIDIA's verdict decides the incident the earlier Xid
opened on that machine: Xid 109 then "Node Reboot Required" evicts it (one action, not the
109's stop-time checks first), "GPU Reset Required" drains it for checks; NVML's recovery
action field says the same without a kernel line.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from faultlens.collectors.kernel import KernelParser
from faultlens.collectors.signatures import ClassifyContext, classify, recovery_of
from faultlens.config import Config
from faultlens.diagnosis.batch import diagnose_records
from faultlens.schema import GpuSample, GpuState, JobTopology, StepTiming
from faultlens.stream.topology import Topology

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "kernel" / "xid154_recovery" / "input.log"
T0 = 1_725_018_000.0
TOPO = Topology.packed(tp=8, pp=1, dp=4, gpus_per_node=8, job="j1")  # 32 ranks on n001..n004
JOB = JobTopology(ts=T0, job="j1", **{k: v for k, v in TOPO.to_job_dict().items() if k != "job"})
XID109 = ("[Fri Aug 30 11:43:14 2024] NVRM: Xid (PCI:0000:cb:00): 109, pid=1797828, name=pt_main_thread, Ch 00000008, "
          "errorString CTX SWITCH TIMEOUT, Info 0x58005")
XID154 = "[Fri Aug 30 11:43:14 2024] NVRM: Xid (PCI:0000:cb:00): 154, GPU recovery action changed from 0x0 (None) to {}"


def test_every_recorded_154_follows_its_stated_recovery() -> None:
    recs = [r for r in KernelParser(year=2025).parse(FIXTURE.read_text().splitlines()) if r.xid == 154]
    ctx = ClassifyContext()
    got = [(r.fields["recovery_action"], r.fields["recovery_code"], classify(r, ctx).action) for r in recs]
    assert got == [("GPU Reset Required", 1, "reset_gpu"), ("Drain and Reset", 4, "evict_node"),
                   ("GPU Reset Required", 1, "reset_gpu"), ("Node Reboot Required", 2, "evict_node"),
                   ("Node Reboot Required", 2, "evict_node")]
    assert all(classify(r).fault == "driver_recovery" for r in recs)


def test_the_code_speaks_when_the_wording_is_new() -> None:
    assert recovery_of("Reboot the system now", 7)[1][0] == "evict_node"  # NVML 7: system reboot
    assert recovery_of(None, 1)[1][0] == "reset_gpu"
    assert recovery_of("None", 0)[1][0] == "none"
    assert recovery_of("", None) == ("", None)


def _records(kernel_lines: list[str], *, gpu_field: int | None = None) -> list:
    out: list = []
    for t in range(0, 300):
        out += [StepTiming(ts=T0 + t, job="j1", rank=r, node=TOPO.node_of(r), step=t, duration_s=1.0, loss=2.0)
                for r in range(32)] if t < 200 else []
        if t % 5 == 0:
            for n in TOPO.nodes:
                gpus = [GpuState(index=i, sm_clock_mhz=1980, pci_bus=f"00000000:{0xc4 + i:02X}:00.0",
                                 recovery_action=gpu_field if (gpu_field is not None and n == "n003" and i == 7
                                                               and t >= 200) else 0) for i in range(8)]
                out.append(GpuSample(ts=T0 + t, node=n, gpus=gpus))
    for i, line in enumerate(KernelParser("n003", year=2024).parse(kernel_lines)):
        out.append(line.__class__(**{**{f: getattr(line, f) for f in line.__struct_fields__}, "ts": T0 + 200.2 + i * 0.3,
                                     "node": "n003"}))
    return sorted(out, key=lambda r: r.ts)


@pytest.mark.parametrize(("stated", "want"), [
    ("0x2 (Node Reboot Required)", "evict_nodes"),
    ("0x4 (Drain and Reset)", "evict_nodes"),
    ("0x1 (GPU Reset Required)", "run_diagnostics"),
])
def test_xid109_then_154_is_decided_by_the_154(stated: str, want: str) -> None:
    incidents, actions = diagnose_records(JOB, _records([XID109, XID154.format(stated)]), Config())
    assert [(a.type, a.nodes) for a in actions] == [(want, ["n003"])]
    inc = next(i for i in incidents if i.kind == "gpu_hardware")
    assert any("154" in (e.get("raw") or e.get("text") or "") for e in inc.evidence)


def test_xid109_alone_still_asks_for_checks() -> None:
    _, actions = diagnose_records(JOB, _records([XID109]), Config())
    assert [(a.type, a.nodes) for a in actions] == [("run_diagnostics", ["n003"])]


@pytest.mark.parametrize(("code", "want"), [(2, "evict_nodes"), (4, "evict_nodes"), (1, "run_diagnostics")])
def test_nvml_recovery_action_field_is_followed(code: int, want: str) -> None:
    _, actions = diagnose_records(JOB, _records([], gpu_field=code), Config())
    assert [(a.type, a.nodes) for a in actions] == [(want, ["n003"])]
