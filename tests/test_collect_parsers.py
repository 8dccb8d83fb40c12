"""Kernel and NCCL parsers on recorded real lines, against golden parsed output.

Regenerate the goldens after an intended change: FAULTLENS_REGEN=1 pytest tests/test_collect_parsers.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
import orjson
import pytest

from faultlens.collectors.kernel import KernelParser, normalize_pci, parse_journal_entry
from faultlens.collectors.nccl import NcclParser
from faultlens.collectors.stacks import looks_like_pyspy
from faultlens.collectors.steps import StepLogParser, StepReporter

FIXTURES = Path(__file__).resolve().parent / "fixtures"
REGEN = os.environ.get("FAULTLENS_REGEN") == "1"
CASES = [("kernel", "real"), ("kernel", "project"), ("kernel", "families"), ("kernel", "negative"), ("nccl", "real"),
         ("nccl", "families"), ("nccl", "pauses"),
         ("nccl", "project")]


def _parse(source: str, path) -> list[dict]:
    parser = KernelParser("node-a", year=2024, gpu_map={"00000000:3B:00.0": 2}) if source == "kernel" else NcclParser("node-a", year=2024)
    with open(path, encoding="utf-8") as f:
        return [msgspec.to_builtins(r) for r in parser.parse(f)]


@pytest.mark.parametrize(("source", "scenario"), CASES)
def test_parser_matches_golden(source: str, scenario: str) -> None:
    d = FIXTURES / source / scenario
    got = _parse(source, d / "input.log")
    golden = d / "expected.jsonl"
    if REGEN or not golden.exists():
        golden.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in got))
    want = [json.loads(line) for line in golden.read_text().splitlines()]
    assert got == want


def test_every_input_line_lands_in_exactly_one_record() -> None:
    for source, scenario in CASES:
        path = FIXTURES / source / scenario / "input.log"
        lines = [x for x in path.read_text().splitlines() if x.strip()]
        recs = _parse(source, path)
        assert sum(r["raw"].count("\n") + 1 for r in recs) == len(lines), (source, scenario)


def test_kernel_fields_from_real_lines() -> None:
    recs = list(KernelParser("n", year=2024, gpu_map={"0000:19:00": 5}).parse([
        "2024-11-15T12:02:03,470068+00:00 NVRM: Xid (PCI:0000:19:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at physAddr 0x12bac1c3e0 partition 2, subpartition 1.",
        "[Fri Aug 30 11:43:14 2024] NVRM: Xid (PCI:0000:cb:00): 109, pid=1797828, name=pt_main_thread, Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x58005",
        "[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0",
        "               NVRM: (PCI ID: 10de:26b5) installed in this system has",
        "               NVRM: fallen off the bus and is not responding to commands.",
        "[default7]:[ 12.5] NVRM: Xid (PCI:0000:19:00): 79, pid=4242, GPU has fallen off the bus.",
    ]))
    assert [r.kind for r in recs] == ["xid", "xid", "fell_off_bus", "xid"]
    dbe, ctx, fell, lost = recs
    assert (dbe.xid, dbe.pci_bus, dbe.gpu, dbe.pid) == (48, "0000:19:00", 5, None)
    assert abs(dbe.ts - 1731672123.470068) < 1e-6
    assert (ctx.xid, ctx.pid, ctx.fields["process"]) == (109, 1797828, "pt_main_thread")
    assert fell.pci_bus == "0000:b3:00" and fell.raw.count("\n") == 2
    assert (lost.rank, lost.xid, lost.pid, lost.gpu) == (7, 79, 4242, 5)


def test_kernel_kmsg_and_journal_forms() -> None:
    p = KernelParser("n", boot_time=1_700_000_000.0)
    recs = list(p.parse([
        "4,2331,9501002003,-;NVRM: Xid (PCI:0000:b7:00): 94, pid=1201, name=python3, Contained: SM (0x1). RST: No, D-RST: No",
        " SUBSYSTEM=pci",
        parse_journal_entry({"MESSAGE": "mlx5_core 0000:0c:00.0 mlx5_2: Port: 1 Link DOWN", "__REALTIME_TIMESTAMP": "1700000123000000", "_HOSTNAME": "gpu-n1"}),
    ]))
    assert recs[0].xid == 94 and abs(recs[0].ts - (1_700_000_000.0 + 9501.002003)) < 1e-6
    assert recs[0].fields["level"] == "warn"
    assert recs[1].kind == "ib_link_down" and recs[1].ts == 1700000123.0 and recs[1].fields["host"] == "gpu-n1"


def test_normalize_pci() -> None:
    assert normalize_pci("00000000:3B:00.0") == "0000:3b:00"
    assert normalize_pci("0000:3b:00") == "0000:3b:00"


def test_nccl_watchdog_and_traceback_fields() -> None:
    recs = list(NcclParser("n", year=2024).parse([
        "[80746] [rank0]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE, NumelIn=466119168, NumelOut=466119168, Timeout(ms)=600000) ran for 600060 milliseconds before timing out.",
        "[rank3]:   File \"/usr/local/lib/python3.12/dist-packages/torch/distributed/utils.py\", line 281, in _verify_param_shape_across_processes",
        "[rank3]:     return dist._verify_params_across_processes(process_group, tensors, logger)",
        "[rank3]: torch.distributed.DistBackendError: NCCL error in: /opt/pytorch/ProcessGroupNCCL.cpp:3763, remote process exited or there was a network error, NCCL version 2.28.8",
        "[rank3]: ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.",
        "[rank3]: Last error:",
        "[rank3]: NET/OFI Request 0x7f14cc5b60c0 completed with error. RC: 113. Error: 2 (UNDELIVERABLE). Completed length: 0",
        "hostname-test:984:1357 [4] ib_plugin.c:1615 NCCL WARN NET/IB : Got completion from peer 172.36.143.59<44206> with status=12 opcode=129 len=65536 vendor err 129 (Recv)",
    ]))
    wd, tb, ib = recs
    assert (wd.kind, wd.rank, wd.op_type, wd.seq_num, wd.timeout_ms, wd.ran_for_ms) == ("watchdog_timeout", 0, "ALLREDUCE", 1580, 600000, 600060)
    assert tb.rank == 3 and tb.raw.count("\n") == 5
    assert tb.exception.startswith("torch.distributed.DistBackendError: NCCL error in:")
    assert (ib.kind, ib.host, ib.pid, ib.level, ib.fields["peer"], ib.fields["status"]) == ("ib_completion_error", "hostname-test", 984, "WARN", "172.36.143.59", 12)


def test_step_parsers_match_real_labels(real_logs) -> None:
    for line in (real_logs / "steps.jsonl").read_text().splitlines():
        sample = json.loads(line)
        p = StepLogParser()
        got = [f for text in sample["text"].split("\n") for _, f in p.feed(text)] + [f for _, f in p.flush()]
        assert got == sample["labels"]["fields"], sample["id"]


def test_pyspy_detection(real_logs) -> None:
    for line in (real_logs / "stacks.jsonl").read_text().splitlines():
        assert looks_like_pyspy(json.loads(line)["text"])
    for line in (real_logs / "kernel.jsonl").read_text().splitlines():
        assert not looks_like_pyspy(json.loads(line)["text"])


def test_step_reporter_writes_and_never_raises(tmp_path) -> None:
    path = tmp_path / "steps.jsonl"
    rep = StepReporter(path, job="j1", rank=3, node="n1", flush_interval_s=0.05)
    for i in range(5):
        with rep.step(i, n_seqs=4, sum_len=4096, sum_len_sq=4194304, tokens=4096) as extra:
            extra["loss"] = 2.5
    rep.record(99, 1.0, loss=float("nan"), bogus=object())  # unserialisable: counted, not raised
    rep.close()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[0]["job"] == "j1" and rows[0]["rank"] == 3 and rows[0]["loss"] == 2.5 and rows[0]["duration_s"] >= 0
    assert rep.errors == 1
    bad = StepReporter(tmp_path / "no" / "such" / "dir" / "s.jsonl", job="j", rank=0, background=False)
    bad.record(1, 0.5)  # the directory does not exist: swallowed and counted
    assert bad.errors == 1 and bad.dropped == 1
    bad.close()
