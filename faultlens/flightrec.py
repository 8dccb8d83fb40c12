"""PyTorch Flight Recorder dumps: read them safely, find the ranks missing at the wavefront.

With ``TORCH_NCCL_TRACE_BUFFER_SIZE`` (NCCL) or ``TORCH_FR_BUFFER_SIZE`` (any backend, gloo
included, torch 2.6+) set, every rank records its last collectives; on a watchdog timeout
(``TORCH_NCCL_DUMP_ON_TIMEOUT``) or when asked (``torch._C._distributed_c10d._dump_fr_trace``,
``_dump_fr_trace_json``) each writes them, by default to ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` +
rank (``/tmp/nccl_trace_rank_<rank>``), as a pickle or JSON. The shape, from PyTorch's
torch/csrc/distributed/c10d/FlightRecorder.hpp (formerly NCCLUtils/TraceUtils.h) and
torch/distributed/flight_recorder (fr_trace) that reads them::

    {"version": "2.10", "comm_lib_version": "", "pg_config": {name: {"name", "desc", "ranks": "[0, 1]"}},
     "pg_status": {pg_id: {"last_enqueued_collective", "last_started_collective",
                           "last_completed_collective"}},
     "entries": [{"record_id", "pg_id", "process_group": (name, desc), "collective_seq_id",
                  "p2p_seq_id", "op_id", "profiling_name": "nccl:all_reduce", "time_created_ns",
                  "state": "scheduled" | "started" | "completed", "retired", "is_p2p", "frames", ...}]}

Versions read (fr_trace compares ``major.minor`` as integers: "2.10" is after "2.9", never
2.1): 1.x have ``seq_id``, no ``pg_status``, ``pg_config`` ranks as a list and
``process_group`` as a list; 2.0-2.3 ``collective_seq_id``/``p2p_seq_id``; 2.4 sizes of
all-to-all, ``pg_status``; 2.7+ coalesced non-p2p groups; 2.10 (torch 2.13/2.14) adds
``thread_name``/``thread_id`` and is what gloo writes. Later versions are read the same way
(fields are looked up by name, unknown ones ignored). What real gloo dumps of torch 2.13
(version "2.10", tests/fixtures/real_torch/) do that NCCL's do not: ``profiling_name`` is
``gloo:all_reduce``; every entry stays ``scheduled`` for ever, completion shows only in
``retired`` and ``pg_status.last_completed_collective``; ``pg_config`` is keyed ``''``
(name ``''``) while the entries say ``('0', 'default_pg')``; ``comm_lib_version`` is empty.
So an entry's state here is the furthest of its own ``state``, ``retired`` and its group's
``pg_status``, and a group named only in the entries takes the ranks of the configured group
it is (same name, same description, or the one unnamed group).

Every shape is reduced to a small summary (per process group: the ranks, each collective's
sequence id and state), which travels as a StackDump record (``MARKER`` + JSON) from the
batch reader or the agent to diagnosis.

The pickle is read with an unpickler whose ``find_class`` refuses every global: only the
plain containers and scalars pickle builds itself (dict, list, tuple, str, bytes, int,
float, bool, None) can come out; a dump asking for any class or function is an error,
and nothing in it runs.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from collections.abc import Mapping
from typing import Any

MARKER = "# faultlens flight-recorder summary v1\n"
MAX_BYTES = 64 * 1024 * 1024
RANK_IN_NAME_RE = re.compile(r"(\d+)(?:\.(?:json|pkl|pickle))?$")
P2P_NAME_RE = re.compile(r"\b(send|recv|isend|irecv|_coalesced_p2p)\b", re.IGNORECASE)
STATES = ("scheduled", "started", "completed")
NEWEST_KNOWN = (2, 10)  # the newest dump version seen (torch 2.13/2.14); newer ones are read by field name
NO_DUMP = "wrote no dump"  # the words of a silent rank's reason (diagnosis.hangroot does not count it twice)
KEEP_COLLECTIVES = 16  # per process group: the wavefront needs the last few, not the whole ring buffer


class FlightRecorderError(ValueError):
    """A dump that is not a Flight Recorder dump, or that asks the unpickler for a class."""


class _PlainUnpickler(pickle.Unpickler):
    """Plain containers only: any GLOBAL / STACK_GLOBAL (a class, a function) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise FlightRecorderError(f"refused to load {module}.{name}: a Flight Recorder dump holds plain data only")

    def persistent_load(self, pid: Any) -> Any:
        raise FlightRecorderError("refused a persistent id: a Flight Recorder dump holds plain data only")


