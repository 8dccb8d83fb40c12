"""Diagnosis on batch directories written by hand in other tools' shapes (tests/handwritten.py).

Each case once went wrong on such a directory while faultlens's own simulator runs
passed: a traceback from one rank per node placed at the job's start (no rollback), a
gradient that overflowed on one rank written as "Infinity" and nulled (no suspect), and
the job-wide and silent-hang cases issue 16 is about. The benchmark runs all of them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from faultlens import schema
from faultlens.collectors.batch import read_batch_dir
from faultlens.commands.diagnose import make_detectors
from faultlens.config import Config
from faultlens.diagnosis.batch import diagnose_records
from tests.handwritten import scenarios, write

CASES = {s.name: s for s in scenarios()}


@pytest.mark.parametrize("name", ["user_exception", "nan_culprit", "storage_stall", "hang_silent", "healthy",
                                  "gpu_vanished"])
def test_handwritten_scenario(name: str, tmp_path: Path) -> None:
    spec = CASES[name]
    b = read_batch_dir(write(spec, tmp_path / name))
    _, actions = diagnose_records(b.job, list(b.records()), Config(), detectors=make_detectors("auto"))
    ok, why = spec.expect.judge([schema.to_dict(a) for a in actions])
    assert ok, f"{name}: wanted {spec.expect.text}; {why}"
