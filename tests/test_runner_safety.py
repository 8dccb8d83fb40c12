"""The runner as an attacker finds it (issue 24): forged and future-dated actions, injection through
command templates, its ledger on by default, and its own rate and fleet caps, through
``ActionRunner.handle`` with stand-in executables on the commands' PATH."""

from __future__ import annotations

import dataclasses
import time

import msgspec
import orjson
import pytest

from faultlens import schema
from faultlens.config import Config, RunnerConfig
from faultlens.diagnosis.runner.adapter_base import fill_template
from faultlens.diagnosis.runner.adapter_slurm import SlurmAdapter
from faultlens.diagnosis.runner.runner import ActionRunner
from faultlens.errors import ConfigError
from faultlens.stream.signing import Ed25519Key, Keyring
from tests.runner_standins import env_with, keys_config, recorded, signed, write_standin


def _action(id_: str = "act-1", *, type_: str = "evict_nodes", nodes=("n001",), job: str = "12345",
            incident: str = "inc-7", reason: str = "Xid 79", ts: float | None = None, dry_run: bool = False):
    return schema.Action(id=id_, incident_id=incident, job=job, ts=time.time() if ts is None else ts, type=type_,
                         nodes=list(nodes), confidence=0.97, dry_run=dry_run, reason=reason)


def _signed(action: schema.Action) -> bytes:
    return orjson.dumps(signed(schema.cloudevent(action)))


def _runner(tmp_path, *, adapter: str = "kubernetes", keys: bool = True, clock=time.time, execute: bool = True,
            **kw) -> ActionRunner:
    kw.setdefault("state_path", str(tmp_path / "ledger.jsonl"))
    cfg = Config(runner=RunnerConfig(adapter=adapter, execute=execute, **kw))
    if keys:
        cfg = dataclasses.replace(cfg, keys=keys_config(tmp_path))
    return ActionRunner(cfg, env=env_with(tmp_path / "bin"), clock=clock)


@pytest.fixture
def rec(tmp_path):
    rec = tmp_path / "calls.jsonl"
    for tool in ("scontrol", "kubectl", "hook", "ssh"):
        write_standin(tmp_path / "bin", tool, rec)
    return rec


# ---------------------------------------------------------------- where an action came from


def test_fifty_scripted_actions_with_dry_run_false_execute_nothing(tmp_path, rec) -> None:
    runner = _runner(tmp_path)
    forger = Keyring([Ed25519Key.from_seed("test-key", b"\x09" * 32)])  # knows the key id, not the private key
    reasons = []
    for i in range(50):
        event = schema.cloudevent(_action(f"act-forged-{i}", nodes=(f"n{i:03d}",)))
        value = orjson.dumps(forger.sign(event) if i % 2 else event)
        out = runner.handle(value)
        assert out.status is None  # nothing reported, nothing in the ledger
        reasons.append(out.dead_letter.reason)
    assert recorded(rec) == []
    assert set(reasons) == {"unsigned", "bad_signature"}
    assert runner.metrics.dead_letters.labels(topic="faultlens.actions", reason="unsigned")._value.get() == 25
    # A forged message must not take the id of the real action that comes next.
    assert runner.handle(orjson.dumps(schema.cloudevent(_action("act-real")))).dead_letter is not None
    assert runner.handle(_signed(_action("act-real"))).status.status == "done"


def test_without_a_key_the_runner_refuses_to_execute_and_says_how_to_make_one(tmp_path, rec) -> None:
    out = _runner(tmp_path, keys=False).handle(orjson.dumps(schema.cloudevent(_action())))
    assert out.status.status == "refused" and "faultlens keys new" in out.status.detail
    assert recorded(rec) == []
    dry = _runner(tmp_path, keys=False).handle(orjson.dumps(schema.cloudevent(_action("act-2", dry_run=True))))
    assert dry.status.status == "dry_run"  # saying what it would do needs no key


def test_future_dated_and_expired_actions_are_dead_lettered(tmp_path, rec) -> None:
    runner = _runner(tmp_path)
    out = runner.handle(_signed(_action("act-2100", ts=4_102_444_800.0)))  # the action stamped 2100-01-01
    assert out.dead_letter.reason == "future_dated" and out.status is None
    expired = _runner(tmp_path, clock=lambda: time.time() + 2 * 3600).handle(_signed(_action("act-old")))
    assert expired.dead_letter.reason == "expired"
    assert recorded(rec) == []


def test_an_unsigned_future_dated_action_is_refused_even_without_keys(tmp_path, rec) -> None:
    runner = _runner(tmp_path, keys=False, execute=False)
    out = runner.handle(orjson.dumps(schema.cloudevent(_action(ts=time.time() + 86400))))
    assert out.status.status == "refused" and ("future-dated" in out.status.detail or "ts_future" in out.status.detail)


# ---------------------------------------------------------------- injection


HOSTILE = [
    {"job": "$(touch PWNED)"},  # the recorded one: ran in the remote shell of an ssh template
    {"job": "--help"},  # became an option of the hook
    {"id_": "act-1\n2026-11-27 10:00:00,000 WARNING faultlens.diagnosis.runner.runner: executing action act-FORGED"},
    {"incident": "inc-7; reboot"},
    {"job": "j`id`"},
    {"job": "x" * 200},
]


