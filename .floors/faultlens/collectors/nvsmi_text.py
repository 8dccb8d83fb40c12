"""`nvidia-smi -q` and `dcgmi diag` text as lines the nvsmi signatures can read.

``nvidia-smi -q`` nests sections by indentation (``Remapped Rows`` / ``Pending : Yes``);
a value means something only with its section, so each ``Key : Value`` line becomes
``Section/Sub/Key: Value``. Table rows (``| ... |``) and other lines stay as printed.
Pure text in, text out: classification is faultlens.collectors.signatures (catalogs/nvsmi.toml).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

KV_RE = re.compile(r"^(\s*)([^:|+=\s][^:]*?)\s*:\s*(.*?)\s*(?:<=+\s*)?$")
SECTION_RE = re.compile(r"^(\s*)([A-Za-z][\w ./()-]*?)\s*$")
HINT_RE = re.compile(r"=+NVSMI LOG=+|^\s*(?:Driver Version|CUDA Version|Attached GPUs|Product Name)\s{2,}: |"
                     r"^\s*(?:Remapped Rows|Retired [Pp]ages|ECC Errors|ECC Mode)\s*$|^\|\s*Diagnostic\s+\||"
                     r"^\+[-=]{8,}\+|^\s+[A-Z][\w ()-]*?\s{2,}: \S", re.M)


def looks_like_nvsmi(text: str) -> bool:
    """nvidia-smi -q or a dcgmi diag table (three hints: a section, aligned `Key   : Value`
    lines, table borders; or the log banner)."""
    return "NVSMI LOG" in text or len(HINT_RE.findall(text)) >= 3


def normalize(lines: Iterable[str]) -> Iterator[str]:
    """One normalised text per input line (same count, same order)."""
    stack: list[tuple[int, str]] = []  # (indent, section)
    for raw in lines:
        line = raw.rstrip("\r\n")
        if not line.strip() or line.lstrip().startswith(("|", "+", "=", "[...]")):
            yield line.strip()
            continue
        m = KV_RE.match(line)
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "/".join(s for _, s in stack)
        if m and m.group(3) != "":
            key = m.group(2).strip()
            yield f"{path}/{key}: {m.group(3)}" if path else f"{key}: {m.group(3)}"
            continue
        s = SECTION_RE.match(line)
        if s:
            stack.append((indent, s.group(2).strip()))
            yield f"{path}/{s.group(2).strip()}" if path else s.group(2).strip()
            continue
        yield line.strip()
