"""choose_remediation: a fail-slow finding becomes adapt_parallelism, evict_nodes or notify."""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import pytest

from faultlens.config import AdaptationConfig, load_config
from faultlens.diagnosis.adaptation import choose_remediation, speeds_from_finding
from faultlens.models.costmodel import JobShape
from faultlens.schema import Finding, cloudevent, decode, encode
from faultlens.stream.topology import Topology
from tests.conftest import REPO

TOPO = Topology.packed(tp=8, pp=4, dp=4, job="j1")
SLOW = TOPO.rank_of(tp=1, dp=1, pp=0)
NODE = TOPO.node_of(SLOW)
SHAPE = JobShape(num_layers=32, microbatches=16, microbatch_s=8.0, tokens_per_microbatch=8192, dp_sync_s=0.3)
ACTION_SCHEMA = json.loads((REPO / "diagnosis" / "schemas" / "action.schema.json").read_text())


def _finding(slowdown: float, **figures) -> Finding:
    return Finding(ts=1_700_000_000.0, kind="fail_slow", category="unknown", severity="critical",
                   action="evict_node", confidence=0.9, source="model:failslow", rule="failslow.cusum",
                   text=f"{NODE}: rank {SLOW} compute +{slowdown:.0%}", node=NODE, job="j1",
                   gpu=TOPO.gpu_of(SLOW), rank=SLOW, figures={"slowdown": slowdown, "ranks": [SLOW], **figures})


def _valid(action) -> dict:
    event = json.loads(json.dumps(cloudevent(action)))
    jsonschema.validate(event, ACTION_SCHEMA)
    assert decode("actions", encode(action)) == action
    return action.plan


def test_no_spare_adapts_with_the_plan_and_every_option():
    action = choose_remediation(_finding(0.4), TOPO, shape=SHAPE, spares=0, incident_id="inc-1")
    assert action.type == "adapt_parallelism" and action.nodes == [NODE]
    plan = _valid(action)
    assert plan["chosen"] != "no_action" and plan["chosen"] in {o["name"] for o in plan["options"]}
    assert sum(plan["microbatches_per_replica"]) == 64 and len(plan["layers_per_stage"]) == 4
    by_name = {o["name"]: o for o in plan["options"]}
    assert by_name[plan["chosen"]]["goodput_tokens"] > by_name["evict_restart"]["goodput_tokens"]
    assert by_name[plan["chosen"]]["predicted_tokens_per_s"] > by_name["no_action"]["predicted_tokens_per_s"]
    assert action.reason == plan["why"] and plan["slow_gpus"] == [{"node": NODE, "gpu": TOPO.gpu_of(SLOW), "rank": SLOW}]
    assert action.incident_id == "inc-1" and action.dry_run is True


def test_spare_and_long_horizon_evicts_the_node():
    action = choose_remediation(_finding(0.6), TOPO, shape=SHAPE, spares=4, horizon_s=3600)
    assert action.type == "evict_nodes" and action.nodes == [NODE]
    assert _valid(action)["chosen"] == "evict_restart"


def test_slight_slowdown_short_horizon_only_notifies():
    action = choose_remediation(_finding(0.005), TOPO, shape=SHAPE, spares=0, horizon_s=600)
    assert action.type == "notify"
    assert _valid(action)["chosen"] == "no_action"


def test_config_supplies_spares_horizon_and_dry_run():
    cfg = load_config(env={}, overrides=["adaptation.spare_nodes=4", "adaptation.horizon_s=7200",
                                         "guard.dry_run=false"])
    action = choose_remediation(_finding(0.6), TOPO, config=cfg, shape=SHAPE)
    assert action.type == "evict_nodes" and action.dry_run is False
    assert action.plan["horizon_s"] == 7200


def test_shape_from_figures_without_an_explicit_shape():
    cfg = AdaptationConfig(num_layers=32, microbatches_per_replica=16)
    action = choose_remediation(_finding(0.4, step_s=60.0, tokens_per_step=8192 * 64), TOPO, config=cfg, spares=0)
    assert action.type == "adapt_parallelism"
    assert action.plan["healthy_tokens_per_s"] == pytest.approx(8192 * 64 / 60.0, rel=0.01)


def test_speed_conventions():
    assert speeds_from_finding(_finding(0.25), TOPO) == {SLOW: pytest.approx(0.8)}
    given = replace(_finding(0.25), figures={"speeds": {"3": 0.5}})
    assert speeds_from_finding(given, TOPO) == {3: 0.5}
    node_only = replace(_finding(0.25), rank=None, gpu=None, figures={"slowdown": 0.25})
    assert sorted(speeds_from_finding(node_only, TOPO)) == TOPO.ranks_on(NODE)
    with pytest.raises(ValueError):
        speeds_from_finding(replace(_finding(0.25), figures={}), TOPO)
