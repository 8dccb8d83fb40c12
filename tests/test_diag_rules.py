"""NVML counter rules (catalogs/counters.toml) on handcrafted sample sequences."""

import pytest

from faultlens.diagnosis.rules import CounterRules, load_counter_rules
from faultlens.errors import CatalogError
from faultlens.schema import GpuSample, GpuState


def run(samples):
    rules = CounterRules()
    out = []
    for s in samples:
        out.extend(rules.observe(s))
    return out


def sample(ts, **gpu0):
    return GpuSample(ts=ts, node="n001", gpus=[GpuState(index=0, sm_clock_mhz=1980, **gpu0),
                                                GpuState(index=1, sm_clock_mhz=1980)])


def test_shipped_catalog_loads():
    names = {r.name for r in load_counter_rules()}
    assert {"gpu_lost", "dbe_increase", "row_remap_failure", "pcie_replay_rate", "nvlink_error_rate",
            "thermal_throttle", "retired_pages_increase"} <= names


def test_dbe_increase_is_critical_evict():
    found = run([sample(0, ecc_dbe=2), sample(1, ecc_dbe=2), sample(2, ecc_dbe=3)])
    assert [(f.kind, f.gpu, f.action, f.figures["delta"]) for f in found] == [("ecc_uncorrectable", 0, "evict_node", 1)]


def test_flags_fire_on_rising_edge_only():
    found = run([sample(0), sample(1, remap_failure=True), sample(2, remap_failure=True), sample(3, lost=True)])
    assert [f.kind for f in found] == ["row_remap_failure", "gpu_lost"]


def test_pcie_replay_rate_needs_a_sustained_rise():
    slow = run([sample(t, pcie_replay=t // 10) for t in range(0, 120, 5)])  # 6/min: below 30/min
    fast = run([sample(t, pcie_replay=t * 2) for t in range(0, 120, 5)])  # 120/min
    assert slow == []
    assert fast and fast[0].kind == "pcie_degradation" and fast[0].figures["rate_per_min"] >= 30


def test_thermal_throttle_needs_bit_clock_drop_and_persistence():
    hot = dict(throttle_reasons=0x40)
    blip = run([sample(0, **hot), sample(1), sample(2, **hot)])
    bit_no_drop = run([sample(t, **hot) for t in range(5)])
    sustained = run([GpuSample(ts=t, node="n001", gpus=[GpuState(index=0, sm_clock_mhz=1200, throttle_reasons=0x40),
                                                        GpuState(index=1, sm_clock_mhz=1980),
                                                        GpuState(index=2, sm_clock_mhz=1975)]) for t in range(5)])
    assert blip == [] and bit_no_drop == []
    assert [f.kind for f in sustained] == ["thermal_throttle"]
    assert sustained[0].figures["peer_sm_clock_mhz"] == pytest.approx(1977.5)


def test_bad_catalog_entry_names_file_and_entry(tmp_path):
    bad = tmp_path / "counters.toml"
    bad.write_text('[[rule]]\nname = "oops"\nfield = "no_such_counter"\ntest = "flag"\nkind = "x"\n'
                   'category = "gpu_hardware"\nseverity = "critical"\naction = "evict_node"\nconfidence = 0.9\ntext = ""\n')
    with pytest.raises(CatalogError, match="counters.toml, entry oops"):
        load_counter_rules(bad)


def test_a_gpu_left_out_of_two_samples_in_a_row_is_lost():
    """nvidia-smi and dcgm-exporter leave out a GPU NVML cannot reach: missing twice is lost, once is not."""
    rules = CounterRules()

    def sample(t, indices):
        return GpuSample(ts=float(t), node="n1", gpus=[GpuState(index=i, uuid=f"GPU-{i}", pci_bus=f"0000:{i:02x}:00.0")
                                                       for i in indices])

    assert rules.observe(sample(0, range(8))) == []
    assert rules.observe(sample(1, [0, 1, 2, 3, 4, 5, 7])) == []  # one sample without GPU 6: not yet
    assert rules.observe(sample(2, range(8))) == []  # back
    assert rules.observe(sample(3, [0, 1, 2, 3, 4, 5, 7])) == []
    found = rules.observe(sample(4, [0, 1, 2, 3, 4, 5, 7]))
    assert [(f.kind, f.gpu, f.action) for f in found] == [("gpu_lost", 6, "evict_node")]
    assert rules.observe(sample(5, [0, 1, 2, 3, 4, 5, 7])) == []  # reported once, on the edge
    assert rules.observe(GpuSample(ts=6.0, node="n1", gpus=[])) == []  # an empty sample says nothing


def test_a_vanished_gpu_that_comes_back_is_no_counter_jump():
    """The lost stand-in keeps the GPU's last counters: on its return, a cumulative DBE count of 5 is not 'new'."""
    rules = CounterRules()

    def sample(t, indices):
        return GpuSample(ts=float(t), node="n1", gpus=[GpuState(index=i, ecc_dbe=5 if i == 6 else 0) for i in indices])

    rules.observe(sample(0, range(8)))
    rules.observe(sample(1, [i for i in range(8) if i != 6]))
    lost = rules.observe(sample(2, [i for i in range(8) if i != 6]))
    assert [f.kind for f in lost] == ["gpu_lost"]
    back = rules.observe(sample(3, range(8)))
    assert "ecc_uncorrectable" not in [f.kind for f in back]
