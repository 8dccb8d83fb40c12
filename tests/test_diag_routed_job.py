"""An online engine never acts under job "unknown" for a node the repartitioner routed to its job.

The soak (benchmarks/soak.py) once saw an ``evict_nodes`` under job "unknown": the broker had
lost the jobs topic and the diagnosis changelog, the job's engine came back without its
topology, and a Xid 79 on one of its nodes was judged jobless. The repartitioner routes a
node's records to a job's key only once a topology named the node there, so that key is the
node's job (diagnosis.state.EngineFactory sets ``routed_job``). Input: a recorded Xid 79 line
(tests/fixtures/kernel/families/input.log, line 4; sources in SOURCES.md there).
"""

from __future__ import annotations

from pathlib import Path

from faultlens.config import Config, GuardConfig
from faultlens.diagnosis.engine import DiagnosisEngine
from faultlens.diagnosis.online.state import EngineFactory
from faultlens.schema import Action, KernelEvent

XID_79 = (Path(__file__).parent / "fixtures" / "kernel" / "families" / "input.log").read_text().splitlines()[3]


def _actions(engine: DiagnosisEngine) -> list[Action]:
    out = engine.observe(KernelEvent(ts=1_760_000_000.0, node="gpu-n7", kind="xid", raw=XID_79, xid=79))
    out += engine.tick(1_760_000_030.0)
    return [o for o in out if isinstance(o, Action)]


def test_a_jobs_engine_without_its_topology_acts_under_its_job() -> None:
    config = Config(guard=GuardConfig(max_evicted_fraction=1.0))
    factory = EngineFactory(lambda: DiagnosisEngine(config, batch=False))
    acts = _actions(factory("llm-pretrain-3"))
    assert acts and {a.job for a in acts} == {"llm-pretrain-3"}
    assert any(a.type == "evict_nodes" and a.nodes == ["gpu-n7"] for a in acts)


def test_nodes_outside_any_job_stay_node_local() -> None:
    config = Config(guard=GuardConfig(max_evicted_fraction=1.0))
    factory = EngineFactory(lambda: DiagnosisEngine(config, batch=False))
    engine = factory("~nodes/3")  # the repartitioner's key for nodes no topology names
    assert engine.routed_job is None and engine.job_of_node("gpu-n7") == "unknown"
