"""The campaign simulator (issues 25, 35): the accounting on campaigns small enough to compute by hand,
the policies on one draw, the sources of every number, outcomes drawn per failure, the error sweep, and
the --smoke benchmark end to end (real renders, real engine)."""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from faultlens.datasets.campaign import (
    CAUSES,
    COSTS_PATH,
    MIX_PATH,
    CampaignSpec,
    Failure,
    PolicyContext,
    draw_failures,
    load_costs,
    load_mix,
    sliding_ettr,
)
from faultlens.datasets.campaign_outcomes import Outcomes, classify, draw, wilson
from faultlens.datasets.campaign_policies import simulate_policy
from faultlens.datasets.campaign_render import Decision
from faultlens.datasets.campaign_run import CampaignRun, crossover, error_sweep, rsc_analytic_ettr

REPO = Path(__file__).resolve().parent.parent
DAY = 86400.0
# A one-day job with round costs; the policies' own numbers come from the shipped costs table
# (none: crash seen in 60 s + a 900 s page, localised in 120 + u * 780 s; checkpoint write 7 s).
SPEC = CampaignSpec(gpus=16, layout="8b-dense", days=1.0, checkpoint_interval_s=1000.0, restart_s=100.0,
                    reschedule_s=50.0, warm_standbys=1, healthy_return_s=5000.0, repair_s=100000.0,
                    nccl_timeout_s=1800.0)
WRITE = 7.0 / 1000.0  # checkpoint write per second of productive time


def decision(kind, action, **kw):
    base = dict(kind=kind, bucket=0, seed=0, expected_action="evict_nodes", action=action, detect_s=5.0,
                decide_s=3.0, named=1, culprit_named=True, extra_machines=0, right=True, adapt_ratio=None,
                adapt_pause_s=0.0, slow_speed=1.0, records=0, render_s=0.0, diagnose_s=0.0)
    base.update(kw)
    return Decision(**base)


OUTCOMES = {
    "gpu_lost": [decision("gpu_lost", "evict_nodes")],
    "thermal_throttle": [decision("thermal_throttle", "adapt_parallelism", detect_s=20.0, decide_s=10.0,
                                  adapt_ratio=0.9, adapt_pause_s=40.0, slow_speed=0.8)],
}
TWO = [Failure(t=2500.0, kind="gpu_lost", u_draw=0.0, u_localise=0.5, episode_s=0.0),
       Failure(t=50000.0, kind="thermal_throttle", u_draw=0.0, u_localise=0.0, episode_s=3600.0)]


def run(policy, failures=TWO, spec=SPEC, outcomes=OUTCOMES, error_rate=0.0):
    costs = load_costs()
    spec = spec.resolved(costs)
    return simulate_policy(spec, failures, load_mix(), policy, PolicyContext(spec, costs, outcomes, error_rate))


def lost_besides_checkpoint(r):
    return sum(v for c, v in r.lost_by_cause.items() if c != "checkpoint")


def test_two_failures_by_hand_on_call_human():
    r = run("none")
    # gpu_lost at 2,500 s: 500 s since the checkpoint at 2,000; seen in 60 s and paged (900 s), localised in
    # 120 + 0.5 * 780 = 510 s, one standby swapped in (restart 100 + reschedule 50), 500 s recomputed. The slow
    # GPU would be noticed on the dashboard after 4 h: its 3,600 s episode at speed 0.8 costs 720 s.
    lost = lost_besides_checkpoint(r)
    assert {c: v for c, v in r.lost_by_cause.items() if c != "checkpoint"} == pytest.approx(
        {"detection": 960.0, "localisation": 510.0, "standby_wait": 0.0, "restart": 150.0, "recompute": 500.0,
         "recurrence": 0.0, "degraded": 720.0})
    assert r.lost_by_cause["checkpoint"] == pytest.approx((DAY - lost) * WRITE)
    assert r.ettr == pytest.approx((DAY - lost) * (1 - WRITE) / DAY)
    assert r.machines_out == 1 and r.standby_waits == 0 and r.healthy_out == 0


