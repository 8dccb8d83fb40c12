"""``faultlens explain``: what every line of a raw log means and what to do about it."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import Any

from faultlens.collectors.unparsed import SNIFF_BYTES, read_lines, sniff_binary
from faultlens.diagnosis.explain import explain_lines

HELP = ("Classify every line of raw logs (kernel/dmesg/journal, NCCL/torch.distributed, py-spy stacks, "
        "Megatron/DeepSpeed/torchtitan step logs; auto-detected per file) and print what it means and the "
        "recommended action. Lines nothing recognises are listed as category 'unknown', never dropped.")
EXAMPLE = "dmesg --time-format iso | faultlens explain -   |   faultlens explain --json kern.log nccl-rank0.log"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="*", metavar="FILE",
                        help="log files; '-' or none (with lines piped in) reads standard input")
    parser.add_argument("--json", action="store_true", help="one JSON object per input line")
    parser.add_argument("--format", choices=["auto", "kernel", "nccl", "stack", "steps"], default="auto",
                        help="skip detection and read every file as this format")
    parser.add_argument("--only-findings", action="store_true", help="text mode: print only lines that are not normal")
    parser.add_argument("--year", type=int, default=None, help="year for syslog timestamps that have none")


def _open(name: str) -> Any:
    """A buffered binary reader (the lines are read by collectors.unparsed.read_lines)."""
    if name == "-":
        return sys.stdin.buffer
    return open(name, "rb")  # noqa: SIM115 - closed by the caller


def _sniff(fh: Any) -> str | None:
    """Why the file is not text (collectors.unparsed.sniff_binary), without consuming it."""

    peek = getattr(fh, "peek", None)
    head = peek(SNIFF_BYTES)[:SNIFF_BYTES] if peek is not None else b""
    return sniff_binary(head)


def run(args: argparse.Namespace, config: Any) -> int:
    import orjson


    if not args.files:
        if sys.stdin is None or sys.stdin.isatty():
            print("faultlens explain: give log FILEs, or pipe lines in (dmesg | faultlens explain)", file=sys.stderr)
            return 2
        args.files = ["-"]
    several = len(args.files) > 1
    out = sys.stdout.buffer
    counts: Counter[str] = Counter()
    fmt = None if args.format == "auto" else args.format
    worst = 0
    sev_rank = {"info": 0, "warning": 1, "critical": 2}
    for name in args.files:
        try:
            fh = _open(name)
        except OSError as exc:
            print(f"faultlens explain: {name}: {exc}", file=sys.stderr)
            return 1
        head = b'{"file":' + orjson.dumps(name) + b"," if several else b"{"
        binary = _sniff(fh)
        if binary is not None:  # one line that says so, never the bytes echoed back
            fh.close()
            counts["unparsed"] += 1
            worst = max(worst, sev_rank["warning"])
            if args.json:
                out.write(head + orjson.dumps({"line_no": 0, "text": "", "source": "unparsed", "category": "unknown",
                                               "xid": None, "severity": "warning", "action": "none",
                                               "meaning": f"Unparsed: {binary}", "family": "unparsed",
                                               "entry": "unparsed", "reference": None})[1:] + b"\n")
            else:
                where = f"{name}:0" if several else f"{'':>7}"
                out.write(f"{where} warning  unparsed      none            {name}: {binary}\n".encode("utf-8", "replace"))
            continue
        # the classification part of a line is shared by many lines: serialise it once, count per classification
        tails: dict[tuple[int, str], tuple[Any, bytes]] = {}
        per_c: dict[tuple[int, str], int] = {}
        with fh:
            buf: list[bytes] = []
            last_rule: object = ()
            for e in explain_lines(read_lines(fh), fmt, year=args.year):
                c = e.c
                key = (id(c), e.source)
                got = tails.get(key)
                if got is None or got[0] is not c:
                    if got is not None:  # the id of a classification that is gone: settle its count first
                        counts[got[0].category] += per_c.pop(key, 0)
                        worst = max(worst, sev_rank[got[0].severity])
                    got = tails[key] = (c, orjson.dumps({"source": e.source, "category": c.category, "xid": c.xid,
                                                         "severity": c.severity, "action": c.action, "meaning": c.meaning,
                                                         "family": c.family or None, "entry": c.rule,
                                                         "reference": c.reference or None})[1:])
                    per_c.setdefault(key, 0)
                per_c[key] += 1
                if args.json:
                    buf.append(b"%s\"line_no\":%d,\"text\":%s,%s\n" % (head, e.line_no, orjson.dumps(e.text), got[1]))
                else:
                    if args.only_findings and c.category == "none":
                        last_rule = ()
                        continue
                    # several files: every line says which file (name:line, as grep -n does)
                    where = f"{name}:{e.line_no}" if several else f"{e.line_no:>7}"
                    line = f"{where} {c.severity:<8} {c.category:<13} {c.action:<15} {e.text}\n"
                    if c.category != "none" and (c.rule, c.meaning) != last_rule:
                        xid = f"Xid {c.xid}: " if c.xid is not None and not c.meaning.startswith("Xid ") else ""
                        entry = f"[{c.family} {c.rule}] " if c.rule else ""
                        line += f"{f'{name}:' if several else ' ' * 7} -> {entry}{xid}{c.meaning}\n"
                    last_rule = (c.rule, c.meaning)
                    buf.append(line.encode("utf-8", "replace"))
                if len(buf) >= 4096:
                    out.write(b"".join(buf))
                    buf.clear()
            out.write(b"".join(buf))
        for key, n in per_c.items():
            c = tails[key][0]
            counts[c.category] += n
            worst = max(worst, sev_rank[c.severity])
    out.flush()
    if not args.json:
        summary = ", ".join(f"{k}: {v}" for k, v in counts.most_common())
        print(f"faultlens explain: {sum(counts.values())} lines ({summary})", file=sys.stderr)
    return 0