@pytest.mark.parametrize("hostile", HOSTILE, ids=lambda h: next(iter(h)))
@pytest.mark.parametrize("adapter,template", [
    ("command", "hook --job {job} --incident {incident} --id {action}"),
    ("slurm", "ssh {node} dcgmi diag -r 2 --job {job} --incident {incident}"),
    ("kubernetes", "ssh {node} dcgmi diag -r 2 --job {job} --action {action}"),
])
def test_hostile_ids_are_refused_before_any_command(tmp_path, rec, adapter, template, hostile) -> None:
    runner = _runner(tmp_path, adapter=adapter, hook_command=template, diagnostics_command=template)
    out = runner.handle(_signed(_action(type_="run_diagnostics", **hostile)))
    assert out.status.status == "refused" and "not a plain id" in out.status.detail
    assert recorded(rec) == [] and not (tmp_path / "PWNED").exists()


def test_values_reaching_a_remote_shell_are_quoted_for_it() -> None:
    template = ("ssh", "{node}", "dcgmi", "diag", "--job", "{job}")
    assert fill_template(template, {"node": "n1", "job": "a b;c"}) == ("ssh", "n1", "dcgmi", "diag", "--job", "'a b;c'")
    assert fill_template(("diag", "--job", "{job}"), {"job": "j1"}) == ("diag", "--job", "j1")


def test_a_newline_in_a_reason_stays_inside_the_drain_reason() -> None:
    action = _action(reason="Xid 79\nscontrol update NodeName=n9 State=DRAIN")
    (drain, _requeue) = SlurmAdapter(RunnerConfig()).plan(action, {})
    assert drain.argv[-1] == "Reason=faultlens inc-7: Xid 79 scontrol update NodeName=n9 State=DRAIN"


# ---------------------------------------------------------------- the ledger, on by default


def test_the_ledger_is_on_by_default_and_a_resent_action_runs_its_hook_once(tmp_path, rec, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the default ledger is a file under the working (data) directory
    assert RunnerConfig().state_path
    value = _signed(_action("act-resent"))
    keys = keys_config(tmp_path)
    for _restart in range(2):
        cfg = Config(runner=RunnerConfig(adapter="command", hook_command="hook {action}", execute=True), keys=keys)
        ActionRunner(cfg, env=env_with(tmp_path / "bin")).handle(value)
    assert recorded(rec) == [["hook", "act-resent"]]
    assert (tmp_path / RunnerConfig().state_path).exists()
    with pytest.raises(ConfigError, match="runner.state_path"):
        ActionRunner(Config(runner=RunnerConfig(execute=True, state_path="")))


# ---------------------------------------------------------------- the runner's own caps


def test_the_rate_cap_refuses_beyond_its_limit_and_holds_across_a_restart(tmp_path, rec) -> None:
    caps = dict(max_actions_per_window=3, rate_window_s=600.0)
    runner = _runner(tmp_path, adapter="command", hook_command="hook {action}", **caps)
    got = [runner.handle(_signed(_action(f"act-{i}", type_="restart_job", nodes=()))).status for i in range(5)]
    assert [s.status for s in got] == ["done"] * 3 + ["refused"] * 2
    assert "runner rate cap" in got[3].detail and "max_actions_per_window=3" in got[3].detail
    restarted = _runner(tmp_path, adapter="command", hook_command="hook {action}", **caps)
    assert restarted.handle(_signed(_action("act-9", type_="restart_job", nodes=()))).status.status == "refused"
    # the shared decoder bounds ts by the real clock (time.max_clock_skew_s), the runner by its own
    later = _runner(tmp_path, adapter="command", hook_command="hook {action}", clock=lambda: time.time() + 601, **caps)
    assert later.handle(_signed(_action("act-10", type_="restart_job", nodes=(), ts=time.time() + 250))).status.status \
        == "done"
    assert len(recorded(rec)) == 4


def test_the_fleet_cap_counts_distinct_nodes_isolated_in_an_hour(tmp_path, rec) -> None:
    runner = _runner(tmp_path, adapter="kubernetes", max_nodes_evicted_per_hour=3)
    outs = [runner.handle(_signed(_action(f"act-{i}", nodes=(n,)))).status
            for i, n in enumerate(["n1", "n2", "n1", "n3", "n4"])]
    assert [o.status for o in outs] == ["done", "done", "done", "done", "refused"]  # n1 twice is one node
    assert "runner fleet cap" in outs[-1].detail
    assert _runner(tmp_path, adapter="kubernetes", max_nodes_evicted_per_hour=3).handle(
        _signed(_action("act-9", nodes=("n5",)))).status.status == "refused"  # persisted in the ledger


def test_an_action_older_than_its_evidence_window_is_refused(tmp_path, rec) -> None:
    """Issue 37.3: the runner refuses an action (not a notify) once the age of its evidence when decided
    plus its own age passes the window it was decided under."""
    runner = _runner(tmp_path, adapter="command", hook_command="hook {action}")

    def judged(id_: str, *, evidence_age_s: float | None, sent_s_ago: float, type_: str = "restart_job") -> str:
        a = msgspec.structs.replace(_action(id_, type_=type_, nodes=(), ts=time.time() - sent_s_ago),
                                evidence_age_s=evidence_age_s, evidence_window_s=60.0)
        status = runner.handle(_signed(a)).status
        assert status is not None
        return status.status + (": " + status.detail if status.status == "refused" else "")

    assert judged("act-fresh", evidence_age_s=10.0, sent_s_ago=5.0) == "done"
    late = judged("act-late", evidence_age_s=50.0, sent_s_ago=20.0)
    assert late.startswith("refused: stale evidence: the newest evidence is 70 s old"), late
    assert judged("act-batch", evidence_age_s=None, sent_s_ago=20.0) == "done"  # batch: no age, no bound
    assert judged("act-note", evidence_age_s=50.0, sent_s_ago=20.0, type_="notify").startswith("done")
    assert recorded(rec) == [["hook", "act-fresh"], ["hook", "act-batch"], ["hook", "act-note"]]  # notify: the hook tells
