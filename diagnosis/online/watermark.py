"""How far the step timings have been read: a job's silence is judged only up to there.

Why: a hang is "no step for a while, the hosts alive", judged in event time, and
event time moves with every record, GPU samples included. Draining a backlog
(after an outage, a restart, a slow instance) the client hands over the input
topics unevenly: a minute of GPU samples can be forwarded before the step
timings of that minute. Measured (benchmarks/scaleout.py, fleet without faults):
librdkafka fetching a 600 s backlog decided 32 outputs with one instance and 123
with four, kafka-python 2 with four; replaying a fleet with its GPU samples 100 s
ahead of its steps restarted all 8 jobs. A job is silent only if its steps were
read and none came.

So every repartitioner says, about once a second, how far it has read each step
timings partition it holds: the Kafka timestamp of the last record forwarded from
it, or the wall clock less ``LATENESS_S`` when it has read to the partition's end.
The mark goes to every ``diag-repartition`` partition after the forwards it
covers (key ``~wm``, header ``k: watermark``), so an instance that reads it has
read every step it covers. The service ticks a job's engine with the mark of the
job's step partition as ``steps_read_until`` (the engine judges silence no later
than that). A partition just taken judges no silence until marks come (at most
``FIRST_MARK_WAIT_S``); a job whose step partition has no mark after that (no
repartitioner holds it, or one of an older version) is judged as before.

A mark says what was read, not what producers will still send: "read to the end"
holds only for what reached the broker, and an agent resending its spool after a
broker outage delivers minutes of records late, GPU samples and steps from
different agents. So a silence must also stay a hang for ``HANG_DWELL_S`` of wall
time before it is called: late records reach the service within seconds of each
other. The newest mark replaces the one before (a new holder reading a partition
again says less: judging waits); a forged mark can hold hang detection back, as a
forged forward could do worse: only the diagnosis principal writes the topic.
"""

from __future__ import annotations

import math
from typing import Any

import orjson
from kafka.partitioner.default import murmur2

WM_KEY = "~wm"
WM_KIND = b"watermark"
LATENESS_S = 10.0  # a step record may reach the broker this long after its time (agent batching, retries)
INTERVAL_S = 1.0  # how often a repartitioner says how far it has read
# A partition just taken judges no silence until its first mark, for at most this long (a repartitioner
# of an older version sends none; then silence is judged as before).
FIRST_MARK_WAIT_S = 30.0
# A silence stays a hang this long in wall time before it is called (see the module docstring).
HANG_DWELL_S = 30.0


def steps_partition(job: str, partitions: int) -> int:
    """The step timings partition of ``job``'s records (Kafka's default partitioner on the job key)."""
    return (murmur2(job.encode()) & 0x7FFFFFFF) % partitions


def encode(topic: str, partitions: int, read_until: dict[int, float]) -> bytes:
    """A repartitioner's mark: the step topic, its partition count and {partition: read until}."""
    return orjson.dumps({"v": 1, "topic": topic, "n": partitions, "until": {str(p): t for p, t in read_until.items()}})


def decode(value: bytes | None) -> tuple[str, int, dict[int, float]]:
    """A mark read back, every value checked (ValueError says what is wrong)."""
    try:
        doc: Any = orjson.loads(value or b"")
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("v") != 1:
        raise ValueError("not a watermark of version 1")
    topic, n, until = doc.get("topic"), doc.get("n"), doc.get("until")
    if not isinstance(topic, str) or type(n) is not int or not 0 < n <= 100_000 or not isinstance(until, dict):
        raise ValueError("a watermark without its topic, partition count or marks")
    out: dict[int, float] = {}
    for p, t in until.items():
        if not str(p).isdigit() or int(p) >= n or type(t) not in (int, float) or not math.isfinite(t):
            raise ValueError(f"bad mark {p!r}: {t!r}")
        out[int(p)] = float(t)
    return topic, n, out


class StepMarks:
    """What one instance has read of the marks, per ``diag-repartition`` partition (diagnosis side)."""

    def __init__(self) -> None:
        self._until: dict[int, dict[int, float]] = {}  # diag partition -> step partition -> read until
        self._partitions = 0  # the step topic's partition count, as the repartitioners said
        self.bad = 0

    def note(self, diag_partition: int, value: bytes | None) -> bool:
        """The newest mark for a step partition replaces the one before: a lower one (the partition's new
        holder reading it again, a backlog arriving after a quiet spell) holds judging back, as it should."""
        try:
            _, n, until = decode(value)
        except ValueError:
            self.bad += 1
            return False
        self._partitions = n
        self._until.setdefault(diag_partition, {}).update(until)
        return True

    def read_until(self, diag_partition: int, job: str) -> float | None:
        """How far ``job``'s step timings have been read, as seen on its partition; None: no mark yet."""
        marks = self._until.get(diag_partition)
        if not marks or not self._partitions:
            return None
        return marks.get(steps_partition(job, self._partitions))

    def forget(self, diag_partition: int) -> None:
        self._until.pop(diag_partition, None)
