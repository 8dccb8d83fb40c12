"""The agent's ``elastic`` source: torchrun's error files, the failing rank's own exception.

A training script whose entry point is wrapped in torch's ``@record``
(``torch.distributed.elastic.multiprocessing.errors``) writes, when it dies of an
exception, a JSON error file at ``TORCHELASTIC_ERROR_FILE``: torchrun sets it per rank to
``<log dir>/<run id>/attempt_<n>/<local rank>/error.json`` (``--log-dir``, else a temporary
directory). The file holds ``{"message": {"message": "Type: text", "extraInfo":
{"py_callstack": "Traceback ...", "timestamp": "<unix s>"}}}``. torchrun's own summary
names the root cause only once every rank has stopped; this file is there the moment the
rank fails, with the whole traceback.

Every ``agent.error_files_glob`` match not seen before (path, mtime, size) is read once
into one ``traceback`` record, the kind a rank's log gives (collectors/nccl.py): ``exception``
the message's first line, the text the traceback, ``fields["source"] =
"torchelastic_error_file"``. The global rank is
the job file's rank on this node whose ``gpu`` is the local rank (else the local rank,
said in ``fields``). A file that is not an error file is a dead letter, counted.
"""

from __future__ import annotations

import glob
import json
import os
import re
import time
from typing import Any

from faultlens.collectors.sources import AgentServices, SourceBase, register_source

RESCAN_S = 1.0  # error files are few and written once: a glob a second
LOCAL_RANK_RE = re.compile(r"attempt_\d+/(\d+)/[^/]+$")


def read_error_file(text: str) -> tuple[str, str, float | None]:
    """(exception line, traceback, unix time or None) of one error file's text; ValueError if it is none."""
    obj = json.loads(text)
    msg = obj.get("message") if isinstance(obj, dict) else None
    if isinstance(msg, str):  # an error file written by hand or by an older torch: the message alone
        return msg.strip().splitlines()[-1] if msg.strip() else "", msg, None
    if not isinstance(msg, dict) or "message" not in msg:
        raise ValueError("not a torchelastic error file (no message)")
    info = msg.get("extraInfo") or {}
    stack = str(info.get("py_callstack") or msg["message"])
    try:
        ts: float | None = float(info["timestamp"])
    except (KeyError, TypeError, ValueError):
        ts = None
    return str(msg["message"]), stack, ts


def local_rank_of(path: str) -> int | None:
    m = LOCAL_RANK_RE.search(path.replace(os.sep, "/"))
    return int(m.group(1)) if m else None


class ElasticErrorSource(SourceBase):
    """Reads each new torchrun error file once (``options["glob"]`` or ``agent.error_files_glob``)."""

    name = "elastic"

    def __init__(self, agent: AgentServices, options: dict[str, Any]):
        super().__init__(agent, options)
        self.pattern = str(options.get("glob") or agent.config.agent.error_files_glob)
        self._seen: dict[str, list[float]] = {}
        self._next = 0.0

    def start(self, positions: dict[str, Any]) -> None:
        if not self.pattern:
            self.agent.set_state(self.name, "off", "no error_files_glob configured")
            return
        saved = positions.get("seen") if isinstance(positions, dict) else None
        if isinstance(saved, dict):
            self._seen = {str(k): list(v) for k, v in saved.items()}
        elif self.agent.from_end:  # files already there belong to an earlier run: not news
            for path in glob.glob(self.pattern, recursive=True):
                self._seen[path] = self._stamp(path) or [0.0, 0.0]
        self.agent.set_state(self.name, "ok", f"watching {self.pattern}")

    @staticmethod
    def _stamp(path: str) -> list[float] | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return [st.st_mtime, float(st.st_size)]

    def poll(self, now: float) -> None:
        if not self.pattern or now < self._next:
            return
        self._next = now + RESCAN_S
        records: list[Any] = []
        for path in glob.glob(self.pattern, recursive=True):
            stamp = self._stamp(path)
            if stamp is None or stamp[1] == 0 or self._seen.get(path) == stamp:
                continue
            self._seen[path] = stamp
            records += self.read(path)
        if records:
            self.agent.emit_many(records)
            self.agent.success(self.name, lines=len(records), records=len(records), now=now)

    def _global_rank(self, local: int | None) -> int | None:
        if local is None:
            return None
        path = self.agent.config.agent.job_file
        if path:
            try:
                with open(path, "rb") as f:
                    ranks = json.load(f).get("ranks", {})
                for rank, where in ranks.items():
                    if where.get("node") == self.agent.node and int(where.get("gpu", -1)) == local:
                        return int(rank)
            except (OSError, ValueError, AttributeError, TypeError):
                pass
        return None

    def read(self, path: str) -> list[Any]:
        """The records of one error file (a dead letter when it is not one)."""
        from faultlens import schema
        from faultlens.stream import topics

        agent = self.agent
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read(1 << 20)
            exception, stack, ts = read_error_file(text)
        except (OSError, ValueError, AttributeError) as exc:
            agent.parse_failure(self.name)
            return [schema.DeadLetter(time.time(), topics.topic("nccl", agent.config.bus.topic_prefix), -1, -1,
                                      "not_an_error_file", f"{path}: {exc}"[:300], agent.node, "", 0)]
        local = local_rank_of(path)
        rank = self._global_rank(local)
        fields = {"source": "torchelastic_error_file", "path": path, "local_rank": local,
                  "rank_from": "job file" if rank is not None else "local rank"}
        # One record per file, built from the file's own parts: the message names the exception (a gloo
        # or NCCL error runs over many lines after it, which a line parser would cut into pieces).
        first = exception.strip().splitlines()[0][:500] if exception.strip() else ""
        return [schema.NcclEvent(ts=ts if ts is not None else agent.clock(), node=agent.node, kind="traceback",
                                 raw=stack[:schema.MAX_MESSAGE_BYTES // 4], message=stack[:schema.MAX_MESSAGE_BYTES // 4],
                                 rank=rank if rank is not None else local, job=agent.job, exception=first or None,
                                 fields=fields)]

    def positions(self) -> dict[str, Any] | None:
        return {"seen": self._seen} if self.pattern else None


register_source("elastic", ElasticErrorSource)
