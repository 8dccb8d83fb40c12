"""Registry of fault kinds: name -> class. A new kind is one module and one line here."""

from __future__ import annotations

from faultlens.datasets.fault_app_xid import AppXid
from faultlens.datasets.fault_base import Fault
from faultlens.datasets.fault_driver_recovery import DriverRecovery
from faultlens.datasets.fault_ecc_uncorrectable import EccUncorrectable
from faultlens.datasets.fault_gpu_lost import GpuLost
from faultlens.datasets.fault_hang_stuck_rank import HangStuckRank
from faultlens.datasets.fault_host_oom import HostOom
from faultlens.datasets.fault_hung_task import HungTask
from faultlens.datasets.fault_ib_flap_transient import IbFlapTransient
from faultlens.datasets.fault_ib_link_persistent import IbLinkPersistent
from faultlens.datasets.fault_nan_loss import NanLoss
from faultlens.datasets.fault_nvlink_error import NvlinkError
from faultlens.datasets.fault_pcie_degradation import PcieDegradation
from faultlens.datasets.fault_row_remap_failure import RowRemapFailure
from faultlens.datasets.fault_seq_surge import SeqSurge
from faultlens.datasets.fault_slow_storage import SlowStorage
from faultlens.datasets.fault_thermal_throttle import ThermalThrottle
from faultlens.datasets.fault_user_exception import UserException

FAULTS: dict[str, type[Fault]] = {
    cls.KIND: cls
    for cls in (
        GpuLost, EccUncorrectable, RowRemapFailure, NvlinkError, IbLinkPersistent, IbFlapTransient,
        PcieDegradation, ThermalThrottle, HostOom, HungTask, UserException, NanLoss, HangStuckRank,
        SlowStorage, SeqSurge, DriverRecovery, AppXid,
    )
}
# "healthy" is a scenario without faults, not a fault kind.
SCENARIO_KINDS = ("healthy", *FAULTS)


def fault_class(kind: str) -> type[Fault]:
    try:
        return FAULTS[kind]
    except KeyError:
        raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(sorted(FAULTS))}") from None
