"""Untimed NCCL-log records in a batch directory are put where they happened.

NCCL's own lines and Python tracebacks carry no time. In a file with no timed line at all,
set-up chatter (INFO) belongs to the job's start, but an error or a traceback belongs to
when the node's ranks stopped stepping: placed at the start, a traceback that ended the
job is judged "resolved" long before the hang it caused, and no rollback follows.
"""

from __future__ import annotations

import json
from pathlib import Path

from faultlens.collectors.batch import read_batch_dir
from faultlens.config import Config
from faultlens.diagnosis.batch import diagnose_records

T0 = 1_763_700_000.0
JOB = {"job": "j1", "tp": 2, "pp": 1, "dp": 1, "ranks": {"0": {"node": "n001", "gpu": 0}, "1": {"node": "n001", "gpu": 1}}}
GPU = {"uuid": "GPU-0", "util": 99.0, "mem_used_mb": 70000.0, "temp_c": 60.0, "power_w": 600.0, "sm_clock_mhz": 1980.0}


def _write(d: Path) -> None:
    (d / "nodes/n001/nccl").mkdir(parents=True)
    (d / "steps").mkdir()
    (d / "job.json").write_text(json.dumps(JOB))
    gpu = [json.dumps({"v": 1, "ts": T0 + t, "node": "n001", "gpus": [
        {**GPU, "index": i, "pci_bus": f"00000000:{0x18 + i:02X}:00.0"} for i in range(2)]}) for t in range(0, 400, 5)]
    (d / "nodes/n001/gpu.jsonl").write_text("\n".join(gpu) + "\n")
    steps = [json.dumps({"v": 1, "ts": T0 + 1.0 + s, "job": "j1", "rank": r, "node": "n001", "step": s,
                         "duration_s": 1.0, "n_seqs": 8, "sum_len": 8192, "sum_len_sq": 8388608, "tokens": 8192})
             for s in range(200) for r in range(2)]
    (d / "steps/n001.jsonl").write_text("\n".join(steps) + "\n")
    (d / "nodes/n001/nccl/rank0.log").write_text(
        "n001:2263519:2263519 [0] NCCL INFO Bootstrap : Using ib0:10.0.0.1<0>\n"
        "[rank0]: Traceback (most recent call last):\n"
        "[rank0]:   File \"/workspace/train.py\", line 160, in train_step\n"
        "[rank0]:     out = model(batch)\n"
        "[rank0]: KeyError: 'attention_mask'\n")


def test_an_untimed_traceback_is_placed_at_the_last_step_and_rolls_back(tmp_path: Path) -> None:
    _write(tmp_path)
    b = read_batch_dir(tmp_path)
    info = next(r for r in b.nccl if "Bootstrap" in r.raw)
    tb = next(r for r in b.nccl if "KeyError" in r.raw)
    assert info.ts == T0 and info.fields["ts_anchor"] == "node_first"
    assert tb.ts == T0 + 200.0 and tb.fields["ts_anchor"] == "last_step"
    incidents, actions = diagnose_records(b.job, list(b.records()), Config())
    assert [a.type for a in actions] == ["rollback_code"]
    assert not [i for i in incidents if i.kind == "hang" and i.status == "open"]


HUNG = ("[ 5001.204311] INFO: task python3:4242 blocked for more than 120 seconds.\n"
        "[ 5001.204315]       Tainted: P           OE      5.15.0-122-generic #132-Ubuntu\n"
        "[ 5001.204319] \"echo 0 > /proc/sys/kernel/hung_task_timeout_secs\" disables this message.\n")


def test_a_boot_relative_hung_task_is_placed_its_seconds_after_the_nodes_last_step(tmp_path: Path) -> None:
    """A dmesg file (seconds since boot, no other anchor) whose hung-task line reports a task blocked since
    the node's steps stopped: the line lands 120 s after the last step, not at the job's start (where it was
    read before the stall it reports: 5 of 100 campaign renders of hung_task, issue 35)."""
    _write(tmp_path)
    (tmp_path / "nodes/n001/kernel.log").write_text("[ 4700.000100] perf: interrupt took too long (2504 > 2500)\n" + HUNG)
    b = read_batch_dir(tmp_path)
    hung = next(r for r in b.kernel if "blocked for more than" in r.raw)
    assert hung.fields["ts_anchor"] == "stalled_task"
    assert abs(hung.ts - (T0 + 200.0 + 120.0)) < 2.0
    benign = next(r for r in b.kernel if "perf:" in r.raw)
    assert abs(benign.ts - (hung.ts - 301.2)) < 0.01  # the whole file moves with it


def test_a_hung_task_on_a_node_still_stepping_keeps_the_first_record_anchor(tmp_path: Path) -> None:
    _write(tmp_path)
    steps = [json.dumps({"v": 1, "ts": T0 + 1.0 + s, "job": "j1", "rank": r, "node": "n001", "step": s,
                         "duration_s": 1.0, "n_seqs": 8, "sum_len": 8192, "sum_len_sq": 8388608, "tokens": 8192})
             for s in range(390) for r in range(2)]
    (tmp_path / "steps/n001.jsonl").write_text("\n".join(steps) + "\n")
    (tmp_path / "nodes/n001/kernel.log").write_text(HUNG)
    hung = next(r for r in read_batch_dir(tmp_path).kernel if "blocked for more than" in r.raw)
    assert hung.fields["ts_anchor"] == "first_record"
