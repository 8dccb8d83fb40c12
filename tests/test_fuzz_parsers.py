"""Every parser is total (issue 19): for any input it returns records, nothing, or an unparsed
record with the reason, never an exception.

Hypothesis feeds each parser mutated real lines (tests/fuzzgen.py: the repository's fixtures
and the conformance corpus, changed a little) and arbitrary text; the decoder gets mutated
JSON and arbitrary bytes. Deterministic (derandomize, no example database) and bounded
(FAULTLENS_FUZZ_EXAMPLES examples a property, default 100). Each line that ever crashed
something is in tests/fixtures/fuzz_regressions/ and checked here on every run.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from faultlens import decode
from faultlens.collectors.kernel import KernelEvent, KernelParser
from faultlens.collectors.nccl import NcclParser
from faultlens.collectors.nvsmi_text import normalize
from faultlens.collectors.steps import StepLogParser, parse_step_line
from faultlens.collectors.unparsed import (
    MAX_LINE_BYTES,
    UnparsedLog,
    guarded_parse,
    read_lines,
    sniff_binary,
    to_int,
)
from faultlens.diagnosis.explain import explain_lines
from faultlens.errors import SchemaError
from faultlens.schema import NcclEvent
from tests.fuzzgen import mutate, mutate_bytes, seed_lines

EXAMPLES = int(os.environ.get("FAULTLENS_FUZZ_EXAMPLES", "100"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck), print_blob=True)
FORMATS = ("kernel", "nccl", "steps", "stack", "nvsmi", None)
REGRESSIONS = [json.loads(x) for x in
               (Path(__file__).parent / "fixtures" / "fuzz_regressions" / "cases.jsonl").read_text().splitlines() if x]


def mutated(*sources: str) -> st.SearchStrategy[str]:
    """A real line of ``sources`` changed 1-3 times (seeded by Hypothesis, so it shrinks to the seed)."""
    return st.builds(lambda line, seed: mutate(line, random.Random(seed)),
                     st.sampled_from(seed_lines(*sources)), st.integers(0, 2**32 - 1))


def log_of(*sources: str) -> st.SearchStrategy[list[str]]:
    """A few lines: mutated real ones, untouched real ones and arbitrary text, split on newlines."""
    one = st.one_of(mutated(*sources), mutated(*sources), st.sampled_from(seed_lines(*sources)), st.text(max_size=120))
    return st.lists(one, min_size=1, max_size=25).map(lambda ls: "\n".join(ls).split("\n"))


def _parse_both_ways(make, lines: list[str]) -> None:
    """``feed``/``flush`` and the fast path ``feed_many``/``finish`` both answer, with records only."""
    cls = KernelEvent if isinstance(make(), KernelParser) else NcclEvent
    p = make()
    recs = [r for line in lines for r in p.feed(line)] + p.flush()
    assert all(isinstance(r, cls) and r.raw for r in recs)
    q = make()
    items = q.feed_many(lines) + q.finish()
    assert all(isinstance(r, (cls, int)) for r in items)


def _explain_answers(lines: list[str], fmt: str | None) -> None:
    out = list(explain_lines(lines, fmt))
    assert [e.line_no for e in out] == list(range(1, len(lines) + 1))
    for e, line in zip(out, lines, strict=True):
        if len(line) <= MAX_LINE_BYTES:
            assert e.text == line.rstrip("\r\n")
        assert e.c.category and e.c.meaning
        e.to_json()


@FUZZ
@given(log_of("kernel"))
def test_kernel_parser_is_total(lines):
    _parse_both_ways(lambda: KernelParser("n1", boot_time=1.7e9), lines)
    _parse_both_ways(lambda: KernelParser(), lines)


@FUZZ
@given(log_of("nccl"))
def test_nccl_parser_is_total(lines):
    _parse_both_ways(lambda: NcclParser("n1", job="j", default_ts=float("nan")), lines)


@FUZZ
@given(log_of("steps", "nccl"))
def test_step_lines_are_total(lines):
    p = StepLogParser()
    for line in lines:
        got = parse_step_line(line)
        assert got is None or (isinstance(got[0], str) and isinstance(got[1], dict))
        p.feed(line)
    p.flush()


@FUZZ
@given(log_of("nvsmi"))
def test_nvsmi_normalize_is_total(lines):
    assert len(list(normalize(lines))) == len(lines)


@FUZZ
@given(st.sampled_from(FORMATS), log_of("kernel", "nccl", "steps", "stack", "nvsmi"))
def test_explain_answers_every_line(fmt, lines):
    _explain_answers(lines, fmt)


def _decodes_or_says_why(kind: str, payload: bytes) -> None:
    try:
        decode.decode(kind, payload, issues=[])
    except SchemaError as exc:
        assert exc.reason


@FUZZ
@given(st.sampled_from(("gpu", "steps", "kernel", "nccl", "jobs")), mutated("gpu"), st.integers(0, 2**32 - 1))
def test_decoder_is_total_on_mutated_records(kind, text, seed):
    raw = text.encode("utf-8", "surrogateescape")
    _decodes_or_says_why(kind, raw)
    _decodes_or_says_why(kind, mutate_bytes(raw, random.Random(seed)))


@FUZZ
@given(st.sampled_from(("gpu", "steps", "kernel")), st.binary(max_size=300))
def test_decoder_is_total_on_bytes(kind, payload):
    _decodes_or_says_why(kind, payload)
    _decodes_or_says_why(kind, b"\x81\xa1" + payload)  # a MessagePack map head


@FUZZ
@given(log_of("kernel", "nccl"))
def test_guarded_parse_keeps_going(lines):
    log = UnparsedLog()
    for make, src in ((KernelParser, "kernel"), (NcclParser, "nccl")):
        list(guarded_parse(make(), lines, src, log))
    assert log.count == len(log.first) or len(log.first) == log.keep


@FUZZ
@given(st.binary(max_size=2000))
def test_read_lines_and_sniff_on_any_bytes(data):
    import io

    sniff_binary(data)
    lines = list(read_lines(io.BufferedReader(io.BytesIO(data))))
    assert len(lines) == data.count(b"\n") + (0 if data.endswith(b"\n") or not data else 1)


@pytest.mark.parametrize("case", REGRESSIONS, ids=[c["id"] for c in REGRESSIONS])
def test_regression(case, tmp_path):
    """Every line that once crashed something, through everything."""
    line = case["line"]
    lines = [line, "[ 12.5] NVRM: Xid (PCI:0000:05:00): 79, pid=1, GPU has fallen off the bus.", line]
    _parse_both_ways(KernelParser, lines)
    _parse_both_ways(NcclParser, lines)
    parse_step_line(line)
    list(normalize(lines))
    for fmt in FORMATS:
        _explain_answers(lines, fmt)
    for kind in ("gpu", "steps", "kernel"):
        _decodes_or_support(kind, line)
    for e in explain_lines(lines, case["source"] if case["source"] in FORMATS else None):
        # what explain --json writes with orjson: no integer beyond 64 bits (the CLI's text is UTF-8 by then)
        orjson.dumps({**e.to_json(), "text": e.text.encode("utf-8", "replace").decode()})


def _decodes_or_support(kind: str, line: str) -> None:
    _decodes_or_says_why(kind, line.encode("utf-8", "surrogateescape"))


def test_known_crash_line_is_explained_not_raised():
    """issue 19's line: a dmesg -T stamp whose month is not a month is still an Xid 79."""
    (e,) = explain_lines(["[Sat Qct 12 18:35:32 2024] NVRM: Xid (PCI:0000:05:00): 79, pid='<unknown>', "
                          "name=<unknown>, GPU has fallen off the bus."], "kernel")
    assert e.c.xid == 79 and e.c.action == "evict_node"


