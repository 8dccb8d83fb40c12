"""The shipped inhibition rules (diagnosis/catalogs/inhibit.toml): what a cause may mute."""

from __future__ import annotations

from faultlens.diagnosis.inhibit import Cause, Inhibitor

T = 1_700_000_000.0


def test_a_slow_machine_mutes_the_jobs_slowdown_never_its_hang_or_exception() -> None:
    """A fail-slow verdict (on a real CPU job, sometimes a false one) muted a real hang on another
    machine and the job's exception (issue 33): a slow machine stretches steps, it does not stop them."""
    inh = Inhibitor()
    inh.note_cause(Cause("fail_slow", "j1", "vn3", T, "inc-slow"))
    assert inh.muted_by("hang", "symptom", "j1", None, T + 60) is None
    assert inh.muted_by("user_exception", "symptom", "j1", "vn1", T + 60) is None
    assert inh.muted_by("ib_link", "symptom", "j1", "vn2", T + 60) is None
    rule, cause = inh.muted_by("slow_storage", "job", "j1", None, T + 60) or ("", None)
    assert rule == "slow_machine_mutes_job_slowdown" and cause is not None and cause.incident_id == "inc-slow"
    assert inh.muted_by("peer_outlier", "symptom", "j1", "vn3", T + 60) is not None


def test_a_lost_machine_still_mutes_the_hang_it_causes() -> None:
    inh = Inhibitor()
    inh.note_cause(Cause("gpu_lost", "j1", "vn1", T, "inc-xid79"))
    assert inh.muted_by("hang", "symptom", "j1", None, T + 60) is not None
    assert inh.muted_by("hang", "symptom", "j2", None, T + 60) is None  # another job's hang is its own