def test_two_failures_by_hand_faultlens():
    r = run("faultlens")
    # gpu_lost: detected in 5 s (+ 1 s on the online path), decided in 3 s, same restart and recompute. thermal:
    # slow for 21 + 10 s (0.2 * 31 = 6.2 s), the plan's 40 s pause, then 3,529 s at the plan's 0.9 (352.9 s).
    assert {c: v for c, v in r.lost_by_cause.items() if c != "checkpoint"} == pytest.approx(
        {"detection": 6.0, "localisation": 3.0, "standby_wait": 0.0, "restart": 190.0, "recompute": 500.0,
         "recurrence": 0.0, "degraded": 359.1})
    assert r.outcomes["right"] == 2


def test_a_fault_that_recurs_at_once_is_recomputed_once():
    r = run("restart", failures=[Failure(t=2500.0, kind="user_exception", u_draw=0.0, u_localise=0.5,
                                         episode_s=0.0)])
    # a blind in-place restart (60 s seen, 100 s restart) fails again as it starts (recur_after_s 0): nothing
    # was recomputed, so the 500 s since the checkpoint are lost once. People then take 960 + 510 + 100 + 500.
    assert r.lost_by_cause["recompute"] == pytest.approx(0.0)
    assert r.lost_by_cause["recurrence"] == pytest.approx(960 + 510 + 100 + 500)
    assert (r.lost_by_cause["detection"], r.lost_by_cause["restart"]) == pytest.approx((60.0, 100.0))
    assert r.wrong == 1


def test_restart_policy_drains_a_health_checked_node():
    r = run("restart", failures=[Failure(t=2500.0, kind="gpu_lost", u_draw=0.0, u_localise=0.5, episode_s=0.0,
                                         u_check=0.5)])
    # RSC checks every 300 s: the node is drained 150 s after the failure; the job restarts on a standby
    assert r.lost_by_cause["detection"] + r.lost_by_cause["localisation"] == pytest.approx(150.0)
    assert r.lost_by_cause["recurrence"] == 0.0 and r.wrong == 0


def test_a_wrong_eviction_recurs_and_is_decided_again():
    wrong = decision("gpu_lost", "evict_nodes", culprit_named=False, right=False, extra_machines=1)
    f = Failure(t=2500.0, kind="gpu_lost", u_draw=0.0, u_localise=0.5, episode_s=0.0, u_redraw=0.9)
    r = run("faultlens", failures=[f], outcomes={"gpu_lost": [wrong, decision("gpu_lost", "evict_nodes")]})
    # the healthy machine goes (5 + 1 + 3 s, the one standby used, 150 s restart); the GPU is still gone, so the job
    # stops again as it starts and is decided again (a fresh draw, right this time): 9 s, a wait for a machine
    # (the shortfall rescheduled in 379 s, sooner than the healthy one's return), 150 s, the 500 s once.
    assert r.lost_by_cause["detection"] == pytest.approx(6.0)
    assert r.lost_by_cause["recompute"] == pytest.approx(0.0)
    assert r.lost_by_cause["recurrence"] == pytest.approx(9 + 379 + 150 + 500)
    assert r.standby_waits == 1 and r.machines_out == 2 and r.healthy_out == 1
    assert r.outcomes["wrong_machine"] == 1 and r.wrong == 1
    # wrong twice: people take over (paged on faultlens's detection: 5 + 1 + 900 s; 510 s by hand, another
    # shortfall wait)
    r = run("faultlens", failures=[f], outcomes={"gpu_lost": [wrong]})
    assert r.lost_by_cause["recurrence"] == pytest.approx(9 + 379 + 150 + 906 + 510 + 379 + 150 + 500)
    assert r.healthy_out == 2 and r.wrong == 2


@pytest.mark.parametrize(("u_recall", "fixed"), [(0.1, True), (0.9, False)])
def test_stop_time_checks_are_fallible(u_recall, fixed):
    diag = {"hung_task": [decision("hung_task", "run_diagnostics", expected_action="run_diagnostics", named=0)]}
    f = Failure(t=2500.0, kind="hung_task", u_draw=0.0, u_localise=0.0, episode_s=0.0, u_recall=u_recall)
    r = run("faultlens", failures=[f], outcomes=diag)
    # the checks take 168 s (BR Table 6's kernel row) after the 8 s decision; with recall 0.70 they find the machine (u < 0.7) or pass,
    # and the in-place reattempt leaves the hang to recur; decided again, the same checks miss it again
    # (the same fault), then people
    assert r.lost_by_cause["localisation"] == pytest.approx(3.0 + 168.0)
    assert (r.lost_by_cause["recurrence"] == 0.0) is fixed and r.wrong == (0 if fixed else 2)


