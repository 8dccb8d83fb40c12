"""Line-by-line explanation of raw logs: the engine behind ``faultlens explain``.

Each file's format is detected from its first lines (kernel, nccl, py-spy stack,
framework step logs); every line is parsed by the same collectors the agent runs
and classified by diagnosis.classify. Every input line yields exactly one
``ExplainedLine``; a continuation line carries its record's classification; a
line nothing recognises is category ``unknown`` with rule None.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from faultlens.collectors.nvsmi_text import looks_like_nvsmi, normalize
from faultlens.collectors.sources import log_parser
from faultlens.collectors.stacks import looks_like_pyspy
from faultlens.collectors.steps import StepLogParser, step_fields_duration
from faultlens.collectors.unparsed import LONG_LINE, MAX_LINE_BYTES, clip, reason_of, too_long
from faultlens.diagnosis.classify import (
    UNRECOGNISED,
    Classification,
    ClassifyContext,
    catalogs,
    classify,
    classify_nvsmi,
    most_significant,
)
from faultlens.schema import KernelEvent, StepTiming
from faultlens.vocabulary import Category

SOURCES = ("kernel", "nccl", "stack", "steps", "nvsmi", "unknown")
_KERNEL_HINT = re.compile(r"NVRM|kernel: |^\[\s*[+]?\d+\.\d+\]|^\d+,\d+,\d+,|mlx5_core|EDAC|^kern\s+:|^\[[A-Z][a-z]{2} [A-Z][a-z]{2} ", re.M)
_NCCL_HINT = re.compile(r"NCCL (?:INFO|WARN)|ProcessGroupNCCL|Traceback \(most recent|\[rank\d+\]:|torch\.distributed|WorkNCCL|nccl\w+Error|^(?:\w+\.)*\w*(?:Error|Exception): |^\s+File \"[^\"]+\", line \d+", re.M)
_STEPS_HINT = re.compile(r"iteration\s+\d+\s*/\s*\d+|step:\s*\d+\s+loss:|global_step=|\"duration_s\"|(?<!\d)\d+/\d+ \[[\d:]+<", re.M)  # (?<!\d): linear on long digit runs
EMPTY = Classification("none", "info", "none", "Empty line.", "empty")
NOT_STEP = Classification("none", "info", "none", "Not a step line (framework log text).", "steps.other")
STACK_LINE = Classification("none", "info", "none", "Part of a py-spy stack dump; stacks are compared across ranks by the stack aggregator.", "stacks.dump")


@dataclass(frozen=True, slots=True)
class ExplainedLine:
    line_no: int
    text: str
    source: str
    c: Classification

    def to_json(self) -> dict:
        c = self.c
        return {"line_no": self.line_no, "text": self.text, "source": self.source, "category": c.category,
                "xid": c.xid, "severity": c.severity, "action": c.action, "meaning": c.meaning,
                # added fields (DESIGN's are kept): which signature catalog and entry said so, and its source
                "family": c.family or None, "entry": c.rule, "reference": c.reference or None}


def detect_format(head: list[str]) -> str:
    """kernel | nccl | stack | steps | nvsmi | unknown, from the first lines of a file."""
    text = "\n".join(head)
    # A py-spy dump's frames may name NCCL (``--native``: ncclGroupEnd, ProcessGroupNCCL::allreduce):
    # only NCCL words outside its indented frame lines say the file is a log that holds a dump.
    if looks_like_pyspy(text) and not _NCCL_HINT.search("\n".join(x for x in head if not x[:1].isspace())):
        return "stack"
    if looks_like_nvsmi(text) and not (_KERNEL_HINT.search(text) or _NCCL_HINT.search(text) or _STEPS_HINT.search(text)):
        return "nvsmi"
    scores = {"kernel": len(_KERNEL_HINT.findall(text)), "nccl": len(_NCCL_HINT.findall(text)),
              "steps": len(_STEPS_HINT.findall(text))}
    best = max(scores, key=lambda k: scores[k])
    if scores[best] == 0:
        return "kernel"  # plain text: the kernel catalog's error-word rule still speaks for it
    return best


def unparsed(reason: str) -> Classification:
    """A line that gave no record: what explain says instead of a traceback (collectors/unparsed.py)."""
    return Classification("unknown", "warning", "none", f"Unparsed: {reason}", UNPARSED, family=UNPARSED)


UNPARSED = "unparsed"
LONG = unparsed(f"{LONG_LINE} (over {MAX_LINE_BYTES:,} bytes); not parsed, text cut")
NOT_RECOGNISED = Classification("unknown", "info", "none", "Not recognised.", None)


def _classify(rec: Any, ctx: ClassifyContext) -> Classification:
    try:
        return classify(rec, ctx)
    except Exception as exc:  # noqa: BLE001 - one odd record must not stop the file
        return unparsed(f"classification failed: {reason_of(exc)}")


BATCH = 4096


def _parsed(parser: Any, lines: Iterable[str], source: str, ordinary: Classification | None) -> Iterator[ExplainedLine]:
    """Every line through ``parser``, one ExplainedLine each, in order, whatever the lines hold.

    With ``ordinary`` (kernel only), batches go through ``feed_many``: ordinary lines skip
    parsing and classification. A batch the fast path fails on is replayed line by line on
    a clean parser; a line ``feed`` fails on is ``unparsed`` with the reason, and so are the
    lines of the record it left open (the parser starts clean after it). A line over
    MAX_LINE_BYTES is not parsed (the parser sees a record boundary) and its text is cut.
    """
    ctx = ClassifyContext()
    pending: deque[tuple[int, str]] = deque()
    long_lines: set[int] = set()

    def out(n: int, t: str, c: Classification) -> ExplainedLine:
        if n in long_lines:
            long_lines.discard(n)
            return ExplainedLine(n, clip(t), source, LONG)
        return ExplainedLine(n, t, source, c)

    def drain(items: list[Any]) -> Iterator[ExplainedLine]:
        pop = pending.popleft
        for it in items:
            if isinstance(it, int):
                for _ in range(it):
                    if not pending:
                        return
                    n, t = pop()
                    yield out(n, t, ordinary if ordinary is not None and t.strip() else EMPTY)
            else:
                c = _classify(it, ctx)
                for _ in range(it.raw.count("\n") + 1):
                    if not pending:
                        return
                    n, t = pop()
                    yield out(n, t, c)

    def lost(no: int | None, reason: str) -> Iterator[ExplainedLine]:
        """The parser failed: the lines it held, and line ``no``, are unparsed; it starts clean."""
        held = unparsed(f"in the record open when line {no} failed ({reason})") if no is not None else unparsed(reason)
        bad = unparsed(reason)
        while pending:
            n, t = pending.popleft()
            yield out(n, t, bad if n == no else held)
        parser.reset()

    def one(no: int, line: str) -> Iterator[ExplainedLine]:
        pending.append((no, line))
        text = "" if no in long_lines else line
        try:
            items = parser.feed(text)
        except Exception as exc:  # noqa: BLE001
            yield from failed(no, line, reason_of(exc))
            return
        yield from drain([*items, 1] if not text.strip() else items)

    def failed(no: int, line: str, reason: str) -> Iterator[ExplainedLine]:
        """Line ``no`` failed: the record open before it is closed as it stands (when that works), then the line."""
        pending.pop()
        try:
            held = parser.flush()
        except Exception:  # noqa: BLE001 - then its lines go as unparsed too
            pending.append((no, line))
            yield from lost(no, reason)
            return
        yield from drain(held)
        pending.append((no, line))
        yield from lost(no, reason)

    def run(batch: list[tuple[int, str]]) -> Iterator[ExplainedLine]:
        if ordinary is None:
            for no, line in batch:
                yield from one(no, line)
            return
        pending.extend(batch)
        try:
            items = parser.feed_many(["" if no in long_lines else line for no, line in batch])
        except Exception:  # noqa: BLE001 - replayed line by line below, where the line is named
            replay = list(pending)
            pending.clear()
            parser.reset()
            for no, line in replay:
                yield from one(no, line)
            return
        yield from drain(items)

    batch: list[tuple[int, str]] = []
    for no, line in enumerate(lines, 1):
        line = line.rstrip("\r\n")
        if too_long(line):
            long_lines.add(no)
        batch.append((no, line))
        if len(batch) >= BATCH:
            yield from run(batch)
            batch = []
    yield from run(batch)
    try:
        items = parser.finish() if ordinary is not None else parser.flush()
    except Exception as exc:  # noqa: BLE001
        yield from lost(None, f"at the end of the input: {reason_of(exc)}")
        items = []
    yield from drain(items)
    while pending:  # never drop a line
        n, t = pending.popleft()
        yield out(n, t, EMPTY if not t.strip() else NOT_RECOGNISED)


def _ordinary_fast_path() -> tuple[tuple[str, ...], Classification] | None:
    """(extra words, classification) for the kernel fast path, or None when it cannot be proven exact.

    A line the parser settles as ordinary is a kind ``other`` record without any
    catalog word; its classification is that of the first kind-``other`` rule that
    has no condition, provided every rule before it has an ``any`` prefilter (whose
    words the parser then treats as hot).
    """
    words: list[str] = []
    for r in catalogs().kernel:
        if "other" not in r.kinds:
            continue
        if r.any:
            words += r.any
        elif r.match is not None:
            return None
        else:
            break
    c = classify(KernelEvent(0.0, "", "other", "", ""))
    if c.rule is None:
        return None
    return tuple(words), c


def _steps(lines: Iterable[str]) -> Iterator[ExplainedLine]:
    parser = StepLogParser()
    for no, line in enumerate(lines, 1):
        line = line.rstrip("\r\n")
        if too_long(line):
            yield ExplainedLine(no, clip(line), "steps", LONG)
            continue
        try:
            c = _step(parser, line)
        except Exception as exc:  # noqa: BLE001 - one bad line must not stop the file
            parser = StepLogParser()
            c = unparsed(reason_of(exc))
        yield ExplainedLine(no, line, "steps", c)


def _step(parser: StepLogParser, line: str) -> Classification:
    s = line.strip()
    c = NOT_STEP
    if s.startswith("{"):
        try:
            obj = orjson.loads(s)
            c = classify(StepTiming(ts=float(obj.get("ts", 0)), job=str(obj.get("job", "")), rank=int(obj.get("rank", 0)),
                                    node=str(obj.get("node", "")), step=int(obj.get("step", 0)),
                                    duration_s=float(obj.get("duration_s", 0)), loss=_f(obj.get("loss")),
                                    grad_norm=_f(obj.get("grad_norm"))))
        except (orjson.JSONDecodeError, TypeError, ValueError, AttributeError, OverflowError):
            c = Classification("unknown", "warning", "notify", "A JSON step line that does not decode.", None)
    else:
        got = [g for g in parser.feed(line)] + ([] if parser._held is None else [parser._held])
        if got:
            fw, f = got[-1]
            loss = _f(f.get("lm_loss", f.get("loss")))
            gn = _f(f.get("grad_norm"))
            step = f.get("iteration", f.get("step", f.get("global_step", 0)))
            c = classify(StepTiming(ts=0.0, job="", rank=0, node="", step=int(step or 0),
                                    duration_s=step_fields_duration(f) or 0.0, loss=loss, grad_norm=gn))
            if c.rule == "steps.timing":
                c = Classification("none", "info", "none", f"A {fw} step line: timing, loss and throughput of one step.", "steps.timing")
        elif not s:
            c = EMPTY
    return c


def _f(v: object) -> float | None:
    try:
        return None if v is None else float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def explain_lines(lines: Iterable[str], fmt: str | None = None, *, year: int | None = None) -> Iterator[ExplainedLine]:
    """Explain every line; ``fmt`` None: detect from the first 200 lines."""
    it = iter(lines)
    head: list[str] = []
    if fmt is None:
        for line in it:
            head.append(line)
            if len(head) >= 200:
                break
        fmt = detect_format(head)

    def all_lines() -> Iterator[str]:
        yield from head
        yield from it

    fast = _ordinary_fast_path() if fmt == "kernel" else None
    if fast is not None:
        yield from _parsed(log_parser("kernel").make(year=year, extra_hot=fast[0]), all_lines(), "kernel", fast[1])
    elif fmt == "kernel":
        yield from _parsed(log_parser("kernel").make(year=year), all_lines(), "kernel", None)
    elif fmt == "nccl":
        yield from _parsed(log_parser("nccl").make(year=year), all_lines(), "nccl", None)
    elif fmt == "stack":
        for no, line in enumerate(all_lines(), 1):
            line = line.rstrip("\r\n")
            yield ExplainedLine(no, clip(line), "stack", LONG) if too_long(line) else (
                ExplainedLine(no, line, "stack", STACK_LINE if line.strip() else EMPTY))
    elif fmt == "steps":
        yield from _steps(all_lines())
    elif fmt == "nvsmi":  # nvidia-smi -q / dcgmi diag text: catalogs/nvsmi.toml
        yield from _nvsmi(all_lines())
    else:
        for no, line in enumerate(all_lines(), 1):
            line = line.rstrip("\r\n")
            yield ExplainedLine(no, clip(line), "unknown", LONG) if too_long(line) else (
                ExplainedLine(no, line, "unknown", NOT_RECOGNISED))


def _nvsmi(lines: Iterable[str]) -> Iterator[ExplainedLine]:
    raw = [ln.rstrip("\r\n") for ln in lines]
    long = {i for i, ln in enumerate(raw) if too_long(ln)}
    text = ["" if i in long else ln for i, ln in enumerate(raw)]
    try:
        norm = list(normalize(text))
    except Exception:  # noqa: BLE001 - each line on its own (sections are lost), the failing one named
        norm = []
        for ln in text:
            try:
                norm.extend(normalize([ln]))
            except Exception as exc:  # noqa: BLE001
                norm.append(_BAD + reason_of(exc))
    for no, (line, n) in enumerate(zip(raw, norm, strict=True), 1):
        if no - 1 in long:
            yield ExplainedLine(no, clip(line), "nvsmi", LONG)
            continue
        if n.startswith(_BAD):
            c = unparsed(n[len(_BAD):])
        elif not line.strip():
            c = EMPTY
        else:
            try:
                c = classify_nvsmi(n)
            except Exception as exc:  # noqa: BLE001
                c = unparsed(f"classification failed: {reason_of(exc)}")
        yield ExplainedLine(no, line, "nvsmi", c)


_BAD = "\x00unparsed\x00"


# --------------------------------------------------------------------------- agreement with labels

KERNEL_CATEGORY = {"gpu_memory_ecc": Category.GPU_MEMORY, "thermal": Category.THERMAL_POWER}
# NCCL labels use their own taxonomy. Collective timeouts and fabric configuration
# failures are classified as `network` (where collectives broke); `unknown` in a
# label means the thread never found a cause, so it makes no category claim.
NCCL_CATEGORY = {"timeout": "network", "config": "network"}
ACTIONS = {"drain_node": {"evict_node"}, "investigate": {"notify", "run_diagnostics"}}


def score_real_logs(directory: str) -> dict:
    """Agreement of explain's verdict per labelled sample with the real-logs labels.

    A sample's verdict is the most significant classification among its lines
    (``most_significant``). Matched: category (README's mapping), Xid and action.
    """
    import json
    from pathlib import Path


    rows = []
    total_lines = unrecognised = 0
    for source in ("kernel", "nccl"):
        for raw in (Path(directory) / f"{source}.jsonl").read_text().splitlines():
            sample = json.loads(raw)
            lab = sample["labels"]
            lines = sample["text"].split("\n")
            explained = list(explain_lines(lines, source))
            total_lines += len(explained)
            unrecognised += sum(1 for e in explained if e.c.rule is None)
            v = most_significant(e.c for e in explained if e.c.rule != "empty") or UNRECOGNISED  # an empty sample
            problems = []
            if source == "kernel":
                want_cat = KERNEL_CATEGORY.get(lab["category"], lab["category"])
                if lab.get("xid") != v.xid:
                    problems.append(f"xid {v.xid} != {lab.get('xid')}")
                want_act = ACTIONS.get(lab["expected_action"], {lab["expected_action"]})
                if v.action not in want_act:
                    problems.append(f"action {v.action} not in {sorted(want_act)}")
            else:
                want_cat = NCCL_CATEGORY.get(lab["category"], lab["category"])
            if want_cat != "unknown" and v.category != want_cat:
                problems.append(f"category {v.category} != {want_cat}")
            rows.append({"id": sample["id"], "source": source, "category": v.category, "xid": v.xid, "action": v.action,
                         "rule": v.rule, "ok": not problems, "problems": problems})
    matched = sum(r["ok"] for r in rows)
    return {"samples": len(rows), "matched": matched, "rate": matched / len(rows) if rows else 0.0,
            "lines": total_lines, "unrecognised_lines": unrecognised, "rows": rows}
