"""A py-spy dump whose native frames name NCCL is a stack dump, not an NCCL log with a traceback."""

from __future__ import annotations

from pathlib import Path

from faultlens.diagnosis.explain import detect_format, explain_lines

DUMP = Path(__file__).parent / "fixtures" / "stacks" / "native" / "rank3.txt"


def test_a_native_dump_naming_nccl_reads_as_a_stack_dump() -> None:
    lines = DUMP.read_text().splitlines()
    assert detect_format(lines) == "stack"
    verdicts = {(e.source, e.c.action) for e in explain_lines(lines)}
    assert all(action == "none" for _, action in verdicts), verdicts  # never "rollback_code" on a stack frame


def test_a_log_holding_a_traceback_is_still_a_log() -> None:
    log = ["[rank0]: Traceback (most recent call last):",
           '[rank0]:   File "/workspace/train.py", line 160, in train_step',
           "[rank0]: KeyError: 'attention_mask'"]
    assert detect_format(log) == "nccl"