@pytest.mark.parametrize(("healthy_return_s", "wait_s"), [(200.0, 200.0), (5000.0, 379.0)])
def test_group_over_eviction_waits_for_the_shortfall(healthy_return_s, wait_s):
    spec = CampaignSpec(gpus=9600, layout="70b-dense", days=1.0, checkpoint_interval_s=1000.0, restart_s=100.0,
                        reschedule_s=50.0, warm_standbys=5, healthy_return_s=healthy_return_s, repair_s=100000.0,
                        nccl_timeout_s=1800.0)
    hang = [Failure(t=1300.0, kind="hang_stuck_rank", u_draw=0.0, u_localise=0.0, episode_s=0.0)]
    r = run("group_evict", failures=hang, spec=spec, outcomes={})
    # zero RDMA traffic for 600 s, 50 s of stack aggregation, the whole 8-machine pipeline evicted with 5
    # standbys: 3 short, so the job waits for machines to come back or, sooner, for the shortfall to be
    # rescheduled (BR 8.2.1: 379 s); then it restarts (150 s) and recomputes the 300 s since the checkpoint.
    assert {c: v for c, v in r.lost_by_cause.items() if c != "checkpoint"} == pytest.approx(
        {"detection": 600.0, "localisation": 50.0, "standby_wait": wait_s, "restart": 150.0, "recompute": 300.0,
         "recurrence": 0.0, "degraded": 0.0})
    assert r.machines_out == 8 and r.healthy_out == 7 and r.standby_waits == 1


def test_group_eviction_is_not_charged_twice_for_a_restart():
    r = run("group_evict", failures=TWO[:1], outcomes={})
    # BR Table 3 sees a lost GPU in 10 s; Table 6's 10 s from localisation to restart is inside the
    # platform's own 150 s restart, so no localisation is charged on top
    assert (r.lost_by_cause["detection"], r.lost_by_cause["localisation"], r.lost_by_cause["restart"]) == \
        pytest.approx((10.0, 0.0, 150.0))


def test_outcomes_are_drawn_per_failure_not_one_cached_answer():
    two = {"gpu_lost": [decision("gpu_lost", "evict_nodes"),
                        decision("gpu_lost", "evict_nodes", culprit_named=False, right=False, extra_machines=1)]}
    assert draw(two["gpu_lost"], 0.2).right and not draw(two["gpu_lost"], 0.7).right
    fs = [Failure(t=3000.0 + 3000.0 * i, kind="gpu_lost", u_draw=(i * 0.37) % 1.0, u_localise=0.5, episode_s=0.0,
                  u_redraw=0.0)
          for i in range(20)]
    r = run("faultlens", failures=fs, outcomes=two)
    assert r.outcomes["right"] + r.outcomes["wrong_machine"] == 20
    assert 5 <= r.outcomes["wrong_machine"] <= 15 and r.healthy_out == r.outcomes["wrong_machine"]
    assert classify(two["gpu_lost"][1], 300.0) == "wrong_machine"
    assert classify(decision("gpu_lost", "evict_nodes", detect_s=400.0), 300.0) == "late"
    assert classify(decision("gpu_lost", "none", detect_s=None, right=False), 300.0) == "missed"


def test_wilson_interval():
    lo, hi = wilson(40, 40)
    assert hi == 1.0 and lo == pytest.approx(0.912, abs=0.001) and (hi - lo) / 2 < 0.05
    assert wilson(0, 0) == (0.0, 1.0)
    lo, hi = wilson(20, 40)
    assert lo < 0.5 < hi and hi - lo == pytest.approx(0.30, abs=0.01)


