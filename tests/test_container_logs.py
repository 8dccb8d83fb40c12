"""NCCL / torch and framework step logs as a container runtime writes them on the node: unwrapped, timed, ranked."""

from __future__ import annotations

from pathlib import Path

from faultlens.collectors.nccl import NcclParser
from faultlens.diagnosis.explain import explain_lines

LOG = Path(__file__).parent / "fixtures" / "nccl_container" / "docker_and_cri.log"


def test_docker_json_and_cri_lines_are_read_as_the_process_wrote_them() -> None:
    recs = list(NcclParser("n", year=2025).parse(LOG.read_text().splitlines()))
    kinds = [(r.kind, r.rank) for r in recs]
    assert kinds == [("nccl_info", None), ("traceback", 1), ("watchdog_timeout", 3)]
    info, tb, wd = recs
    assert info.ts == 1764065470.1234567 and tb.ts == 1764065474.1  # the runtime's own time
    assert "OutOfMemoryError" in tb.raw and tb.raw.count("\n") == 2  # one traceback across wrapped lines
    assert wd.fields.get("timeout_ms") == 600000 or wd.timeout_ms == 600000


def test_explain_gives_the_wrapped_lines_their_verdicts() -> None:
    got = [(e.source, e.c.category, e.c.action) for e in explain_lines(LOG.read_text().splitlines())]
    assert got[0] == ("nccl", "none", "none")
    assert got[3] == ("nccl", "user_software", "rollback_code")
    assert got[4] == ("nccl", "network", "run_diagnostics")


def test_framework_step_lines_in_a_container_file_are_steps() -> None:
    from faultlens.collectors.steps import parse_step_line

    megatron = (" [2024-05-01 10:00:00] iteration       10/  500000 | consumed samples:         5120 | elapsed time per "
                "iteration (ms): 1234.5 | learning rate: 1.000000E-04 | global batch size:   512 | lm loss: 8.123456E+00 |")
    titan = "[rank0]:[titan] 2024-05-01 10:00:00,123 - root - INFO - step:  10  loss:  8.1234  memory: 30.12GiB(38.09%)  tps: 5,123"
    import json

    for line in (megatron, titan):
        bare = parse_step_line(line)
        assert bare is not None
        assert parse_step_line(json.dumps({"log": line + "\n", "stream": "stdout", "time": "2024-05-01T10:00:00.1Z"})) == bare
        assert parse_step_line(f"2024-05-01T10:00:00.123456789Z stdout F {line}") == bare
