"""Issue 36, item 2: application Xids are the application's.

Xid 43 (and 13/31, 45 as their cleanup) with the ranks' "CUDA error: an illegal memory access
was encountered" (tests/fixtures/nccl/app_cuda_error, real) is the code: rollback_code, never an
eviction; an Xid 43 alone with such tracebacks still gets an action. One rank's "CUDA error:
unknown error" while its GPU fails (GSP timeout, Xid 119) is the machine's, never rolled back.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from faultlens.collectors.kernel import KernelParser
from faultlens.collectors.nccl import NcclParser
from faultlens.config import Config
from faultlens.diagnosis.batch import diagnose_records
from faultlens.diagnosis.exceptions import user_exception
from faultlens.schema import GpuSample, GpuState, JobTopology, StepTiming
from faultlens.stream.topology import Topology

TRACEBACK = (Path(__file__).resolve().parent / "fixtures" / "nccl" / "app_cuda_error" / "input.log").read_text().splitlines()
XID43 = "NVRM: Xid (PCI:0000:00:05): 43, pid=1045242, name=pt_main_thread, Ch 00000008"
XID119 = ("NVRM: Xid (PCI:0000:00:05): 119, pid=1045242, name=pt_main_thread, Timeout after 6s of waiting for RPC "
          "response from GPU0 GSP! Expected function 76 (GSP_RM_CONTROL) (0x20803039 0x8).")
T0 = 1_722_467_000.0
TOPO = Topology.packed(tp=8, pp=1, dp=2, gpus_per_node=8, job="j1")  # 16 ranks on n001, n002
JOB = JobTopology(ts=T0, job="j1", **{k: v for k, v in TOPO.to_job_dict().items() if k != "job"})


def _run(kernel: list[str], tb_ranks: list[int], last: str | None = None) -> list:
    recs: list = []
    for t in range(200):
        recs += [StepTiming(ts=T0 + t, job="j1", rank=r, node=TOPO.node_of(r), step=t, duration_s=1.0, loss=2.0)
                 for r in range(16)] if t < 120 else []
        if t % 5 == 0:
            recs += [GpuSample(ts=T0 + t, node=n, gpus=[GpuState(index=i, sm_clock_mhz=1980) for i in range(8)])
                     for n in TOPO.nodes]
    for i, k in enumerate(KernelParser("n002", year=2024).parse(kernel)):
        recs.append(k.__class__(**{**{f: getattr(k, f) for f in k.__struct_fields__}, "ts": T0 + 120.1 + i * 0.2,
                                   "node": "n002"}))
    lines = TRACEBACK if last is None else [*TRACEBACK[:-1], last]
    for r in tb_ranks:
        for i, e in enumerate(NcclParser(TOPO.node_of(r), year=2024).parse([f"[rank{r}]:{ln}" for ln in lines])):
            recs.append(e.__class__(**{**{f: getattr(e, f) for f in e.__struct_fields__}, "ts": T0 + 121 + r * 0.05 + i * 1e-4}))
    _, actions = diagnose_records(JOB, sorted(recs, key=lambda r: r.ts), Config())
    return actions


@pytest.mark.parametrize("last", [None, "RuntimeError: CUDA error: misaligned address",
                                  "RuntimeError: CUDA error: unspecified launch failure"])
def test_xid43_alone_with_the_ranks_cuda_errors_rolls_back(last: str | None) -> None:
    actions = _run([XID43], [8, 9, 10], last)
    assert [a.type for a in actions if a.type != "notify"] == ["rollback_code"]
    assert not [a for a in actions if a.type == "evict_nodes"]


def test_xid13_and_43_with_tracebacks_never_evict() -> None:
    xid13 = ("NVRM: Xid (PCI:0000:00:05): 13, pid=1045242, name=pt_main_thread, Graphics SM Warp Exception on "
             "(GPC 7, TPC 7, SM 0): Illegal Instruction Parameter")
    actions = _run([xid13, XID43], list(range(8, 16)))
    assert "rollback_code" in [a.type for a in actions]
    assert not [a for a in actions if a.type == "evict_nodes"]


def test_unknown_error_on_a_failing_gpu_is_not_user_code() -> None:
    assert user_exception(next(iter(NcclParser("n002", year=2024).parse(
        ["[rank9]:" + ln for ln in [*TRACEBACK[:-1], "RuntimeError: CUDA error: unknown error"]])))) is None
    actions = _run([XID119], [9], "RuntimeError: CUDA error: unknown error")
    assert "rollback_code" not in [a.type for a in actions]
    assert [(a.type, a.nodes) for a in actions if a.type != "notify"] == [("run_diagnostics", ["n002"])]
