"""Agent sources as plugins: the ``Source`` protocol and the registry.

A source is one kind of node input (NVML samples, the kernel log, NCCL logs, step
timings, stack dumps). Each collector module registers the sources it provides
with ``register_source(name, factory)``; the agent builds the sources named in
``agent.sources`` and loops over them, knowing none by name. A name that is not
registered yet is looked up by importing ``faultlens.collectors.<name>``, so adding
a source touches one module (the one that registers it), one config entry
(``agent.sources`` and the source's own keys in ``[agent]``) and one test.

A source talks to the agent only through ``AgentServices`` (emit records, report
its health, count bad input): it never sees the spool, the producer or another
source.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from faultlens.errors import ConfigError

if TYPE_CHECKING:
    from faultlens.config import Config


class AgentServices(Protocol):
    """What the agent offers its sources."""

    node: str
    job: str | None
    config: Config
    bootstrap: str | None
    from_end: bool
    ship_ordinary: bool
    health: dict[str, Any]  # name -> SourceHealth
    clock: Callable[[], float]
    #: PCI bus -> GPU index, filled by the NVML source; the kernel parser reads it.
    gpu_map: dict[str, int]

    @property
    def stop_event(self) -> threading.Event: ...
    def emit_many(self, records: list[Any]) -> None: ...
    def set_state(self, name: str, state: str, detail: str = "") -> None: ...
    def success(self, name: str, lines: int = 0, records: int = 0, now: float | None = None) -> None: ...
    def parse_failure(self, name: str) -> None: ...
    def say_once(self, key: str, level: int, msg: str, *args: Any) -> None: ...
    def ship_log_lines(self, name: str, parser: Any, lines: list[str], unparsed: Callable[[str, Exception], Any]) -> int: ...
    def ship_parsed(self, name: str, parser: Any, items: list[Any]) -> int: ...


@runtime_checkable
class Source(Protocol):
    """One input of the node agent. ``poll`` runs on the agent's loop thread every tick.

    Optional: ``fileno() -> int | None``, a descriptor readable when the source has
    something new (the agent's loop blocks on it between ticks: followed files, /dev/kmsg);
    ``republish()``, called when the broker lost what it held (state a source publishes
    once, such as the ``jobs`` source's topology, is sent again)."""

    name: str

    def start(self, positions: dict[str, Any]) -> None:
        """Open what the source reads (``positions``: what ``positions()`` saved last run)."""

    def poll(self, now: float) -> None:
        """Read what is new and emit its records; must not block."""

    def holding(self) -> bool:
        """True while a parsed record waits for possible continuation lines."""

    def positions(self) -> dict[str, Any] | None:
        """Where to resume after a restart (None: nothing to save)."""

    def drain(self) -> None:
        """Emit what is held back; called once at shutdown, before delivery closes."""

    def close(self) -> None:
        """Release files, threads and devices."""


class SourceBase:
    """Defaults for the optional parts of ``Source``."""

    name = ""

    def __init__(self, agent: AgentServices, options: dict[str, Any]):
        self.agent = agent
        self.options = options

    def start(self, positions: dict[str, Any]) -> None:
        pass

    def poll(self, now: float) -> None:
        pass

    def holding(self) -> bool:
        return False

    def positions(self) -> dict[str, Any] | None:
        return None

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


#: Builds a source for one agent; ``options`` are the caller's overrides (a backend, a path).
SourceFactory = Callable[[AgentServices, dict[str, Any]], Source]
_REGISTRY: dict[str, SourceFactory] = {}


def register_source(name: str, factory: SourceFactory) -> None:
    """Make ``name`` available to ``agent.sources``; a collector module calls this at import."""
    _REGISTRY[name] = factory


def _import_collector(name: str) -> None:
    """Import ``faultlens.collectors.<name>`` so that it registers what it provides (absent: nothing)."""
    try:
        importlib.import_module(f"faultlens.collectors.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"faultlens.collectors.{name}":
            raise


def source_factory(name: str) -> SourceFactory:
    """The factory registered as ``name``, importing ``faultlens.collectors.<name>`` on first use."""
    if name not in _REGISTRY:
        _import_collector(name)
    if name not in _REGISTRY:
        raise ConfigError(f"agent.sources: unknown source {name!r} (registered: {', '.join(sorted(_REGISTRY))})")
    return _REGISTRY[name]


def registered() -> list[str]:
    """Names registered so far (the built-in ones once their modules are imported)."""
    return sorted(_REGISTRY)


# ---------------------------------------------------------------- text log parsers
# The collectors that parse text logs (kernel, NCCL) register their parser too, so that the
# agent (which kinds a catalog names), the batch reader (DIR/nodes/<node>/...) and
# ``faultlens explain`` build parsers through here, never by importing a parser class.

@dataclass(frozen=True)
class LogParser:
    """A registered text-log parser: ``make(node, **options)`` builds one (options: ``job``,
    ``year``, ``gpu_map``, ``default_ts``, ``boot_time``, ``extra_hot``; a parser ignores what it
    does not use); ``kinds()`` is its catalog's kind table; ``batch_files`` are the globs it reads
    under a batch directory's ``nodes/<node>/``."""

    name: str
    make: Callable[..., Any]
    kinds: Callable[[], Any]
    batch_files: tuple[str, ...]


_PARSERS: dict[str, LogParser] = {}
#: The text-log families of the batch directory (DESIGN.md): each is a collector module.
LOG_FAMILIES = ("kernel", "nccl")


def register_log_parser(parser: LogParser) -> None:
    """Make a text-log parser available by name; a collector module calls this at import."""
    _PARSERS[parser.name] = parser


def log_parser(name: str) -> LogParser:
    """The parser registered as ``name``, importing ``faultlens.collectors.<name>`` on first use."""
    if name not in _PARSERS:
        _import_collector(name)
    if name not in _PARSERS:
        raise ConfigError(f"no text-log parser {name!r} (registered: {', '.join(sorted(_PARSERS))})")
    return _PARSERS[name]


def log_parsers(names: tuple[str, ...] = LOG_FAMILIES) -> list[LogParser]:
    """The parsers of ``names`` (every text-log family by default)."""
    return [log_parser(n) for n in names]