def loads(data: bytes) -> dict[str, Any]:
    """The dump's top-level dict, from pickle or JSON bytes."""
    if len(data) > MAX_BYTES:
        raise FlightRecorderError(f"{len(data)} bytes is over the {MAX_BYTES} byte limit")
    head = data.lstrip()[:1]
    if head in (b"{", b"["):
        try:
            obj = json.loads(data.decode("utf-8", "replace"))
        except json.JSONDecodeError as exc:
            raise FlightRecorderError(f"not valid JSON: {exc}") from None
    else:
        try:
            obj = _PlainUnpickler(io.BytesIO(data)).load()
        except FlightRecorderError:
            raise
        except Exception as exc:  # noqa: BLE001 - any unpickling failure is a bad file, named as such
            raise FlightRecorderError(f"not a readable pickle: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, dict) or not ("entries" in obj or "pg_config" in obj or "version" in obj):
        raise FlightRecorderError("not a Flight Recorder dump (no version, pg_config or entries)")
    return obj


def _ranks(value: Any) -> list[int]:
    if isinstance(value, str):
        return [int(x) for x in re.findall(r"-?\d+", value)]
    if isinstance(value, (list, tuple)):
        return [int(x) for x in value if isinstance(x, (int, float)) or (isinstance(x, str) and x.lstrip("-").isdigit())]
    return []


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    return None


def _pg_key(entry: Mapping[str, Any]) -> tuple[str, str]:
    """(name, description) of the process group an entry belongs to."""
    pg = entry.get("process_group")
    if isinstance(pg, (list, tuple)) and pg:
        return str(pg[0]), str(pg[1]) if len(pg) > 1 else ""
    if isinstance(pg, str):
        return pg, ""
    return str(entry.get("pg_id", "0")), ""


def version_tuple(version: Any) -> tuple[int, int] | None:
    """``"2.10"`` -> (2, 10), as fr_trace compares them (never as a float); None when unreadable."""
    m = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", str(version))
    return (int(m.group(1)), int(m.group(2))) if m else None


def _progress(dump: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """pg_status: pg name/id -> (last started, last completed) collective sequence ids (-1: none)."""
    out: dict[str, tuple[int, int]] = {}
    status = dump.get("pg_status")
    if isinstance(status, Mapping):
        for pg, st in status.items():
            if isinstance(st, Mapping):
                started = _int(st.get("last_started_collective"))
                completed = _int(st.get("last_completed_collective"))
                out[str(pg)] = (-1 if started is None else started, -1 if completed is None else completed)
    return out


def _state(e: Mapping[str, Any], seq: int, progress: tuple[int, int] | None) -> str:
    """The furthest state the dump shows for an entry: its own, ``retired`` (gloo marks completion only
    there), or its group's pg_status."""
    state = str(e.get("state", ""))
    state = state if state in STATES else "unknown"
    if e.get("retired") in (True, "true", "True") or (progress is not None and seq <= progress[1]):
        return "completed"
    if state in ("scheduled", "unknown") and progress is not None and seq <= progress[0]:
        return "started"
    return state


def summarise(dump: Mapping[str, Any], rank: int | None) -> dict[str, Any]:
    """The summary diagnosis needs: {rank, version, pgs: {pg: {ranks, desc, collectives: [[seq, state, op]]}}}."""
    if rank is None:
        rank = _int(dump.get("rank"))
    configured: dict[str, dict[str, Any]] = {}
    config = dump.get("pg_config") or {}
    if isinstance(config, Mapping):
        for name, cfg in config.items():
            if isinstance(cfg, Mapping):
                configured[str(cfg.get("name", name))] = {"ranks": _ranks(cfg.get("ranks")),
                                                          "desc": str(cfg.get("desc", "")), "collectives": []}
    progress = _progress(dump)
    entries = dump.get("entries") or []
    if not isinstance(entries, list):
        raise FlightRecorderError("entries is not a list")
    pgs: dict[str, dict[str, Any]] = {}
    for e in entries:
        if not isinstance(e, Mapping):
            continue
        name = str(e.get("profiling_name", ""))
        if e.get("is_p2p") in (True, "true", "True") or P2P_NAME_RE.search(name):
            continue  # p2p ops have their own sequence, per pair: the collective wavefront is read here
        seq = _int(e.get("collective_seq_id", e.get("seq_id")))  # an int, or its string (PyTorch's own tests)
        if seq is None:
            continue
        pg_name, pg_desc = _pg_key(e)
        pg = pgs.get(pg_name)
        if pg is None:
            pg = pgs[pg_name] = _configured_as(configured, pg_name, pg_desc)
        prog = progress.get(pg_name) or progress.get(str(e.get("pg_id", "")))
        pg["collectives"].append([seq, _state(e, seq, prog), name[:60]])
    for name, cfg in configured.items():
        if not cfg.get("_taken"):
            pgs.setdefault(name, cfg)
    for pg in pgs.values():
        pg.pop("_taken", None)
        pg["collectives"] = sorted(pg["collectives"])[-KEEP_COLLECTIVES:]
    out = {"rank": rank, "version": str(dump.get("version", "")), "pgs": pgs}
    vt = version_tuple(out["version"])
    if vt is not None and vt > NEWEST_KNOWN:
        out["note"] = f"version {out['version']} is newer than {NEWEST_KNOWN[0]}.{NEWEST_KNOWN[1]}: read by field name"
    return out


def _configured_as(configured: dict[str, dict[str, Any]], name: str, desc: str) -> dict[str, Any]:
    """The configured group an entry's (name, desc) is: the same name, else the same description, else the
    one unnamed group (gloo's default group is configured as ``''`` while its entries say ``'0'``)."""
    cfg = configured.get(name)
    if cfg is None and desc:
        cfg = next((c for c in configured.values() if c["desc"] == desc and not c.get("_taken")), None)
    if cfg is None and "" in configured and not configured[""].get("_taken"):
        cfg = configured[""]
    if cfg is None:
        return {"ranks": [], "desc": desc, "collectives": []}
    cfg["_taken"] = True
    return {"ranks": list(cfg["ranks"]), "desc": cfg["desc"] or desc, "collectives": [], "_taken": True}


def rank_from_name(name: str) -> int | None:
    """The rank a dump file is for: the digits its name ends with (``nccl_trace_rank_12``, ``12.json``)."""
    m = RANK_IN_NAME_RE.search(name)
    return int(m.group(1)) if m else None


def summary_text(summary: Mapping[str, Any]) -> str:
    """The summary as the text of a StackDump record."""
    return MARKER + json.dumps(summary, separators=(",", ":"))


def from_text(text: str) -> dict[str, Any] | None:
    """A summary carried in a StackDump's text; None when the text is a stack dump."""
    if not text.startswith(MARKER):
        return None
    try:
        obj = json.loads(text[len(MARKER):])
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def wavefront(summaries: Mapping[int, Mapping[str, Any]]) -> dict[int, list[str]]:
    """Ranks missing at the wavefront of a process group -> why, one line per process group.

    Per process group, the wavefront is the highest collective any rank entered. A rank
    behind it (its last collective is earlier: it never enqueued the one the others are in)
    or holding it only as "scheduled" while the others started it (its GPU never got to
    it) is missing there; so is a member of the group that wrote no dump while the others wait
    (``_no_dump``). Only a minority can be missing: when most ranks are behind, the ones
    ahead are the odd ones, and that is not read as a culprit. With gloo nothing is ever
    "started" (summarise reads completion from ``retired``/``pg_status``), so there a rank
    is missing by being behind or silent, never by its state.
    """
    # a group is its name and its ranks: names alone may repeat across groups in older versions
    groups: dict[tuple[str, tuple[int, ...]], dict[int, tuple[int, str, str]]] = {}
    for rank, summ in summaries.items():
        for pg_name, pg in (summ.get("pgs") or {}).items():
            key = (str(pg_name), tuple(sorted(pg.get("ranks") or [])))
            colls = pg.get("collectives") or []
            if colls:
                seq, state, op = colls[-1]
                groups.setdefault(key, {})[rank] = (int(seq), str(state), str(op))
            elif pg.get("ranks"):
                groups.setdefault(key, {})[rank] = (-1, "none", "")
    out: dict[int, list[str]] = {}
    for (name, members), last in sorted(groups.items()):
        if len(last) < 2:
            continue
        front = max(seq for seq, _, _ in last.values())
        at_front = {r: st for r, (seq, st, _) in last.items() if seq == front}
        op = next((o for seq, _, o in last.values() if seq == front and o), "a collective")
        started = [r for r, st in at_front.items() if st in ("started", "completed")]
        missing: dict[int, str] = {}
        for r, (seq, st, _) in last.items():
            if seq < front:
                missing[r] = (f"Flight Recorder: rank {r} never entered collective #{front} ({op}) of process group "
                              f"{name} that {len(at_front)} rank(s) are in (its last is #{seq})")
            elif st == "scheduled" and started:
                missing[r] = (f"Flight Recorder: rank {r} has collective #{front} ({op}) of process group {name} "
                              f"scheduled but never started on its GPU, while {len(started)} rank(s) started it")
        if missing and len(missing) < 0.5 * len(last):
            for r, why in missing.items():
                out.setdefault(r, []).append(why)
        for r, why in _no_dump(name, members, last, summaries, front, op).items():
            out.setdefault(r, []).append(why)
    return out


def _no_dump(name: str, members: tuple[int, ...], last: Mapping[int, tuple[int, str, str]],
             summaries: Mapping[int, Any], front: int, op: str) -> dict[int, str]:
    """Members of a group that wrote no dump at all while the others did and wait in a collective: a rank
    frozen (SIGSTOP, a hung machine) or gone cannot write one, so its silence names it. Only a minority
    can be named so: when most wrote nothing, the dumps were not collected, and that says nothing."""
    absent = [r for r in members if r not in summaries]
    waiting = [r for r, (seq, st, _) in last.items() if seq == front and st != "completed"]
    if not absent or not waiting or len(last) < 2 or len(absent) >= 0.5 * len(members):
        return {}
    return {r: (f"Flight Recorder: rank {r} of process group {name} {NO_DUMP} while {len(last)} rank(s) of it "
                f"did, {len(waiting)} of them waiting in collective #{front} ({op})") for r in absent}
