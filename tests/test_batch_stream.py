"""Issue 36, item 5: a big job's post-mortem streams its NVML samples.

``read_batch_dir(stream_gpu=True)`` keeps no sample (each node's gpu.jsonl is read again as the
records merge), yet gives the very records, in the same order, and the same diagnosis as reading
everything; the bad lines of a gpu.jsonl are counted once. benchmarks/batch_scale.py measures it.
"""

from __future__ import annotations

from pathlib import Path

from faultlens.collectors.batch import read_batch_dir
from faultlens.config import Config
from faultlens.datasets.scenario import scenario_for
from faultlens.datasets.scenario_files import write_batch_dir
from faultlens.diagnosis.batch import diagnose_records


def test_streamed_samples_are_the_same_records_and_diagnosis(tmp_path: Path) -> None:
    d = write_batch_dir(scenario_for("gpu_lost", nodes=2, duration_s=180.0, seed=3), tmp_path / "job")
    gpu = next((d / "nodes").iterdir()) / "gpu.jsonl"
    gpu.write_text(gpu.read_text() + "{not json\n")
    held, streamed = read_batch_dir(d), read_batch_dir(d, stream_gpu=True)
    assert streamed.gpu == [] and streamed.gpu_files and len(streamed) == len(held)
    assert streamed.errors == held.errors and len([e for e in held.errors if "gpu.jsonl" in e]) == 1
    assert list(streamed.records()) == list(held.records())
    _, want = diagnose_records(held.job, list(held.records()), Config())
    _, got = diagnose_records(streamed.job, streamed.records(stacks=False), Config(), stacks=streamed.stacks)
    assert [(a.type, a.nodes) for a in got] == [(a.type, a.nodes) for a in want] and got
