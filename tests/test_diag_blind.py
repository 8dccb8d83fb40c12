"""Misses found by benchmarks/blind.py: scenarios written by an independent generator (tests/blindgen.py).

Each test is one family that went wrong on those directories, fixed in faultlens's general code:
- a recovered (tolerated) IB flap on one node muted a later hang on another as its symptom: the job
  stayed hung with no action (diagnosis/incidents.py withdraws a tolerated alert's cause);
- a node's repeated link downs made its peers' NCCL completion errors (printed on both ends of a broken
  connection) count as link events of their hosts: a job-wide "fabric storm" notify instead of evicting
  the node (policy.toml jobwide `sources = ["kernel"]`);
- three corrected AER events, a header and a detail line each, were counted as six and read as a
  flood: a warning incident and a notify on a healthy node (kernel.toml `repeat.counts`).
Fixtures in tests/fixtures/blind/ are the generator's lines, verbatim (see its README).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from faultlens import schema
from faultlens.collectors.batch import read_batch_dir
from faultlens.collectors.kernel import KernelParser
from faultlens.collectors.signatures import ClassifyContext, classify
from faultlens.commands.diagnose import make_detectors
from faultlens.config import Config
from faultlens.diagnosis.batch import diagnose_records
from faultlens.diagnosis.incidents import RECOVERED_KIND, IncidentBook, Signal
from faultlens.diagnosis.inhibit import Inhibitor
from tests.blindgen import Scenario, write

FIX = Path(__file__).parent / "fixtures" / "blind"
NODES = [f"gpu-a100-{i:03d}" for i in range(17, 21)]


def _diagnose(d: Path) -> tuple[list[Any], list[dict[str, Any]]]:
    b = read_batch_dir(d)
    incidents, actions = diagnose_records(b.job, list(b.records()), Config(), detectors=make_detectors("auto"))
    return incidents, [schema.to_dict(a) for a in actions]


def _raised(incidents: list[Any]) -> list[Any]:
    return [i for i in incidents if i.severity in ("warning", "critical") and i.status != "resolved"]


@pytest.mark.parametrize(("kind", "seed", "force"), [
    # the stuck rank's node is evicted although another node's IB link flapped and recovered before the hang
    ("hang", 49, {"hard": True, "distract": "flap", "kfmt": "dmesg_raw", "n_steps": 260}),
    # the node whose link keeps going down is evicted; its peers' NCCL errors are not a fabric storm
    ("ib_down", 82, {"hard": True, "distract": "xid63", "kfmt": "dmesg_T", "n_steps": 260}),
    # a 5-15 minute checkpoint save the framework announces: every rank silent, no hang, no action
    ("ckpt_pause", 3, {"n_steps": 260}),
    # an Xid 79 whose collective's watchdog fires PyTorch's default 30 minutes later: one fault, the Xid's eviction
    ("late_watchdog", 3, {"n_steps": 260}),
])
def test_blind_scenario_gets_the_accepted_action(kind: str, seed: int, force: dict[str, Any], tmp_path: Path) -> None:
    sc = Scenario(kind, kind, seed, list(NODES), 4, force=force)
    incidents, actions = _diagnose(write(sc, tmp_path / kind))
    ok, why = sc.truth.judge(actions)
    assert ok, f"{kind}: wanted {sc.truth.text}; {why}"
    assert not [i for i in incidents if i.kind == "fabric_storm"]
    if kind == "late_watchdog":  # the watchdog is the Xid's symptom: no incident of its own, no restart
        assert [i.kind for i in incidents] == ["gpu_lost"] and [a["type"] for a in actions] == ["evict_nodes"]


def test_corrected_aer_events_on_a_healthy_node_raise_nothing(tmp_path: Path) -> None:
    sc = Scenario("healthy", "healthy", 5, list(NODES), 4, force={"hard": True, "distract": "aer_ce", "n_steps": 200})
    incidents, actions = _diagnose(write(sc, tmp_path / "healthy"))
    assert sc.truth.judge(actions)[0]
    assert _raised(incidents) == [], [(i.kind, i.node) for i in incidents]


def test_corrected_aer_repeat_counts_events_not_lines() -> None:
    lines = (FIX / "aer_corrected_three_events.log").read_text().splitlines()
    ctx = ClassifyContext()
    got = [classify(r, ctx) for r in KernelParser(year=2026).parse(lines)]
    assert len(got) == 6 and all(c.severity == "info" and c.action == "none" for c in got), [c.rule for c in got]
    # the same three events twice more within the minute: six events, a rising rate -> the flood verdict
    again = [ln.replace("16:11:5", "16:12:1").replace("16:12:03", "16:12:23") for ln in lines]
    got = [classify(r, ctx) for r in KernelParser(year=2026).parse(again)]
    assert got[-1].rule == "kernel.pcie_aer.corrected.repeated" and got[-1].action == "notify"


def _minimal_dir(d: Path, kernel: dict[str, list[str]], nccl: dict[str, list[str]], nodes: list[str] = NODES,
                 gpn: int = 4) -> Path:
    ranks = {str(n * gpn + g): {"node": node, "gpu": g} for n, node in enumerate(nodes) for g in range(gpn)}
    d.mkdir(parents=True)
    (d / "job.json").write_text(json.dumps({"job": "blind", "tp": gpn, "pp": 1, "dp": len(nodes), "cp": 1,
                                            "order": "tp-cp-dp-pp", "ranks": ranks}))
    for node in nodes:
        (d / "nodes" / node / "nccl").mkdir(parents=True)
        (d / "nodes" / node / "kernel.log").write_text("\n".join(kernel.get(node, [])) + "\n")
        (d / "nodes" / node / "nccl" / "rank.log").write_text("\n".join(nccl.get(node, [])) + "\n")
    return d


def test_peer_nccl_errors_do_not_make_one_dead_link_a_fabric_storm(tmp_path: Path) -> None:
    nccl: dict[str, list[str]] = {}
    for ln in (FIX / "ib_down_peer_nccl.log").read_text().splitlines():
        nccl.setdefault(ln.split(":", 1)[0], []).append(ln)
    assert len(nccl) == 3  # the culprit and two peers complain
    culprit = (FIX / "ib_down_culprit_kernel.log").read_text().splitlines()
    incidents, actions = _diagnose(_minimal_dir(tmp_path / "d", {"gpu-a100-017": culprit}, nccl))
    assert [(a["type"], a["nodes"]) for a in actions if a["type"] != "notify"] == [("evict_nodes", ["gpu-a100-017"])]
    assert not [i for i in incidents if i.kind == "fabric_storm"]


def test_link_downs_on_most_hosts_are_still_one_fabric_storm(tmp_path: Path) -> None:
    # the same kernel lines on every node at once: the switch, not a machine (no eviction)
    culprit = (FIX / "ib_down_culprit_kernel.log").read_text().splitlines()[:2]
    incidents, actions = _diagnose(_minimal_dir(tmp_path / "d", {n: culprit for n in NODES}, {}))
    assert [i for i in incidents if i.kind == "fabric_storm"]
    assert not [a for a in actions if a["type"] == "evict_nodes"]


def test_nfs_lines_on_most_hosts_explain_hung_tasks_on_a_few(tmp_path: Path) -> None:
    # NFS "not responding" on every host, hung tasks on only some: one shared stall (notify), no per-node checks
    nodes = [f"10-0-0-{i}" for i in range(67, 73)]
    sc = Scenario("storage", "storage_stall", 217, nodes, 4, force={"hard": True, "distract": "nfs_blip", "kfmt": "short_precise"})
    d = write(sc, tmp_path / "storage")
    hung = [n for n in nodes if "blocked for more than" in (d / "nodes" / n / "kernel.log").read_text()]
    assert 0 < len(hung) < len(nodes) / 2  # too few for the hung tasks alone to make it job-wide
    incidents, actions = _diagnose(d)
    ok, why = sc.truth.judge(actions)
    assert ok, why
    assert [i for i in incidents if i.kind == "storage" and f"on {len(nodes)}/{len(nodes)} nodes" in (i.summary or "")]
    assert not [i for i in incidents if i.kind == "hung_task"]


def _hang(tmp_path: Path, seed: int, nodes: list[str], force: dict[str, Any]) -> tuple[Scenario, list[Any], list[dict[str, Any]]]:
    sc = Scenario("hang", "hang", seed, nodes, 8 if len(nodes) == 2 else 4, force={"n_steps": 260, **force})
    incidents, actions = _diagnose(write(sc, tmp_path / "hang"))
    return sc, incidents, actions


def test_a_warning_on_another_machine_neither_mutes_a_hang_nor_roots_it(tmp_path: Path) -> None:
    # a non-fatal NVSwitch SXid (notify) on a healthy node while the job hangs on a rank stuck in CUDA
    sc, incidents, actions = _hang(tmp_path, 746, list(NODES), {"hard": True, "hang_variant": "plain", "drop": [],
                                                                "distract": "sxid_nonfatal", "distract_at": "fault"})
    sxid = [i for i in incidents if i.kind == "nvlink_error"]
    assert sxid and sxid[0].suspects[0]["node"] not in sc.truth.culprits
    ok, why = sc.truth.judge(actions)
    assert ok, f"wanted {sc.truth.text}; {why}"


def test_silence_on_another_machine_does_not_join_a_seen_root(tmp_path: Path) -> None:
    # pipeline of 2 stages on 8 machines; two ranks of a healthy machine did not answer the dump: the stuck
    # rank's machine (seen in a dataset read / CUDA sync while its groups wait) is evicted alone
    nodes = [f"gpu-a100-{i:03d}" for i in range(100, 108)]
    force = {"n_steps": 260, "hard": True, "hang_variant": "p2p", "pp": 2, "distract": "xid63"}
    probe = Scenario("hang", "hang", 974, nodes, 4, force=dict(force))
    write(probe, tmp_path / "probe")
    other = (nodes.index(probe.truth.culprits[0]) + 1) % len(nodes)
    sc = Scenario("hang", "hang", 974, nodes, 4, force={**force, "drop": [other * 4 + 1, other * 4 + 2]})
    incidents, actions = _diagnose(write(sc, tmp_path / "hang"))
    ok, why = sc.truth.judge(actions)
    assert ok, f"wanted {sc.truth.text}; {why}"


def test_one_machine_of_two_that_does_not_answer_is_the_named_suspect(tmp_path: Path) -> None:
    sc, incidents, actions = _hang(tmp_path, 651, NODES[:2], {"hard": True, "hang_variant": "no_answer"})
    assert sc.truth.judge(actions)[0]
    hang = [i for i in incidents if i.kind == "hang" and i.suspects]
    assert hang and hang[0].suspects[0]["node"] == sc.truth.culprits[0]


def _book() -> IncidentBook:
    return IncidentBook(burst_gap_s=60.0, inhibitor=Inhibitor(), join_window_s={"ib_link": 300.0})


def test_peers_nccl_errors_do_not_reopen_a_tolerated_flap() -> None:
    # benchmarks/blind.py's ib_down-s10: a healthy node's link flapped and came back 3 s later; NCCL completion
    # errors (the remote side of another node's dead link) then land on it: the flap stays a tolerated warning
    kernel = (FIX / "flap_and_dead_link_kernel.log").read_text().splitlines()
    nccl = (FIX / "flap_and_dead_link_nccl.log").read_text().splitlines()
    node, t0 = "node0148.cluster.internal", 1_795_000_000.0
    book = _book()
    down = Signal(t0, "j", "ib_link", "alert", 0.9, "policy:ib_link_down", "kernel", kernel[0], node=node, severity="warning")
    inc = book.add(down)
    assert inc is not None
    book.add(Signal(t0 + 3, "j", RECOVERED_KIND, "info", 0.5, "policy:ib_link_up", "kernel", kernel[1], node=node))
    assert (inc.status, inc.state.severity) == ("resolved", "warning")
    book.add(Signal(t0 + 40, "j", "ib_link", "symptom", 0.4, "policy:nccl_ib_completion", "nccl", nccl[0], node=node))
    assert (inc.status, inc.severity()) == ("resolved", "warning")
    # a second link down within the network window does reopen it: that is a repeat
    book.add(Signal(t0 + 60, "j", "ib_link", "alert", 0.9, "policy:ib_link_down", "kernel", kernel[0], node=node, severity="warning"))
    assert inc.status == "open"


def test_a_recovered_flap_does_not_explain_a_later_hang() -> None:
    kernel = (FIX / "flap_and_dead_link_kernel.log").read_text().splitlines()
    node, t0 = "node0148.cluster.internal", 1_795_000_000.0
    book = _book()
    book.add(Signal(t0, "j", "ib_link", "alert", 0.9, "policy:ib_link_down", "kernel", kernel[0], node=node, severity="warning"))
    assert book.inhibitor.muted_by("hang", "job", "j", None, t0 + 2) is None  # not yet repeated: tolerated
    book.add(Signal(t0 + 3, "j", RECOVERED_KIND, "info", 0.5, "policy:ib_link_up", "kernel", kernel[1], node=node))
    assert book.inhibitor.muted_by("ib_link", "symptom", "j", "node0149.cluster.internal", t0 + 2) is not None
    assert book.inhibitor.muted_by("hang", "job", "j", None, t0 + 90) is None
