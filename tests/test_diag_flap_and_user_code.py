"""A link flap that recovered does not make a user-code crash a network fault.

Found by the measured ETTR campaign (issue 35): a Python exception on every rank (a KeyError in
the data pipeline) 90 s after a recovering IB flap on another node of the job was muted into the
flap's incident, which then resolved as tolerated; the job was restarted on the same code instead
of rolled back. A recovered flap is a weak cause: it explains transient symptoms, not a crash of
the application's own code.
"""

from __future__ import annotations

from faultlens.collectors.batch import read_batch_dir
from faultlens.config import Config
from faultlens.datasets.cluster import ClusterSpec
from faultlens.datasets.scenario import FaultSpec, Scenario, ScenarioSpec
from faultlens.datasets.scenario_files import write_batch_dir
from faultlens.diagnosis.batch import diagnose_records
from faultlens.diagnosis.detectors import default_detectors
from faultlens.vocabulary import ActionType


def _decide(tmp_path, faults):
    spec = ScenarioSpec(name="flap-then-user-code", seed=7, cluster=ClusterSpec.for_nodes(4, 8),
                        duration_s=600.0, faults=tuple(faults))
    data = read_batch_dir(write_batch_dir(Scenario(spec), tmp_path / "batch"))
    _, actions = diagnose_records(data.job, list(data.records()), Config(), detectors=default_detectors())
    return {a.type for a in actions}


def test_a_recovered_flap_before_a_user_exception_does_not_turn_the_rollback_into_a_restart(tmp_path) -> None:
    crash = FaultSpec(kind="user_exception", id="f1", onset_s=300.0)
    flap = FaultSpec(kind="ib_flap_transient", id="noise-flap", onset_s=210.0)
    alone = _decide(tmp_path / "alone", [crash])
    assert ActionType.ROLLBACK_CODE in alone
    with_flap = _decide(tmp_path / "flap", [crash, flap])
    assert ActionType.ROLLBACK_CODE in with_flap, with_flap
    assert ActionType.EVICT_NODES not in with_flap


def test_one_rank_raises_and_its_peers_lose_the_connection_rollback_and_no_eviction(tmp_path) -> None:
    """The shape a real DDP job showed (benchmarks/realjob.py, tests/fixtures/real_torch/online_exception.jsonl):
    one rank's bug, every other rank's gloo "Connection closed by peer" seconds later (infrastructure words)."""
    crash = FaultSpec(kind="user_exception", id="f1", onset_s=300.0, params={"spread": "one"})
    got = _decide(tmp_path, [crash])
    assert ActionType.ROLLBACK_CODE in got, got
    assert ActionType.EVICT_NODES not in got and ActionType.RESTART_JOB not in got
