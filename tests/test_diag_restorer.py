"""The background restorer reads changelog partitions off the service's thread; a revoked one is dropped."""

from __future__ import annotations

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
