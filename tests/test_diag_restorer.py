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