def _all_right(mix):
    out = {}
    for k in mix.values():
        expected = {"fail_slow": "adapt_parallelism", "transient": "none"}.get(k.fault_class, "evict_nodes")
        if k.rendered == "user_exception":
            expected = "rollback_code"
        if k.job_wide:
            expected = "notify"
        d = decision(k.rendered, expected, expected_action=expected, adapt_ratio=0.95, slow_speed=0.7,
                     named=0 if expected in ("none", "notify", "rollback_code") else 1)
        out[k.rendered] = [d]
    return out


def test_error_sweep_is_monotone_and_crossover_interpolates():
    costs = load_costs()
    mix = load_mix()
    spec = CampaignSpec(days=20.0).resolved(costs)
    outcomes = _all_right(mix)
    draws = [draw_failures(spec, mix, s) for s in (0, 1)]
    run_ = CampaignRun(spec, [0, 1], {}, Outcomes(outcomes, 300.0), draws, mix, costs, {})
    sweep = error_sweep(run_, (0.0, 0.1, 0.2, 0.3))
    values = [e for _, e in sweep]
    assert all(b <= a + 1e-9 for a, b in zip(values, values[1:], strict=False)), values
    assert values[-1] < values[0] - 1e-4
    assert crossover([(0.0, 0.95), (0.1, 0.93)], 0.94) == pytest.approx(0.05)
    assert crossover([(0.0, 0.95), (0.1, 0.94)], 0.90) is None
    assert crossover([(0.0, 0.95)], 0.96) == 0.0


def test_oracle_is_the_floor_on_one_draw():
    costs = load_costs()
    spec = SPEC.resolved(costs)
    ettr = {p: run(p).ettr for p in ("none", "restart", "group_evict", "faultlens", "oracle")}
    assert ettr["oracle"] >= max(ettr.values()) - 1e-12
    assert ettr["none"] < ettr["faultlens"]
    assert 0.9 < rsc_analytic_ettr(spec, load_mix(), restart_overhead_s=150.0) < 1.0


def test_sliding_window_and_ledger_add_up():
    r = run("none")
    assert set(r.lost_by_cause) == set(CAUSES)
    assert r.ettr == pytest.approx(1.0 - sum(r.lost_by_cause.values()) / DAY)
    ends, values = sliding_ettr(r.segments, 3600.0, 600.0)
    assert values.min() < 0.7 and values.max() == pytest.approx(1.0)


