"""The one vocabulary of faultlens: categories, severities, actions and fault kinds.

Every other module, catalog loader and UI page takes these names from here; no module
redeclares them (tests/test_vocabulary.py greps for stray declarations). The values are
the strings of the wire contract (DESIGN.md: `explain --json`, action types), so a
``StrEnum`` member compares equal to, and serialises as, its plain string.

Two kinds of "kind" exist on purpose:
- ``FaultKind``: what a machine or job suffered (simulator ground truth, labels a person
  gives in the explorer, what the classifier predicts);
- ``IncidentKind``: what diagnosis opens an incident for (coarser for some faults: a
  persistent IB link and a transient flap are both ``ib_link`` until they repeat).
"""

from __future__ import annotations

from enum import StrEnum


class Category(StrEnum):
    """What part of the system a line, finding or incident points at."""

    GPU_HARDWARE = "gpu_hardware"
    GPU_MEMORY = "gpu_memory"
    NVLINK = "nvlink"
    PCIE = "pcie"
    NETWORK = "network"
    HOST = "host"
    DRIVER = "driver"
    USER_SOFTWARE = "user_software"
    THERMAL_POWER = "thermal_power"
    STORAGE = "storage"
    NONE = "none"  # a normal line
    UNKNOWN = "unknown"


class Severity(StrEnum):
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


SEVERITY_RANK: dict[str, int] = {Severity.INFO: 0, Severity.WARNING: 1, Severity.CRITICAL: 2}


class LineAction(StrEnum):
    """What to do about one log line (``explain``'s vocabulary, per node or GPU)."""

    NONE = "none"
    RESTART_JOB = "restart_job"
    RESET_GPU = "reset_gpu"
    EVICT_NODE = "evict_node"
    ROLLBACK_CODE = "rollback_code"
    RUN_DIAGNOSTICS = "run_diagnostics"
    NOTIFY = "notify"


class ActionType(StrEnum):
    """What the job runner is told to do (the ``actions`` topic)."""

    EVICT_NODES = "evict_nodes"
    RESTART_JOB = "restart_job"
    ROLLBACK_CODE = "rollback_code"
    RUN_DIAGNOSTICS = "run_diagnostics"
    ADAPT_PARALLELISM = "adapt_parallelism"
    NOTIFY = "notify"


class FaultKind(StrEnum):
    """What a machine or job suffered: ground truth, labels and classifier classes."""

    HEALTHY = "healthy"
    GPU_LOST = "gpu_lost"
    ECC_UNCORRECTABLE = "ecc_uncorrectable"
    ROW_REMAP_FAILURE = "row_remap_failure"
    NVLINK_ERROR = "nvlink_error"
    IB_LINK_PERSISTENT = "ib_link_persistent"
    IB_FLAP_TRANSIENT = "ib_flap_transient"
    PCIE_DEGRADATION = "pcie_degradation"
    THERMAL_THROTTLE = "thermal_throttle"
    HOST_OOM = "host_oom"
    HUNG_TASK = "hung_task"
    USER_EXCEPTION = "user_exception"
    NAN_LOSS = "nan_loss"
    HANG_STUCK_RANK = "hang_stuck_rank"
    SLOW_STORAGE = "slow_storage"
    SEQ_SURGE = "seq_surge"
    FAIL_SLOW = "fail_slow"
    OTHER = "other"


class IncidentKind(StrEnum):
    """What diagnosis opens an incident for."""

    GPU_LOST = "gpu_lost"
    GPU_HARDWARE = "gpu_hardware"
    ECC_UNCORRECTABLE = "ecc_uncorrectable"
    ROW_REMAP_FAILURE = "row_remap_failure"
    ROW_REMAP_PENDING = "row_remap_pending"
    RETIRED_PAGES = "retired_pages"
    NVLINK_ERROR = "nvlink_error"
    PCIE_DEGRADATION = "pcie_degradation"
    IB_LINK = "ib_link"
    IB_LINK_RECOVERED = "ib_link_recovered"
    THERMAL_THROTTLE = "thermal_throttle"
    FAIL_SLOW = "fail_slow"
    HOST_OOM = "host_oom"
    HUNG_TASK = "hung_task"
    USER_EXCEPTION = "user_exception"
    NAN_LOSS = "nan_loss"
    HANG = "hang"
    SLOW_STORAGE = "slow_storage"
    STORAGE = "storage"
    SEQ_SURGE = "seq_surge"
    FABRIC_STORM = "fabric_storm"
    UNCLASSIFIED = "unclassified"


