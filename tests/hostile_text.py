"""Log text that is also markup, and counters of the markup a report or page would act on.

Issue 24's "Safe text": report.md carried raw ``<script>``, ``<img onerror>`` and Markdown
images from log text, a backtick broke its evidence spans, and the explorer fetched images
named in kernel text and node names. ``hostile_lake`` adds such text to the scenario lake
(in a directory whose name holds a quote); ``markdown_markup`` and ``html_markup`` count
what a renderer would run or fetch. Used by tests/test_ui_safe_text.py and
benchmarks/redteam.py's ``safe_text`` attack.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from faultlens.schema import GpuSample, GpuState, Incident, KernelEvent
from faultlens.ui.text import one_line
from tests.ui_scenario import FAULT_TS, JOB, build_lake, write_records

EVIL = "evil.example"
SCRIPT = "<script>document.title='pwned'</script>"
IMG = f'<img src="http://{EVIL}/onerror.png" onerror="document.title=1">'
MD_IMAGE = f"![pixel](http://{EVIL}/pixel.png)"
BACKTICKS = "a`b``c"
HOSTILE_NODE = f"n666![n](http://{EVIL}/node.png)"
HOSTILE_ID = "inc-hostile-0001"
# A kernel line as a driver would print it, with the hostile text where a process name goes
HOSTILE_LINE = (f"[ 2401.000001] NVRM: Xid (PCI:0000:9d:00): 79, pid=4242, name={SCRIPT}{IMG}{MD_IMAGE} {BACKTICKS}, "
                "GPU has fallen off the bus.")


@dataclass(frozen=True)
class HostileLake:
    path: Path
    job: str = JOB
    incident_id: str = HOSTILE_ID
    node: str = HOSTILE_NODE
    texts: tuple[str, ...] = (HOSTILE_LINE, f"{BACKTICKS} {SCRIPT}", f"`{IMG}`")  # the incident's evidence


def hostile_lake(root: Path) -> HostileLake:
    """The scenario lake under ``root/it's lake/``, plus an incident, kernel line and machine whose
    text is markup: a report or page must show it as text."""
    out = HostileLake(build_lake(root / "it's lake" / "lake").path)
    suspects = [{"node": HOSTILE_NODE, "gpu": 1, "score": 0.99, "reason": f"xid.79: {MD_IMAGE} {IMG} {SCRIPT}"}]
    write_records(out.path, [
        GpuSample(ts=FAULT_TS + 1, node=HOSTILE_NODE, job=JOB, gpus=[GpuState(index=1, temp_c=60.0)]),
        KernelEvent(ts=FAULT_TS + 1, node=HOSTILE_NODE, kind="xid", raw=HOSTILE_LINE, xid=79, gpu=1),
        Incident(id=HOSTILE_ID, job=JOB, opened_ts=FAULT_TS + 1, updated_ts=FAULT_TS + 2, status="open",
                 category="gpu_hardware", kind="gpu_lost", severity="critical", confidence=0.99,
                 title=f"GPU fell off the bus on {HOSTILE_NODE} {SCRIPT}", summary=f"{MD_IMAGE} {IMG}",
                 suspects=suspects, actions=[],
                 evidence=[{"ts": FAULT_TS + 1 + i, "source": "kernel", "node": HOSTILE_NODE, "text": t}
                           for i, t in enumerate(out.texts)]),
    ])
    return out


def markdown_markup(text: str, *, spans: tuple[str, ...] = ()) -> dict[str, int]:
    """What a CommonMark + tables renderer would act on in ``text``: raw HTML blocks and inline
    HTML, images; ``broken_spans``: texts of ``spans`` not found whole in one code span."""
    from markdown_it import MarkdownIt

    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    counts = {"raw_html": 0, "images": 0}
    code: list[str] = []
    stack = list(tokens)
    while stack:
        tok = stack.pop()
        if tok.type in ("html_block", "html_inline"):
            counts["raw_html"] += 1
        elif tok.type == "image":
            counts["images"] += 1
        elif tok.type == "code_inline":
            code.append(tok.content)
        stack.extend(tok.children or [])
    counts["broken_spans"] = sum(1 for s in spans if not any(one_line(s).strip() == c.strip() for c in code))
    return counts


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.counts = {"script_tags": 0, "img_tags": 0, "event_handlers": 0, "remote_refs": 0}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.counts["script_tags"] += tag == "script"
        self.counts["img_tags"] += tag == "img"
        for name, value in attrs:
            self.counts["event_handlers"] += name.lower().startswith("on")
            if name in ("src", "href", "xlink:href", "action", "data") and value and re.match(r"(https?:)?//", value):
                self.counts["remote_refs"] += 1


def html_markup(text: str) -> dict[str, int]:
    """Elements of ``text`` that would run or fetch: script and img tags, on* handlers, remote refs."""
    parser = _Tags()
    parser.feed(text)
    return parser.counts
