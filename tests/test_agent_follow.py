"""Followers: rotation, truncation, partial and binary lines, globs, restart positions, /dev/kmsg format."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from faultlens.collectors.follow import FileFollower
from faultlens.collectors.kernel import KernelParser
from faultlens.collectors.kernel_follow import JournalReader, KmsgReader
from faultlens.errors import NoData, SourceError
from tests.conftest import FIXTURES


def _append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def test_partial_lines_wait_for_their_newline(tmp_path: Path) -> None:
    p = tmp_path / "a.log"
    p.write_bytes(b"")
    f = FileFollower(str(p))
    assert f.poll() == []
    _append(p, b"first line\nsecond ha")
    assert f.poll() == ["first line"]
    _append(p, b"lf\r\n")
    assert f.poll() == ["second half"]
    assert f.poll() == []


def test_from_end_skips_history_but_not_new_files(tmp_path: Path) -> None:
    old = tmp_path / "old.log"
    old.write_text("history\n")
    f = FileFollower(str(tmp_path / "*.log"), from_end=True, rescan_interval_s=0)
    assert f.poll() == []
    _append(old, b"new\n")
    (tmp_path / "later.log").write_text("from a file that appeared later\n")
    assert sorted(f.poll()) == ["from a file that appeared later", "new"]


def test_rotation_by_rename_reads_old_file_to_its_end_first(tmp_path: Path) -> None:
    p = tmp_path / "kern.log"
    p.write_text("a\n")
    f = FileFollower(str(p))
    assert f.poll() == ["a"]
    _append(p, b"b\nunterminated")
    os.rename(p, tmp_path / "kern.log.1")
    p.write_text("c\n")
    assert f.poll() == ["b", "unterminated", "c"]
    assert f.rotations == 1
    _append(p, b"d\n")
    assert f.poll() == ["d"]


def test_truncation_restarts_at_zero(tmp_path: Path) -> None:
    p = tmp_path / "nccl.log"
    p.write_text("one\ntwo\nthree\n")
    f = FileFollower(str(p))
    assert f.poll() == ["one", "two", "three"]
    with open(p, "wb") as fh:  # copytruncate
        fh.write(b"x\n")
    assert f.poll() == ["x"]
    assert f.truncations == 1


def test_binary_bytes_are_replaced_and_counted(tmp_path: Path) -> None:
    p = tmp_path / "bin.log"
    p.write_bytes(b"ok\n\xff\xfe NVRM: Xid \x00 junk\nok again\n")
    f = FileFollower(str(p))
    lines = f.poll()
    assert lines[0] == "ok" and lines[2] == "ok again"
    assert "\ufffd" in lines[1] and "NVRM: Xid" in lines[1]
    assert f.invalid_utf8_lines == 1


def test_positions_survive_a_restart(tmp_path: Path) -> None:
    p = tmp_path / "steps.jsonl"
    p.write_text("1\n2\n")
    f = FileFollower(str(p))
    assert f.poll() == ["1", "2"]
    _append(p, b"3\npart")
    assert f.poll() == ["3"]
    state = f.state()
    f.close()
    _append(p, b"ial\n4\n")
    g = FileFollower(str(p), from_end=True)
    g.restore(state)
    assert g.poll() == ["partial", "4"]


def test_kmsg_recorded_file_to_kernel_events() -> None:
    reader = KmsgReader(str(FIXTURES / "kmsg" / "recorded" / "input.kmsg"), from_end=False)
    lines = reader.poll()
    assert all(not ln.startswith(" SUBSYSTEM") and "DEVICE=" not in ln for ln in lines)
    assert reader.missed == 2  # sequence 1204 and 1205 were overwritten before they were read
    events = list(KernelParser("n1", boot_time=1_700_000_000.0).parse(lines))
    kinds = [e.kind for e in events]
    assert kinds.count("xid") == 2 and "ib_link_down" in kinds and "fell_off_bus" in kinds
    x79 = next(e for e in events if e.xid == 79)
    assert x79.pci_bus == "0000:3b:00" and x79.pid == 1912
    assert x79.ts == pytest.approx(1_700_000_000.0 + 3138765.887948)
    x94 = next(e for e in events if e.xid == 94)
    assert "escaped continuation" in x94.message  # \x0a in a kmsg record is a newline of the same record


def test_kmsg_missing_device_is_no_data(tmp_path: Path) -> None:
    with pytest.raises(NoData):
        KmsgReader(str(tmp_path / "no-kmsg"))


def test_journal_reader_turns_entries_into_kernel_lines(tmp_path: Path) -> None:
    feed = tmp_path / "journal.json"
    feed.write_text('{"MESSAGE": "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.", '
                    '"__REALTIME_TIMESTAMP": "1700000000000000", "_HOSTNAME": "gpu7"}\nnot json\n')
    r = JournalReader(command=["cat", str(feed)])
    got: list[str] = []
    deadline = time.monotonic() + 10
    while len(got) < 2 and time.monotonic() < deadline:
        got += r.poll()
        time.sleep(0.01)
    with pytest.raises(SourceError, match="exited"):  # the feed ended: a dead journalctl is an error, not silence
        r.poll()
    r.close()
    assert got[0].startswith("2023-11-14T22:13:20") and "gpu7 kernel: NVRM: Xid" in got[0]
    assert r.bad_entries == 1 and got[1] == "not json"
    ev = list(KernelParser("gpu7").parse(got[:1]))[0]
    assert ev.xid == 79 and ev.ts == pytest.approx(1_700_000_000.0)
