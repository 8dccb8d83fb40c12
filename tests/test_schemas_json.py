"""The shipped JSON Schemas accept what faultlens.schema.cloudevent produces and reject broken events."""

from __future__ import annotations

import copy

import msgspec
import pytest

from faultlens import schema
from faultlens.diagnosis.event_schemas import EventValidator, load_schema


def _incident(**kw) -> schema.Incident:
    base = dict(
        id="inc-1", job="j1", opened_ts=1_700_000_000.0, updated_ts=1_700_000_042.5, status="open",
        category="pcie", kind="gpu_lost", title="GPU 3 on n007 fell off the bus", severity="critical",
        confidence=0.98,
        suspects=[{"node": "n007", "gpu": 3, "ranks": [51], "score": 0.98, "reason": "Xid 79"}],
        evidence=[{"ts": 1_700_000_000.0, "source": "kernel", "node": "n007",
                   "text": "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."},
                  {"ts": 1_700_000_040.0, "source": "gpu", "node": "n007", "rank": None, "text": "GPU lost",
                   "figures": {"lost": True}}],
        muted=[{"item": "nccl watchdog timeout rank 12", "by_rule": "xid79_mutes_watchdog"}],
        actions=["act-1"], summary="Xid 79 then every rank's watchdog timed out.",
    )
    base.update(kw)
    return schema.Incident(**base)


PLAN = {
    "layers_per_stage": [10, 6, 8, 8],
    "microbatches_per_replica": [8, 8, 6, 8],
    "tp_changes": [{"group": [8, 9, 10, 11], "from": 4, "to": 2}],
    "options": [{"name": "shift-layers", "predicted_tokens_per_s": 41000.0, "slowdown": 0.04},
                {"name": "evict", "predicted_tokens_per_s": 39500.0}],
    "why": "stage 1 (n004) runs 40% slower; moving two layers recovers most of it",
}


def _action(type_: str = "evict_nodes", **kw) -> schema.Action:
    base = dict(id="act-1", incident_id="inc-1", job="j1", ts=1_700_000_043.0, type=type_, nodes=["n007"],
                suspects=[{"node": "n007", "score": 0.98, "reason": "Xid 79"}],
                evidence=[{"ts": 1_700_000_000.0, "source": "kernel", "text": "Xid 79"}],
                confidence=0.98, dry_run=True, reason="GPU fell off the bus")
    base.update(kw)
    return schema.Action(**base)


@pytest.fixture(scope="module")
def incidents() -> EventValidator:
    return EventValidator("incidents")


@pytest.fixture(scope="module")
def actions() -> EventValidator:
    return EventValidator("actions")


def test_an_incident_cloudevent_validates(incidents) -> None:
    assert incidents.errors(schema.cloudevent(_incident())) == []
    assert incidents.errors(schema.cloudevent(_incident(status="resolved", suspects=[], evidence=[], muted=[]))) == []


@pytest.mark.parametrize("type_", schema.ACTION_TYPES)
def test_every_action_type_validates(actions, type_) -> None:
    extra = {"plan": PLAN} if type_ == "adapt_parallelism" else {}
    nodes = [] if type_ in ("restart_job", "rollback_code", "notify") else ["n007"]
    assert actions.errors(schema.cloudevent(_action(type_, nodes=nodes, **extra))) == []


def test_an_eviction_carries_its_demarcated_group_or_the_planner_options(actions) -> None:
    # What the engine really sends: a hang's over-eviction names the parallel group it
    # demarcated; the runner once refused it because only adapt_parallelism plans were allowed.
    group = {"group": "tp+pp", "group_ranks": [24, 25, 56, 57], "outliers": [27, 59], "missing": []}
    assert actions.errors(schema.cloudevent(_action("evict_nodes", nodes=["n004", "n008"], plan=group))) == []
    assert actions.errors(schema.cloudevent(_action("evict_nodes", nodes=["n004"], plan=PLAN))) == []
    assert actions.errors(schema.cloudevent(_action("adapt_parallelism", nodes=["n004"], plan=group))) != []