def test_ten_megabyte_lines_and_deep_nesting():
    """A 10 MB line is answered (cut, unparsed with the reason); deep JSON is a step line that does not decode."""
    big = "NVRM: Xid (PCI:0000:05:00): 79, " + "A" * 10_000_000
    for fmt in FORMATS:
        out = list(explain_lines(["ok", big, "[ 1.0] NVRM: Xid (PCI:0000:05:00): 79, pid=1, GPU has fallen off the bus."], fmt))
        assert len(out) == 3 and out[1].c.rule == "unparsed" and "too long" in out[1].c.meaning
        assert len(out[1].text) < 1000
    deep = '{"step": ' + "[" * 100_000 + "]" * 100_000 + "}"
    (e,) = explain_lines([deep], "steps")
    assert e.c.category == "unknown"
    _decodes_or_says_why("steps", deep.encode())
    # the parsers themselves stay usable on a line of 2 MB (the agent cuts at 1 MiB; they need not)
    for fill in ("A", " ", "0", "[", ":", "\x00"):
        line = "[rank0]:[E ProcessGroupNCCL.cpp:1316] NCCL WARN NVRM: Xid " + fill * 2_000_000
        _parse_both_ways(KernelParser, [line])
        _parse_both_ways(NcclParser, [line])
        assert parse_step_line("iteration 5/ 10 | " + line) is None or True


