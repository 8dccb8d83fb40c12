"""What a real H100 printed (tests/fixtures/device_h100) reads as it should.

The capture is the one place the project has a real driver's output: NVML samples as
the collector read them, the boot log and nvidia-smi text of a healthy GPU. A healthy
machine must raise nothing, and the injected Xid must read as the fault it is.
"""

from __future__ import annotations

import json
from pathlib import Path

from faultlens.explain import explain_lines
from faultlens.signatures import classify_nvsmi
from faultlens.stream import decode as decoder

CAPTURE = Path(__file__).parent / "fixtures" / "device_h100"


def test_real_nvml_samples_decode_clean_in_both_wire_formats() -> None:
    samples = json.loads((CAPTURE / "nvml_samples.json").read_text())
    assert len(samples) == 5
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


def test_nvidia_smi_of_a_healthy_h100_is_normal() -> None:
    for name in ("nvidia-smi-q.txt", "nvidia-smi-ecc.txt"):
        c = classify_nvsmi((CAPTURE / name).read_text())
        assert (c.category, c.action) == ("none", "none"), name
