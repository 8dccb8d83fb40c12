"""The campaign simulator (issue 25): the accounting on campaigns small enough to compute by hand,
the policies on one draw, and the --smoke benchmark end to end (real renders, real engine)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from faultlens.datasets.campaign import (
    CAUSES,
    CampaignSpec,
    Failure,
    PolicyContext,
    load_costs,
    load_mix,
    rsc_analytic_ettr,
    simulate_policy,
    sliding_ettr,
)
from faultlens.datasets.campaign_render import Decision

REPO = Path(__file__).resolve().parent.parent
DAY = 86400.0
# A one-day job with round costs; the policies' own numbers come from the shipped costs table
# (none: crash seen in 60 s, localised in 120 + u * 780 s).
SPEC = CampaignSpec(gpus=16, layout="8b-dense", days=1.0, checkpoint_interval_s=1000.0, restart_s=100.0,
                    reschedule_s=50.0, warm_standbys=1, healthy_return_s=5000.0, repair_s=100000.0,
                    nccl_timeout_s=1800.0)


def decision(kind, action, **kw):
    base = dict(kind=kind, bucket=0, seed=0, expected_action="evict_nodes", action=action, detect_s=5.0,
                decide_s=3.0, named=1, culprit_named=True, extra_machines=0, right=True, adapt_ratio=None,
                adapt_pause_s=0.0, slow_speed=1.0, records=0, render_s=0.0, diagnose_s=0.0)
    base.update(kw)
    return Decision(**base)


DECISIONS = {
    ("gpu_lost", 0): decision("gpu_lost", "evict_nodes"),
    ("thermal_throttle", 0): decision("thermal_throttle", "adapt_parallelism", detect_s=20.0, decide_s=10.0,
                                      adapt_ratio=0.9, adapt_pause_s=40.0, slow_speed=0.8),
}
TWO = [Failure(t=2500.0, kind="gpu_lost", bucket=0, u_localise=0.5, episode_s=0.0),
       Failure(t=50000.0, kind="thermal_throttle", bucket=0, u_localise=0.0, episode_s=3600.0)]


def run(policy, failures=TWO, spec=SPEC, decisions=DECISIONS):
    costs = load_costs()
    spec = spec.resolved(costs)
    return simulate_policy(spec, failures, load_mix(), policy, PolicyContext(spec, costs, decisions))


def test_two_failures_by_hand_no_diagnosis():
    r = run("none")
    # gpu_lost at 2,500 s: 500 s since the checkpoint at 2,000; seen in 60 s, localised in 120 + 0.5 * 780 = 510 s,
    # one standby swapped in (restart 100 + reschedule 50), 500 s recomputed. The slow GPU is never noticed:
    # its 3,600 s episode at speed 0.8 costs 0.2 * 3,600 = 720 s.
    assert r.lost_by_cause == pytest.approx({"detection": 60.0, "localisation": 510.0, "standby_wait": 0.0,
                                             "restart": 150.0, "recompute": 500.0, "recurrence": 0.0,
                                             "degraded": 720.0})
    assert r.ettr == pytest.approx(1.0 - 1940.0 / DAY)
    assert r.machines_out == 1 and r.standby_waits == 0


def test_two_failures_by_hand_faultlens():
    r = run("faultlens")
    # gpu_lost: detected in 5 s, decided in 3 s, same restart and recompute. thermal: slow for 20 + 10 s
    # (0.2 * 30 = 6 s), the plan's 40 s pause, then 3,530 s at the plan's 0.9 (353 s).
    assert r.lost_by_cause == pytest.approx({"detection": 5.0, "localisation": 3.0, "standby_wait": 0.0,
                                             "restart": 190.0, "recompute": 500.0, "recurrence": 0.0,
                                             "degraded": 359.0})
    assert r.ettr == pytest.approx(1.0 - 1057.0 / DAY)


def test_blind_restart_recurs_then_people_fix_it():
    r = run("restart")
    # a blind in-place restart (60 s seen, 100 s restart, 500 s recompute) brings the job back without the GPU:
    # it fails again at once (recur_after_s 0) 500 s after the resumed checkpoint; people then take
    # 60 + 510 + 150 + 500 = 1,220 s, all charged to recurrence.
    assert r.lost_by_cause["recurrence"] == pytest.approx(1220.0)
    assert (r.lost_by_cause["detection"], r.lost_by_cause["restart"], r.lost_by_cause["recompute"]) == \
        pytest.approx((60.0, 100.0, 500.0))
    assert r.wrong == 1


def test_a_wrong_eviction_recurs_and_spends_the_standby():
    wrong = dict(DECISIONS)
    wrong[("gpu_lost", 0)] = decision("gpu_lost", "evict_nodes", culprit_named=False, right=False, extra_machines=1)
    r = run("faultlens", failures=TWO[:1], decisions=wrong)
    # the healthy machine goes (5 + 3 s, standby used, 150 s restart, 500 s recompute); the GPU is still
    # gone, so the job stops again at once and people handle it: 60 + 510 + a wait for a machine (the only
    # standby is spent; the evicted healthy one returns 5,000 s after it left: a 768 s requeue is sooner)
    # + 150 + 500.
    assert r.lost_by_cause["detection"] == pytest.approx(5.0)
    assert r.lost_by_cause["recurrence"] == pytest.approx(60 + 510 + 768 + 150 + 500)
    assert r.standby_waits == 1 and r.machines_out == 2


@pytest.mark.parametrize(("healthy_return_s", "wait_s"), [(500.0, 500.0), (5000.0, 768.0)])
def test_group_over_eviction_waits_for_machines(healthy_return_s, wait_s):
    spec = CampaignSpec(gpus=9600, layout="70b-dense", days=1.0, checkpoint_interval_s=1000.0, restart_s=100.0,
                        reschedule_s=50.0, warm_standbys=5, healthy_return_s=healthy_return_s, repair_s=100000.0,
                        nccl_timeout_s=1800.0)
    hang = [Failure(t=1300.0, kind="hang_stuck_rank", bucket=0, u_localise=0.0, episode_s=0.0)]
    r = run("group_evict", failures=hang, spec=spec, decisions={})
    # zero RDMA traffic for 600 s, 50 s of stack aggregation, the whole 8-machine pipeline evicted with 5
    # standbys: 3 short, so the job waits for the healthy ones to come back or, sooner, for cold machines
    # from the cluster (the 768 s requeue); then it restarts (150 s) and recomputes the 300 s since the
    # checkpoint at 1,000 s.
    assert r.lost_by_cause == pytest.approx({"detection": 600.0, "localisation": 50.0, "standby_wait": wait_s,
                                             "restart": 150.0, "recompute": 300.0, "recurrence": 0.0,
                                             "degraded": 0.0})
    assert r.machines_out == 8 and r.standby_waits == 1


def test_oracle_is_the_floor_on_one_draw():
    costs = load_costs()
    spec = SPEC.resolved(costs)
    ettr = {p: run(p).ettr for p in ("none", "restart", "group_evict", "faultlens", "oracle")}
    assert ettr["oracle"] >= max(ettr.values()) - 1e-12
    assert ettr["restart"] < ettr["none"] < ettr["faultlens"]
    assert 0.9 < rsc_analytic_ettr(spec, load_mix(), restart_overhead_s=150.0) < 1.0


def test_sliding_window_and_ledger_add_up():
    r = run("none")
    assert set(r.lost_by_cause) == set(CAUSES)
    assert r.ettr == pytest.approx(1.0 - sum(r.lost_by_cause.values()) / DAY)
    ends, values = sliding_ettr(r.segments, 3600.0, 600.0)
    assert values.min() < 0.7 and values.max() == pytest.approx(1.0)


def test_mix_and_costs_name_their_sources_and_bad_kinds_are_named():
    mix = load_mix()
    assert {"hang_stuck_rank", "nan_loss", "user_exception", "thermal_throttle", "ib_flap_transient"} <= set(mix)
    assert all(k.source and k.rate_per_mgpuh > 0 for k in mix.values())
    assert all(c.source for table in load_costs().values() for c in table.values())
    with pytest.raises(ValueError, match="no failure kind not_a_kind"):
        load_mix(kinds=["gpu_lost", "not_a_kind"])


@pytest.mark.slow
def test_smoke_benchmark_runs_the_real_engine(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "ettr.py"), "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(out["ettr"]) == {"none", "restart", "group_evict", "faultlens", "oracle"}
    assert out["gap_to_oracle"]["oracle"] == 0.0
    assert out["decisions"] == 4 and out["decisions_right"] >= 3
    assert out["ettr"]["restart"] < out["ettr"]["faultlens"] <= out["ettr"]["oracle"] + 0.002
    assert (tmp_path / "ettr.html").read_text().count("<polyline") == 5


def test_cli_prints_every_cost_with_its_source(capsys):
    from faultlens.cli import main

    assert main(["simulate", "campaign", "--costs"]) == 0
    out = capsys.readouterr().out
    assert "job.restart_s" in out and "policy.none.hang_detect_s" in out and "BR Table 7" in out