def test_unparsed_log_counts_and_keeps():
    log = UnparsedLog(keep=2)
    for i in range(5):
        log.add("f", i, "ValueError: bad 12" if i % 2 else "not UTF-8 (kept)", "x" * 1000)
    assert log.count == 5 and len(log.first) == 2 and len(log.first[0].raw) < 500
    assert log.by_reason == {"not UTF-8": 3, "ValueError: bad": 2}
    assert "5 input line(s)" in log.summary()[0]
    assert to_int("9" * 19) is None and to_int("²") is None and to_int("12") == 12


def test_time_beyond_any_calendar_is_a_dead_letter_not_a_stopped_processor():
    """benchmarks/hostile.py found it: a gpu sample with ts 4.9e44 decoded, then the lake's hour split
    (int64) failed and the stream processor stopped ("cannot continue safely"). Now a dead letter."""
    from types import SimpleNamespace

    from faultlens import schema
    from faultlens.stream import decode_arrow

    huge = schema.GpuSample(ts=4.9e44, node="n", gpus=[schema.GpuState(index=0)])
    ok = schema.GpuSample(ts=1.7e9, node="n", gpus=[schema.GpuState(index=0)])
    for payload in (schema.encode(huge), decode.encode_wire(huge), b'{"v":1,"ts":"4.9e44","node":"n","gpus":[]}'):
        with pytest.raises(SchemaError):
            decode.decode("gpu", payload)
    msgs = [SimpleNamespace(offset=i, key=None, value=v, headers=[])
            for i, v in enumerate([decode.encode_wire(ok), decode.encode_wire(huge), schema.encode(huge)])]
    out = decode_arrow.decode_batch("gpu", "t.gpu", 0, msgs)
    assert [d.offset for d in out.dead] == [1, 2] and out.tables["gpu"].num_rows == 1


def test_binary_sniff_spares_a_syslog_with_a_block_of_nuls():
    """A kernel log after a hard reset holds a block of NUL bytes; the lines after it still count."""
    log = b"Nov 21 04:40:00 host kernel: hello\n" * 20 + b"\x00" * 4000 + b"Nov 21 04:41:00 host kernel: NVRM: Xid\n"
    assert sniff_binary(log) is None
    assert sniff_binary(b"\x00" * 100) and sniff_binary(b"\x7fELF\x02\x01\x01" + bytes(range(256)) * 16)


class _Exploding(KernelParser):
    """A parser that raises on a line holding BOOM (none of ours does any more: this drives the error path)."""

    def _head(self, line):  # type: ignore[override]
        if "BOOM" in line:
            raise RuntimeError("boom")
        return super()._head(line)


@pytest.mark.parametrize("fast", [True, False])
def test_explain_error_path_keeps_every_line_in_order(fast):
    from faultlens.diagnosis.explain import _ordinary_fast_path, _parsed

    lines = ["[ 1.0] NVRM: Xid (PCI:0000:05:00): 79, pid=1, GPU has fallen off the bus.", "[ 1.1] audit: ok",
             "[ 1.2] INFO: task python:12 blocked for more than 120 seconds.", "  Call Trace:", "BOOM here",
             "[ 1.3] audit: ok", "", "  indented BOOM", "[ 1.4] NVRM: Xid (PCI:0000:05:00): 48, pid=1, DBE"] * 3
    ordinary = _ordinary_fast_path()
    parser = _Exploding(extra_hot=ordinary[0]) if fast and ordinary else _Exploding()
    out = list(_parsed(parser, lines, "kernel", ordinary[1] if fast and ordinary else None))
    assert [e.line_no for e in out] == list(range(1, len(lines) + 1))
    assert [e.text for e in out] == lines
    by_text = {}
    for e in out:
        by_text.setdefault(e.text, set()).add(e.c.rule)
    assert by_text["BOOM here"] == {"unparsed"} and by_text["  indented BOOM"] == {"unparsed"}
    assert any("RuntimeError: boom" in e.c.meaning for e in out)
    assert {e.c.xid for e in out if e.text.endswith("fallen off the bus.")} == {79}
    assert {e.c.xid for e in out if e.text.endswith("DBE")} == {48}  # the parser goes on after the failure
    if not fast:  # line by line, the record open before the failing line is closed as it stands
        assert by_text["  Call Trace:"] == {by_text["[ 1.2] INFO: task python:12 blocked for more than 120 seconds."].pop()}
        assert "unparsed" not in by_text["  Call Trace:"]
