"""Container runtimes' log files: the process's own line out of its wrapper (standard library only).

``kubectl logs`` and ``docker logs`` print a process's lines bare, but the files a
runtime keeps on the node wrap each one: containerd and CRI-O write
``<RFC3339Nano> <stream> <F|P> <line>`` (/var/log/pods/...), Docker's json-file driver
``{"log": "<line>\\n", "stream": "stderr", "time": "<RFC3339Nano>"}``. NCCL / torch and
framework step logs are read from such files as often as from plain ones. Imported by
collectors/steps.py, which a training process loads, so it needs nothing but Python.
"""

from __future__ import annotations

import datetime as dt
import json
import re

CRI_RE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:?\d\d)) (?:stdout|stderr) [FP] ")


def _rfc3339(text: str) -> float | None:
    """RFC 3339 time with nanoseconds (Python reads microseconds): unix seconds, or None."""
    m = re.match(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:?\d\d)?$", text.strip())
    if m is None:
        return None
    try:
        t = dt.datetime.fromisoformat(m.group(1) + ("+00:00" if m.group(3) in (None, "Z") else m.group(3)))
    except ValueError:
        return None
    return t.timestamp() + (float("0." + m.group(2)) if m.group(2) else 0.0)


def unwrap_container(raw: str) -> tuple[str, float | None]:
    """A container runtime's log line -> (the process's own line, the runtime's time); else (raw, None)."""
    if raw.startswith('{"log"'):
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            return raw, None
        if isinstance(obj, dict) and isinstance(obj.get("log"), str):
            t = obj.get("time")
            return obj["log"].rstrip("\r\n"), _rfc3339(t) if isinstance(t, str) else None
        return raw, None
    if raw[:1].isdigit():
        m = CRI_RE.match(raw)
        if m:
            return raw[m.end():], _rfc3339(m.group(1))
    return raw, None
