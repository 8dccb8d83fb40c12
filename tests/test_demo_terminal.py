"""The demo terminal: an incident once, then only what changed; each action after its incident."""

from __future__ import annotations

from rich.console import Console

from faultlens.commands.demo import DemoPrinter


def _shown(line: str) -> str:
    """The line as the terminal shows it (rich markup rendered)."""
    console = Console(width=400, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(line)
    return console.export_text().strip()

INC = {"id": "inc-j1-0001", "status": "open", "severity": "critical", "category": "gpu_hardware",
       "kind": "gpu_lost", "title": "GPU fell off the bus on n003 [bold]x[/]",
       "suspects": [{"node": "n003", "gpu": 5}], "actions": []}
ACT = {"id": "act-j1-0001", "incident_id": "inc-j1-0001", "job": "j1", "type": "evict_nodes", "nodes": ["n003"],
       "dry_run": True, "confidence": 0.97, "reason": "Xid 79 on n003"}


def test_an_incident_is_printed_once_then_only_its_changes() -> None:
    p = DemoPrinter()
    first = p.incident(INC, 0.0)
    assert len(first) == 1 and _shown(first[0]).startswith("INCIDENT inc-j1-0001 [open] critical")
    assert _shown(first[0]).endswith("GPU fell off the bus on n003 [bold]x[/]  suspects: n003 gpu 5")  # text, not styling
    assert p.incident(dict(INC), 1.0) == []  # the same incident re-published: nothing
    changed = p.incident({**INC, "status": "mitigated", "actions": ["act-j1-0001"]}, 2.0)
    assert [_shown(x) for x in changed] == ["UPDATE inc-j1-0001: status open -> mitigated; action act-j1-0001"]


def test_an_action_that_arrives_first_waits_for_its_incident() -> None:
    p = DemoPrinter(hold_s=10.0)
    assert p.action(ACT, 0.0) == []
    assert p.due(5.0) == []
    lines = p.incident(INC, 6.0)
    assert [line.split()[0] for line in lines] == ["[bold", "[bold"]
    assert "INCIDENT" in lines[0] and "ACTION" in lines[1] and "for inc-j1-0001" in lines[1]
    assert p.action({**ACT, "id": "act-j1-0002"}, 7.0)[0].startswith("[bold yellow]ACTION[/]")  # incident known: at once


def test_an_action_whose_incident_never_comes_is_shown_after_the_hold() -> None:
    p = DemoPrinter(hold_s=10.0)
    p.action({**ACT, "incident_id": "inc-gone"}, 0.0)
    assert p.due(9.0) == [] and len(p.due(10.5)) == 1 and p.due(20.0) == []
