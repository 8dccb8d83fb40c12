"""Peer comparison (Minder-style) on seeded NVML streams: similarity plus continuity."""

from __future__ import annotations

from faultlens import schema
from faultlens.models.peer import PeerDetector, PeerParams, robust_z
from tests import stepgen

T0 = 1_700_000_010.0  # not on a window boundary: windows are wall-clock aligned


def _run(det: PeerDetector, samples) -> list:
    out, last = [], T0
    for s in samples:
        out += det.observe(s)
        last = s.ts
    return out + det.tick(last + 3600)


def test_a_hot_throttled_gpu_is_flagged_after_the_continuity_window() -> None:
    fault = stepgen.GpuFault(node="n005", gpu=3, onset_s=200.0)
    findings = _run(PeerDetector(), stepgen.gpu_samples(seconds=700, fault=fault, t0=T0))
    assert len(findings) == 1
    f = findings[0]
    assert (f.node, f.gpu, f.source, f.kind) == ("n005", 3, "model:peer", "peer_outlier")
    # Onset at T0+200 = 1_700_000_210 falls in window [..190, ..220); eight apart windows
    # (240 s continuity / 30 s) end at 1_700_000_190 + 8*30.
    assert f.ts == 1_700_000_190.0 + 8 * 30
    assert f.figures["windows"] == 8 and f.category == "thermal_power"
    assert abs(f.figures["z"]) >= 6


def test_a_short_excursion_is_not_a_fault() -> None:
    fault = stepgen.GpuFault(node="n002", gpu=0, onset_s=200.0, end_s=320.0)  # two minutes
    assert _run(PeerDetector(), stepgen.gpu_samples(seconds=700, fault=fault, t0=T0)) == []


def test_healthy_peers_raise_nothing() -> None:
    assert _run(PeerDetector(), stepgen.gpu_samples(seconds=900, seed=5, t0=T0)) == []


def test_too_few_peers_no_comparison() -> None:
    fault = stepgen.GpuFault(node="n001", gpu=0, onset_s=0.0)
    det = PeerDetector(PeerParams(min_peers=4))
    assert _run(det, stepgen.gpu_samples(nodes=3, seconds=600, fault=fault, t0=T0)) == []


def test_robust_z_has_a_floor_for_identical_peers() -> None:
    import numpy as np

    z = robust_z(np.array([60.0] * 7 + [61.0]), rel_floor=0.02, abs_floor=2.0)
    assert abs(z[-1]) < 1.0  # one degree is not an outlier just because peers agree exactly


def test_a_machine_whose_gpus_are_all_lost_is_left_out_of_the_comparison() -> None:

    samples = []
    for s in stepgen.gpu_samples(seconds=400, seed=2, t0=T0):
        if s.node == "n003" and s.ts >= T0 + 100:
            s = schema.replace(s, gpus=[schema.replace(g, lost=True) for g in s.gpus])
        samples.append(s)
    det = PeerDetector()
    assert _run(det, samples) == []
    assert "n003" not in det.last_scores["j1"] and len(det.last_scores["j1"]) == 7


def test_null_gauges_are_skipped_not_a_crash() -> None:
    """nvidia-smi's "N/A" decodes to null (faultlens/schema.py): a reading with a null gauge or
    throttle field is left out of the comparison, and the hot GPU is still found."""
    fault = stepgen.GpuFault(node="n005", gpu=3, onset_s=200.0)
    samples = []
    for i, s in enumerate(stepgen.gpu_samples(seconds=700, fault=fault, t0=T0)):
        if s.node == "n002" and i % 3 == 0:
            s = schema.replace(s, gpus=[schema.replace(g, temp_c=None, throttle_reasons=None) for g in s.gpus])
        samples.append(s)
    findings = _run(PeerDetector(), samples)
    assert [(f.node, f.gpu) for f in findings] == [("n005", 3)]