def _numbers(node, path=""):
    """(path, table holding it, key) of every number in a TOML tree."""
    if isinstance(node, dict):
        for k, v in node.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                yield f"{path}.{k}", node, k
            elif isinstance(v, (dict, list)):
                yield from _numbers(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                yield f"{path}[{i}]", None, i


@pytest.mark.parametrize("path", [MIX_PATH, COSTS_PATH], ids=["failure_mix", "campaign_costs"])
def test_every_number_has_a_source_or_an_assumed_range(path):
    raw = tomllib.loads(path.read_text())
    bad = []
    for where, table, key in _numbers(raw):
        if table is None:
            continue  # a range's bounds: checked with their value below
        if key != "value":
            bad.append(f"{where}: a bare number (write {{ value = ..., source = ... }})")
            continue
        if not str(table.get("source", "")).strip():
            bad.append(f"{where}: no source")
        elif table.get("assumed"):
            rng = table.get("range")
            if not (isinstance(rng, list) and len(rng) == 2 and rng[0] <= table["value"] <= rng[1]):
                bad.append(f"{where}: assumed without a range around it")
        elif "assumed" in table["source"].lower():
            bad.append(f"{where}: says assumed in its source but is not marked assumed = true")
    assert not bad, "\n".join(bad)


def test_an_unmarked_number_is_refused(tmp_path):
    p = tmp_path / "costs.toml"
    p.write_text('[job]\nrestart_s = { value = 120, assumed = true, source = "a guess" }\n')
    with pytest.raises(ValueError, match="restart_s: assumed needs range"):
        load_costs(p)
    p.write_text("[job]\nrestart_s = 120\n")
    with pytest.raises(ValueError, match="every number needs"):
        load_costs(p)


def test_mix_matches_llama3_per_category_and_keeps_sram_gsp_sdc():
    mix = load_mix()
    assert {"gpu_sram", "gpu_system_processor", "silent_data_corruption", "hang_stuck_rank", "user_exception",
            "thermal_throttle", "ib_flap_transient"} <= set(mix)
    stopping = sum(k.rate_per_mgpuh for k in mix.values() if k.fault_class in ("fail_stop", "hang", "nan"))
    assert stopping == pytest.approx(19.7, abs=0.05)  # LLAMA3: 419 in 54 days on 16,384 GPUs
    assert mix["gpu_sram"].rendered == "ecc_uncorrectable" and mix["silent_data_corruption"].rendered == "nan_loss"
    half = load_mix(overrides={"kind.gpu_lost.share": 0.5})
    assert half["gpu_lost"].rate_per_mgpuh == pytest.approx(half["nvlink_error"].rate_per_mgpuh)
    with pytest.raises(ValueError, match="no failure kind not_a_kind"):
        load_mix(kinds=["gpu_lost", "not_a_kind"])


@pytest.mark.slow
def test_smoke_benchmark_runs_the_real_engine(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "ettr.py"), "--smoke", "--samples", "3",
                           "--days", "60", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=400, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(out["ettr"]) == {"none", "restart", "group_evict", "faultlens", "oracle"}
    assert out["gap_to_oracle"]["oracle"] == 0.0
    assert out["renders"] == 12 and set(out["per_kind_accuracy"]) == {"gpu_lost", "thermal_throttle",
                                                                       "user_exception", "ib_flap_transient"}
    assert all(0.0 <= v["lo"] <= v["right"] <= v["hi"] <= 1.0 for v in out["per_kind_accuracy"].values())
    assert out["ettr"]["none"] < out["ettr"]["faultlens"] <= out["ettr"]["oracle"] + 0.002
    assert "crossover" in out and len(out["sweep"]) == 7
    assert (tmp_path / "ettr.html").read_text().count("<polyline") == 5


def test_cli_prints_every_cost_with_its_source(capsys):
    from faultlens.cli import main

    assert main(["simulate", "campaign", "--costs"]) == 0
    out = capsys.readouterr().out
    assert "job.restart_s" in out and "policy.none.page_s" in out and "BR Table 7" in out and "assumed" in out


def test_measured_decisions_are_read_back_by_code_digest(tmp_path):
    from faultlens.datasets.campaign_outcomes import _cache_file, code_digest, measure

    spec = CampaignSpec(gpus=1024, layout="8b-dense").resolved(load_costs())
    layout = spec.slice_layout()
    digest = code_digest()
    path = _cache_file(tmp_path, digest, layout, 1800.0, 128, "gpu_lost")
    rows = [decision("gpu_lost", "evict_nodes", bucket=i, right=i != 1) for i in range(3)]
    path.write_text("".join(json.dumps(d.as_dict()) + "\n" for d in rows) + '{"torn": ')
    out = measure({"gpu_lost": "fail_stop"}, layout, nccl_timeout_s=1800.0, job_dp=128, late_after_s=300.0,
                  cache_dir=tmp_path, cached_only=True)
    assert out.rendered == 0 and out.cached == 3 and out.digest == digest
    assert [d.right for d in out.by_kind["gpu_lost"]] == [True, False, True]
    assert out.accuracy("gpu_lost")[3] == 3 and out.counts("gpu_lost")["wrong_machine"] == 1
    # another digest (the code changed) is another file: nothing read back from this one
    assert _cache_file(tmp_path, "0" * 16, layout, 1800.0, 128, "gpu_lost") != path


def test_group_eviction_sees_a_hung_task_when_the_kernel_writes_it():
    # faultlens's hang incident opened 50 s after the stall; the kernel's line comes at 120 s
    diag = {"hung_task": [decision("hung_task", "run_diagnostics", expected_action="run_diagnostics", detect_s=50.0)]}
    f = Failure(t=2500.0, kind="hung_task", u_draw=0.0, u_localise=0.0, episode_s=0.0)
    assert run("group_evict", failures=[f], outcomes=diag).lost_by_cause["detection"] == pytest.approx(120.0)


def test_people_taking_over_from_faultlens_are_paged_on_its_detection():
    # the checks miss twice (u_recall 0.9): people take the hang over, paged when faultlens sees it again
    # (5 s + 1 s online path + the 900 s page), not after the 1,800 s NCCL timeout policy none waits for
    diag = {"hung_task": [decision("hung_task", "run_diagnostics", expected_action="run_diagnostics", named=1)]}
    f = Failure(t=2500.0, kind="hung_task", u_draw=0.0, u_localise=0.0, episode_s=0.0, u_recall=0.9)
    r = run("faultlens", failures=[f], outcomes=diag)
    none = run("none", failures=[f], outcomes=diag)
    assert none.lost_by_cause["detection"] == pytest.approx(1800.0 + 60.0 + 900.0)
    assert r.lost_by_cause["detection"] == pytest.approx(6.0)
    # recurrence: the second look (6 + 3 + 168 s), people paged (6 + 900 s) who localise the named machine as
    # an explicit fault (120 s at u_localise 0, not the 1,800 s hunt of a hang), two restarts (100 + 100 + 50 s)
    # and the recompute since the last checkpoint at each stop (100 s, then 700 s: 1,000 s checkpoints)
    assert r.lost_by_cause["recurrence"] == pytest.approx(6 + 3 + 168 + 100 + 100 + 6 + 900 + 120 + 150 + 700)


def test_the_online_path_is_charged_per_kind_from_its_bus_check_never_below_the_floor():
    """What the bus check measured beyond the batch decision is added to every faultlens decision of the kind;
    a kind the online path decides sooner (a hang whose ranks answer the stack request) still pays the floor."""
    from faultlens.datasets.campaign_run import online_extra

    costs = load_costs()
    spec = SPEC.resolved(costs)
    floor = costs["policy.faultlens"]["online_latency_s"].value
    b = decision("gpu_lost", "evict_nodes", detect_s=5.0, decide_s=3.0)
    late = decision("gpu_lost", "evict_nodes", detect_s=9.0, decide_s=20.0, path="bus")
    hang = decision("hang_stuck_rank", "evict_nodes", detect_s=60.0, decide_s=180.0)
    quick = decision("hang_stuck_rank", "evict_nodes", detect_s=60.0, decide_s=9.0, path="bus")
    other = decision("nan_loss", "run_diagnostics")
    differs = decision("nan_loss", "restart_job", path="bus")
    extra = online_extra([(b, late), (hang, quick), (other, differs)])
    assert extra == {"gpu_lost": 21.0, "hang_stuck_rank": -171.0}  # a different action is not a delay
    ctx = PolicyContext(spec, costs, OUTCOMES, online_extra_s=extra)
    assert ctx.online_latency("gpu_lost") == 21.0
    assert ctx.online_latency("hang_stuck_rank") == floor == ctx.online_latency("nan_loss")
    slow = simulate_policy(spec, TWO[:1], load_mix(), "faultlens", ctx)
    fast = simulate_policy(spec, TWO[:1], load_mix(), "faultlens", PolicyContext(spec, costs, OUTCOMES))
    assert lost_besides_checkpoint(slow) == pytest.approx(lost_besides_checkpoint(fast) + 21.0 - floor)


def test_the_bus_check_reads_its_cache_and_renders_nothing_when_asked_for_the_cache_only(tmp_path):
    from faultlens.datasets.campaign_run import _bus_file, bus_check

    spec = SPEC.resolved(load_costs())
    layout = spec.slice_layout()
    pair = [decision("gpu_lost", "evict_nodes").as_dict(), decision("gpu_lost", "evict_nodes", path="bus").as_dict()]
    _bus_file(tmp_path, "d1", layout.key, spec.get("nccl_timeout_s"), "gpu_lost").write_text(json.dumps(pair))
    got = bus_check(spec, load_mix(), 0, cached_only=True, cache_dir=tmp_path, digest="d1")
    assert [(b.kind, on.path) for b, on in got] == [("gpu_lost", "bus")]
    assert bus_check(spec, load_mix(), 0, cached_only=True, cache_dir=tmp_path, digest="d2") == []  # another digest
