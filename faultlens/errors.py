"""The one exception tree of faultlens.

Third-party errors (kafka, pynvml, duckdb, xgboost) are translated into these
where they enter our code, carrying the context an operator needs (file, key,
node, rank, topic, offset)::

    FaultlensError
    ├── ConfigError          bad configuration; fails at start, names file and key
    ├── CatalogError         a bad rule/catalog entry; names file and entry
    ├── SchemaError          a message or line that does not decode; names topic/offset
    ├── BusError             the Kafka bus (connect, produce, consume)
    │   └── BrokerStartError the embedded broker did not come up
    ├── SourceError          a collector source failed (not "no data": see NoData)
    │   └── NoData           the source has nothing to read here (no GPU, no log)
    ├── ModelError           learned models
    │   ├── NotFittedError   predict before fit
    │   └── FeatureMismatch  missing features, or a model from another feature set
    ├── ActionError          remediation actions
    │   ├── Refused          the runner will not carry out an action (unsafe, unsupported); nothing ran
    │   └── Pending          the scheduler cannot take it now (controller down, node unknown): retried
    └── LakeError            the Parquet lake or a DuckDB catalog
"""

from __future__ import annotations


class FaultlensError(Exception):
    """Base of every error faultlens raises on purpose."""


class UsageError(FaultlensError):
    """Arguments that cannot work together; the message names the flag and what it needs."""


class ConfigError(FaultlensError):
    def __init__(self, message: str, *, file: str | None = None, key: str | None = None):
        where = ", ".join(x for x in (f"file {file}" if file else "", f"key {key}" if key else "") if x)
        super().__init__(f"{message} ({where})" if where else message)
        self.file = file
        self.key = key


class CatalogError(FaultlensError):
    def __init__(self, message: str, *, file: str, entry: str | None = None):
        where = f"{file}" + (f", entry {entry}" if entry else "")
        super().__init__(f"{where}: {message}")
        self.file = file
        self.entry = entry


class SchemaError(FaultlensError):
    """A message that cannot be decoded into a record; `reason` is short and stable."""

    def __init__(self, reason: str, *, kind: str | None = None, detail: str = ""):
        text = f"{kind}: {reason}" if kind else reason
        super().__init__(f"{text}: {detail}" if detail else text)
        self.reason = reason
        self.kind = kind
        self.detail = detail


class BusError(FaultlensError):
    pass


class BrokerStartError(BusError):
    pass


class SourceError(FaultlensError):
    pass


class NoData(SourceError):
    """Not a failure: this host has nothing for the source (no GPU, no such log)."""


class ModelError(FaultlensError):
    pass


class NotFittedError(ModelError):
    pass


class FeatureMismatch(ModelError):
    pass


class ActionError(FaultlensError):
    """Remediation actions: the runner and its adapters."""


class Refused(ActionError):
    """The action cannot be carried out safely or at all by this adapter; nothing runs."""


class Pending(ActionError):
    """The scheduler cannot act on it now (its controller does not answer, it does not know a node):
    the runner reports ``pending`` with the scheduler's own message and tries again later."""


class LakeError(FaultlensError):
    pass