INCIDENT_CATEGORY: dict[str, Category] = {
    IncidentKind.GPU_LOST: Category.GPU_HARDWARE,
    IncidentKind.GPU_HARDWARE: Category.GPU_HARDWARE,
    IncidentKind.ECC_UNCORRECTABLE: Category.GPU_MEMORY,
    IncidentKind.ROW_REMAP_FAILURE: Category.GPU_MEMORY,
    IncidentKind.ROW_REMAP_PENDING: Category.GPU_MEMORY,
    IncidentKind.RETIRED_PAGES: Category.GPU_MEMORY,
    IncidentKind.NVLINK_ERROR: Category.NVLINK,
    IncidentKind.PCIE_DEGRADATION: Category.PCIE,
    IncidentKind.IB_LINK: Category.NETWORK,
    IncidentKind.IB_LINK_RECOVERED: Category.NETWORK,
    IncidentKind.THERMAL_THROTTLE: Category.THERMAL_POWER,
    IncidentKind.FAIL_SLOW: Category.UNKNOWN,
    IncidentKind.HOST_OOM: Category.HOST,
    IncidentKind.HUNG_TASK: Category.HOST,
    IncidentKind.USER_EXCEPTION: Category.USER_SOFTWARE,
    IncidentKind.NAN_LOSS: Category.UNKNOWN,
    IncidentKind.HANG: Category.UNKNOWN,
    IncidentKind.SLOW_STORAGE: Category.STORAGE,
    IncidentKind.STORAGE: Category.STORAGE,
    IncidentKind.SEQ_SURGE: Category.NONE,
    IncidentKind.FABRIC_STORM: Category.NETWORK,
    IncidentKind.UNCLASSIFIED: Category.UNKNOWN,
}

INCIDENT_TITLE: dict[str, str] = {
    IncidentKind.GPU_LOST: "GPU lost (fallen off the bus)",
    IncidentKind.ECC_UNCORRECTABLE: "uncorrectable ECC error",
    IncidentKind.ROW_REMAP_FAILURE: "row remapping failure",
    IncidentKind.NVLINK_ERROR: "NVLink errors",
    IncidentKind.PCIE_DEGRADATION: "PCIe degradation",
    IncidentKind.IB_LINK: "InfiniBand link down",
    IncidentKind.THERMAL_THROTTLE: "thermal throttling",
    IncidentKind.FAIL_SLOW: "fail-slow machine",
    IncidentKind.HOST_OOM: "host out of memory (OOM killer)",
    IncidentKind.HUNG_TASK: "kernel hung task",
    IncidentKind.USER_EXCEPTION: "same Python exception on the ranks",
    IncidentKind.NAN_LOSS: "NaN loss",
    IncidentKind.HANG: "job hang",
    IncidentKind.SLOW_STORAGE: "slow storage",
    IncidentKind.STORAGE: "storage errors",
    IncidentKind.GPU_HARDWARE: "GPU hardware error",
    IncidentKind.FABRIC_STORM: "fabric-level storm",
}

FAULT_CATEGORY: dict[str, Category] = {
    FaultKind.HEALTHY: Category.NONE,
    FaultKind.GPU_LOST: Category.GPU_HARDWARE,
    FaultKind.ECC_UNCORRECTABLE: Category.GPU_MEMORY,
    FaultKind.ROW_REMAP_FAILURE: Category.GPU_MEMORY,
    FaultKind.NVLINK_ERROR: Category.NVLINK,
    FaultKind.IB_LINK_PERSISTENT: Category.NETWORK,
    FaultKind.IB_FLAP_TRANSIENT: Category.NETWORK,
    FaultKind.PCIE_DEGRADATION: Category.PCIE,
    FaultKind.THERMAL_THROTTLE: Category.THERMAL_POWER,
    FaultKind.HOST_OOM: Category.HOST,
    FaultKind.HUNG_TASK: Category.HOST,
    FaultKind.USER_EXCEPTION: Category.USER_SOFTWARE,
    FaultKind.NAN_LOSS: Category.UNKNOWN,
    FaultKind.HANG_STUCK_RANK: Category.UNKNOWN,
    FaultKind.SLOW_STORAGE: Category.STORAGE,
    FaultKind.SEQ_SURGE: Category.NONE,
    FaultKind.FAIL_SLOW: Category.UNKNOWN,
    FaultKind.OTHER: Category.UNKNOWN,
}


def values(enum: type[StrEnum]) -> tuple[str, ...]:
    """The plain strings of an enum, in declaration order (for catalogs, selects, schemas)."""
    return tuple(m.value for m in enum)
