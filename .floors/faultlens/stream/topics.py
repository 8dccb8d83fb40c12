"""Topic names: ``<prefix>.<name>``, prefix ``faultlens`` by default.

Keys are the node name (telemetry) or the job id (job-level streams), so one
node's events stay ordered in one partition.
"""

from __future__ import annotations

DEFAULT_PREFIX = "faultlens"

# kind -> topic name suffix (the kinds are the record kinds of faultlens.schema)
NAMES = (
    "gpu",
    "kernel",
    "nccl",
    "steps",
    "stacks",
    "jobs",
    "incidents",
    "actions",
    "action-status",
    "commands",
    "deadletter",
    "diag-repartition",
    "diag-changelog",
    "diag-guard",
    "diag-members",
)
# Internal topics of the online diagnosis (diagnosis.online.repartition, diagnosis.online.state): telemetry
# re-keyed by job, and the per-job state checkpoints. Both have REPARTITION_PARTITIONS
# partitions: a job's state lives in the changelog partition of its input partition.
# diag-guard: the guard log (diagnosis.guardlog), one partition so every instance folds one order.
# diag-members: the instances' heartbeats and the partitions each holds (diagnosis.online.membership),
# one partition, keyed by instance, compacted.
INTERNAL = ("diag-repartition", "diag-changelog", "diag-guard", "diag-members")
REPARTITION_PARTITIONS = 16
TELEMETRY = ("gpu", "kernel", "nccl", "steps", "stacks", "jobs")
# What the key of each kind's messages is.
KEY_FIELD = {
    "gpu": "node",
    "kernel": "node",
    "nccl": "node",
    "steps": "job",
    "stacks": "job",
    "jobs": "job",
    "incidents": "job",
    "actions": "job",
    "action-status": "job",
    "commands": "job",
    "deadletter": "topic",
    "diag-repartition": "job",
    "diag-changelog": "job",
    "diag-guard": "job",
    "diag-members": "member",
}
# Partitions created for each topic by `ensure_topics` (a real cluster may differ).
DEFAULT_PARTITIONS = {"gpu": 8, "kernel": 4, "nccl": 4, "steps": 4,
                      "diag-repartition": REPARTITION_PARTITIONS, "diag-changelog": REPARTITION_PARTITIONS}
# Topic settings asked for at creation (a broker that ignores them, like Tansu, still works).
# Compaction never touches a partition's active segment, which Kafka rolls only after 7 days or
# 1 GB by default: a restore (changelog) or a start (members) would read all of it. Rolled every
# minute and cleaned once a tenth is dirty, a restore reads one checkpoint per job plus about a
# minute of them.
_COMPACTED = {"cleanup.policy": "compact", "segment.ms": "60000", "min.cleanable.dirty.ratio": "0.1"}
TOPIC_CONFIGS = {"diag-changelog": _COMPACTED, "diag-members": _COMPACTED}


def topic(name: str, prefix: str = DEFAULT_PREFIX) -> str:
    """Full topic name of a kind, e.g. ``topic("gpu") == "faultlens.gpu"``."""
    if name not in NAMES:
        raise ValueError(f"unknown topic name {name!r}; known: {', '.join(NAMES)}")
    return f"{prefix}.{name}"


def kind_of(topic_name: str, prefix: str = DEFAULT_PREFIX) -> str:
    """Inverse of `topic`: ``kind_of("faultlens.gpu") == "gpu"``."""
    head = prefix + "."
    if not topic_name.startswith(head) or topic_name[len(head):] not in NAMES:
        raise ValueError(f"{topic_name!r} is not a faultlens topic under prefix {prefix!r}")
    return topic_name[len(head):]