def _broken(event: dict, path: str, value: object) -> dict:
    out = copy.deepcopy(event)
    *head, last = path.split(".")
    target = out
    for part in head:
        target = target[int(part)] if isinstance(target, list) else target[part]
    if value is KeyError:
        del target[last]
    else:
        target[last] = value
    return out


@pytest.mark.parametrize(
    "path, value",
    [
        ("specversion", "0.3"),
        ("specversion", KeyError),
        ("id", KeyError),
        ("type", "io.faultlens.action.v1"),
        ("data.status", "smouldering"),
        ("data.category", "cosmic_rays"),
        ("data.severity", "apocalyptic"),
        ("data.confidence", 1.5),
        ("data.opened_ts", "yesterday"),
        ("data.suspects.0.node", KeyError),
        ("data.suspects.0.score", "high"),
        ("data.evidence.0.text", KeyError),
        ("data.evidence.0.ts", "noon"),
        ("data.muted.0.by_rule", KeyError),
        ("data.job", KeyError),
        ("data.v", 2),
    ],
)
def test_broken_incidents_fail(incidents, path, value) -> None:
    assert incidents.errors(_broken(schema.cloudevent(_incident()), path, value))


@pytest.mark.parametrize(
    "type_, path, value",
    [
        ("evict_nodes", "data.type", "reboot_everything"),
        ("evict_nodes", "type", "io.faultlens.incident.v1"),
        ("evict_nodes", "data.nodes", []),
        ("evict_nodes", "data.nodes", KeyError),
        ("run_diagnostics", "data.nodes", []),
        ("evict_nodes", "data.dry_run", "no"),
        ("evict_nodes", "data.dry_run", KeyError),
        ("evict_nodes", "data.incident_id", KeyError),
        ("evict_nodes", "data.nodes", [""]),
        ("evict_nodes", "data.nodes", [3]),
        ("adapt_parallelism", "data.plan", None),
        ("adapt_parallelism", "data.plan.options", KeyError),
        ("adapt_parallelism", "data.plan.layers_per_stage", [8, "eight"]),
        ("adapt_parallelism", "data.plan.options.0.predicted_tokens_per_s", KeyError),
        ("adapt_parallelism", "data.plan.why", KeyError),
        ("evict_nodes", "data", KeyError),
        ("evict_nodes", "Not_An_Attribute", 1),
    ],
)
def test_broken_actions_fail(actions, type_, path, value) -> None:
    event = schema.cloudevent(_action(type_, plan=PLAN if type_ == "adapt_parallelism" else None))
    assert actions.errors(event) == []
    assert actions.errors(_broken(event, path, value))


@pytest.mark.parametrize("kind, cls", [("incidents", schema.Incident), ("actions", schema.Action)])
def test_the_schemas_describe_every_record_field(kind, cls) -> None:
    data = load_schema(kind)["$defs"]["data"]
    assert set(data["properties"]) == set(schema.field_names(cls))
    required = {name for name, default in schema.field_defaults(cls).items() if default is msgspec.NODEFAULT}
    assert required <= set(data["required"])


def test_the_action_type_enum_is_the_shared_vocabulary() -> None:
    assert load_schema("actions")["$defs"]["data"]["properties"]["type"]["enum"] == list(schema.ACTION_TYPES)
    assert load_schema("incidents")["properties"]["type"]["const"] == schema.CLOUDEVENT_TYPES["incidents"]
    assert load_schema("actions")["properties"]["type"]["const"] == schema.CLOUDEVENT_TYPES["actions"]


def test_the_examples_in_docs_schemas_validate(incidents, actions) -> None:
    import re

    import orjson

    from tests.conftest import REPO

    text = (REPO / "docs" / "schemas.md").read_text()
    examples = dict(re.findall(r"^### (\S+)\n\n```json\n(.*?)\n```", text, flags=re.S | re.M))
    assert incidents.errors(orjson.loads(examples["incidents"])) == []
    assert actions.errors(orjson.loads(examples["actions"])) == []
