"""What a real H100 and a real H200 printed (tests/fixtures/device_h100, device_h200) reads as it should.

The capture is the one place the project has a real driver's output: NVML samples as
the collector read them, the boot log and nvidia-smi text of a healthy GPU. A healthy
machine must raise nothing, and the injected Xid must read as the fault it is.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from faultlens import decode as decoder
from faultlens.collectors.signatures import classify_nvsmi
from faultlens.diagnosis.explain import explain_lines

CAPTURE = Path(__file__).parent / "fixtures" / "device_h100"
H200 = Path(__file__).parent / "fixtures" / "device_h200"


@pytest.mark.parametrize("capture", [CAPTURE, H200], ids=["h100", "h200"])
def test_real_nvml_samples_decode_clean_in_both_wire_formats(capture: Path) -> None:
    samples = json.loads((capture / "nvml_samples.json").read_text())
    assert len(samples) >= 3
    for raw in samples:
        issues: list[decoder.FieldIssue] = []
        record = decoder.decode("gpu", json.dumps(raw).encode(), issues=issues)
        assert issues == []
        assert record.gpus[0].uuid.startswith("GPU-")
        assert record.gpus[0].remap_pending is False  # left out on the wire while false
        wire = decoder.encode_wire(record)
        again = decoder.decode("gpu", wire, content_type=decoder.content_type_of(wire), issues=issues)
        assert issues == []
        assert again == record  # field by field (to_dict may leave out a default either way)


def test_a_healthy_h100_boot_log_raises_nothing_but_the_injected_xids() -> None:
    lines = (CAPTURE / "dmesg.txt").read_text().splitlines()
    verdicts = [e for e in explain_lines(lines) if e.c.action != "none"]
    assert [e.text.split("] ", 1)[1] for e in verdicts] == [
        "NVRM: Xid (PCI:0000:00:00): 79, pid=0, GPU has fallen off the bus. (faultlens device_check, injected)"
    ] * 2
    assert {(e.c.category, e.c.action) for e in verdicts} == {("pcie", "evict_node")}


def test_nvidia_smi_of_a_healthy_h100_and_h200_is_normal() -> None:
    for path in (CAPTURE / "nvidia-smi-q.txt", CAPTURE / "nvidia-smi-ecc.txt", H200 / "nvidia-smi-q.txt"):
        c = classify_nvsmi(path.read_text())
        assert (c.category, c.action) == ("none", "none"), path


def test_counters_an_h200_does_not_answer_stay_null_through_the_wire() -> None:
    """Page retirement (pre-Ampere) and NVLink (no links in that VM) were not answered: null, not 0 errors."""
    raw = json.loads((H200 / "nvml_samples.json").read_text())[0]
    record = decoder.decode("gpu", json.dumps(raw).encode())
    wire = decoder.encode_wire(record)
    gpu = decoder.decode("gpu", wire, content_type=decoder.content_type_of(wire)).gpus[0]
    assert gpu.retired_pages is None and gpu.nvlink_errors is None and gpu.nvlink_crc_errors is None
    assert gpu.ecc_dbe == 0 and gpu.remapped_rows_unc == 0 and gpu.power_w == pytest.approx(80.614)
