"""The background restorer reads changelog partitions off the service's thread; a revoked one is dropped."""

from __future__ import annotations

import pytest

from faultlens.config import BusConfig, Config
from faultlens.diagnosis.online.restorer import BackgroundRestorer
from faultlens.diagnosis.online.state import MARK_KEY, ChangelogReader, Restored, mark_value
from faultlens.stream.bus import Producer, ensure_topics


def test_reads_come_back_and_a_cancelled_partition_is_dropped(bus: BusConfig) -> None:
    ensure_topics(bus)
    config = Config(bus=bus)
    with Producer(bus) as p:
        p.send_raw("diag-changelog", "job-a", b"state-a", partition=2)
        p.send_raw("diag-changelog", MARK_KEY, mark_value(17, 1234.5), partition=2)
        p.flush(10)
    restorer = BackgroundRestorer(lambda: ChangelogReader(config, None))
    try:
        restorer.submit(5)
        restorer.cancel(5)  # revoked before its read came back: never installed
        restorer.submit(2)
        assert restorer.wait(30)
        done = restorer.done()
        assert [p for p, _, _ in done] == [2]
        result = done[0][1]
        assert isinstance(result, Restored)
        assert result.values == {"job-a": b"state-a"}
        assert result.mark is not None and result.mark["next_offset"] == 17
        assert restorer.pending == set() and restorer.done() == []
    finally:
        restorer.close()


def test_a_moved_partition_decodes_a_job_at_its_first_record_and_the_rest_between_rounds() -> None:
    """The restore of issue 27: a Xid on one job of a moved partition waits for that job's state alone."""
    import time

    from faultlens.diagnosis.online import DiagnosisService
    from faultlens.diagnosis.online.state import JobState, snapshot

    service = DiagnosisService(Config())  # not started: its install and decode steps alone
    jobs = [f"job{i}" for i in range(12)]
    values = {}
    for i, key in enumerate(jobs):
        st = JobState(key, 3, service.make_engine(key), next_offset=100 + i)
        values[key] = snapshot(st)
    values["broken"] = b"not a checkpoint"
    service._install(3, Restored(values, None, len(values), 0.01), time.monotonic())
    assert 3 in service.partitions and service.states == {} and len(service._undecoded) == 13
    st = service._state("job5", 3)  # its first record arrives
    assert st.next_offset == 105 and set(service.states) == {"job5"} and len(service._undecoded) == 12
    service.tick_interval_s = 3600.0
    for _ in range(200):  # rounds: the others come in a few at a time, the broken one counted
        service._tick()
        if not service._undecoded:
            break
    assert set(service.states) == set(jobs) and service.unreadable_checkpoints == 1
    assert service.states["job11"].next_offset == 111
    service._on_revoked([3])
    assert service.states == {} and service._undecoded == {}


def test_a_keyed_changelog_obeys_only_what_diagnosis_sealed_for_that_place(bus: BusConfig) -> None:
    """Issue 37.5: a forged marker with a high offset (unsigned, sealed with another key, or a genuine
    one copied from another partition) must not make a new owner skip records; nor a forged checkpoint
    or tombstone replace a job's state. Each is reported as unverified; the genuine record stands."""
    from faultlens.diagnosis.online.state import changelog_context
    from faultlens.stream.signing import Keyring, new_key, seal, unseal

    ensure_topics(bus)
    ours, theirs = Keyring([new_key("diag")]), Keyring([new_key("mallory")])
    # a partition of its own: other tests of the session write diag-changelog partitions 2 and 5
    p, other = 7, 8
    with Producer(bus) as prod:
        prod.send_raw("diag-changelog", "job-k", seal(ours, b"state-k", changelog_context(p, "job-k")), partition=p)
        prod.send_raw("diag-changelog", MARK_KEY, seal(ours, mark_value(17, 1.0), changelog_context(p, MARK_KEY)),
                      partition=p)
        high = mark_value(10**12, 2.0)
        for value in (high, seal(theirs, high, changelog_context(p, MARK_KEY)),
                      seal(ours, high, changelog_context(other, MARK_KEY))):  # genuine, for another partition
            prod.send_raw("diag-changelog", MARK_KEY, value, partition=p)
        prod.send_raw("diag-changelog", "job-k", b"forged-state", partition=p)
        prod.send_raw("diag-changelog", "job-k", None, partition=p)  # a tombstone: cannot be sealed
        prod.flush(10)
    reader = ChangelogReader(Config(bus=bus), None, ours)
    try:
        got = reader.read(p, timeout_s=30)
    finally:
        reader.close()
    assert got.mark is not None and got.mark["next_offset"] == 17
    assert got.values == {"job-k": b"state-k"}
    reasons = sorted(why.split(":")[0] for _, _, why, _ in got.unverified)
    assert reasons == ["bad_signature", "unknown_key", "unsigned", "unsigned", "unsigned"], got.unverified
    # the seal binds the place: the same bytes do not open for another key or partition
    sealed = seal(ours, b"x", changelog_context(p, "job-k"))
    assert unseal(ours, sealed, changelog_context(p, "job-k")) == b"x"
    for ctx in (changelog_context(p, "job-j"), changelog_context(other, "job-k")):
        with pytest.raises(Exception, match="does not match"):
            unseal(ours, sealed, ctx)
