"""Failures of several machines at once (issue 35): correlated events and overlaps, rendered by the
simulator, decided by the real engine, and charged by the campaign's accounting."""

from dataclasses import replace

import pytest

from faultlens.datasets.campaign import CampaignSpec, Failure, PolicyContext, load_costs, load_mix
from faultlens.datasets.campaign_compound import compound_faults, decide_compound
from faultlens.datasets.campaign_outcomes import Outcomes, sample_noise
from faultlens.datasets.campaign_policies import simulate_policy
from faultlens.datasets.campaign_render import Decision, SliceLayout
from faultlens.datasets.campaign_run import measure_for

SPEC = CampaignSpec(gpus=16, layout="8b-dense", days=1.0, checkpoint_interval_s=1000.0, restart_s=100.0,
                    reschedule_s=50.0, warm_standbys=8, healthy_return_s=5000.0, repair_s=100000.0,
                    nccl_timeout_s=1800.0)
JOB32 = replace(SPEC, gpus=256)  # 32 machines: the guard lets 4 go in an hour
# 16 machines (the 70B campaign's slice size): a rack of 4 leaves 12 healthy peers to be wrongly blamed, and
# the guard's per-job cap (min(4, 25% of 16)) lets the whole rack go
LAYOUT = SliceLayout(gpus_per_node=8, tp=8, pp=1, dp=16, num_layers=32, microbatches=8)


def decision(kind, **kw):
    base = dict(kind=kind, bucket=0, seed=0, expected_action="evict_nodes", action="evict_nodes", detect_s=5.0,
                decide_s=3.0, named=1, culprit_named=True, extra_machines=0, right=True, adapt_ratio=None,
                adapt_pause_s=0.0, slow_speed=1.0, records=0, render_s=0.0, diagnose_s=0.0)
    base.update(kw)
    return Decision(**base)


def run(policy, failures, outcomes, spec=SPEC):
    costs = load_costs()
    spec = spec.resolved(costs)
    return simulate_policy(spec, failures, load_mix(), policy, PolicyContext(spec, costs, outcomes))


def test_rack_and_leaf_faults_take_several_machines_of_the_slice():
    import numpy as np

    nodes = [f"n{i:03d}" for i in range(8)]
    rack = compound_faults("rack_power", nodes, np.random.default_rng(1), 200.0)
    idx = [nodes.index(f.node) for f in rack]
    assert [f.kind for f in rack] == ["gpu_lost"] * 4 and idx == list(range(idx[0], idx[0] + 4))  # one rack
    leaf = compound_faults("leaf_switch", nodes, np.random.default_rng(1), 200.0)
    assert {f.kind for f in leaf} == {"ib_link_persistent"} and len({f.node for f in leaf}) == 4
    assert {f.onset_s for f in rack + leaf} == {200.0}  # at the same moment
    a, b = compound_faults("overlap", nodes, np.random.default_rng(1), 200.0)
    assert a.node != b.node and a.kind != b.kind and 230.0 <= b.onset_s <= 500.0


@pytest.mark.slow
def test_engine_evicts_the_whole_rack_and_no_healthy_machine():
    seed, noise = sample_noise("rack_power", 0)
    d = decide_compound("rack_power", LAYOUT, seed, 0, nccl_timeout_s=600.0, noise=noise)
    assert d.action == "evict_nodes" and d.culprit_named and d.right
    assert d.named == 4 and d.extra_machines == 0  # precision: the 4 healthy peers stay


def test_a_correlated_event_takes_its_machines_under_every_policy():
    f = [Failure(t=2500.0, kind="rack_power", u_draw=0.0, u_localise=0.5, episode_s=0.0)]
    outcomes = {"rack_power": [decision("rack_power", named=4)]}
    for policy in ("none", "restart", "group_evict", "faultlens", "oracle"):
        r = run(policy, f, outcomes, spec=JOB32)
        assert r.machines_out == 4 and r.healthy_out == 0, policy  # all 4 go to repair
    # naming only some of them: the job stops again at once, and is decided again
    partial = {"rack_power": [decision("rack_power", named=2, culprit_named=False, right=False)]}
    assert run("faultlens", f, partial, spec=JOB32).wrong >= 1


def test_a_correlated_event_past_the_guard_cap_is_not_all_evicted():
    # a 16-GPU job has 2 machines: the guard lets one go an hour, so a 4-machine event is not fixed by it
    f = [Failure(t=2500.0, kind="rack_power", u_draw=0.0, u_localise=0.5, episode_s=0.0)]
    r = run("faultlens", f, {"rack_power": [decision("rack_power", named=4)]})
    assert r.wrong >= 1


def test_an_overlap_the_engine_missed_costs_a_restart_more():
    # the second failure arrives while the first is still being handled (restart 150 s after 60+ s)
    two = [Failure(t=2500.0, kind="gpu_lost", u_draw=0.0, u_localise=0.5, episode_s=0.0),
           Failure(t=2520.0, kind="host_down", u_draw=0.0, u_localise=0.5, episode_s=0.0)]  # recurs at once
    base = {"gpu_lost": [decision("gpu_lost")], "ecc_uncorrectable": [decision("ecc_uncorrectable")]}
    named = run("faultlens", two, {**base, "overlap": [decision("overlap", named=2)]})
    missed = run("faultlens", two, {**base, "overlap": [decision("overlap", right=False, culprit_named=False)]})
    assert named.deferred == missed.deferred == 1
    assert missed.wrong == named.wrong + 1
    assert missed.ettr < named.ettr
    lost = sum(missed.lost_by_cause.values()) - sum(named.lost_by_cause.values())
    assert lost == pytest.approx(100.0, abs=1.0)  # one more restart in place (restart_s, nothing recomputed)


def test_overlap_is_measured_beside_the_mix_kinds(tmp_path):
    # the empty cache and cached_only with n_min 0 render nothing: only which kinds are asked for is checked
    costs = load_costs()
    mix = load_mix(kinds=["gpu_lost", "user_exception"])
    out = measure_for(SPEC.resolved(costs), mix, costs, n_min=0, n_max=0, cache_dir=tmp_path)
    assert isinstance(out, Outcomes) and set(out.by_kind) == {"gpu_lost", "user_exception", "overlap"}
    assert set(measure_for(SPEC.resolved(costs), mix, costs, n_min=0, n_max=0, overlap=False,
                           cache_dir=tmp_path).by_kind) == {"gpu_lost", "user_exception"}
