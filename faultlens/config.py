"""Typed, frozen configuration: one TOML file, ``FAULTLENS_*`` variables, flags.

Precedence, lowest first: defaults < ``faultlens.toml`` (or ``--config``) <
environment ``FAULTLENS_<SECTION>_<KEY>`` < command-line flags
(``--set section.key=value`` and the commands' own flags). Everything is
validated at start; an error names the file (or variable) and the key.

Units are in the names (``interval_s``, ``temp_limit_c``). Secrets
(``sasl_password``, ``ssl_password``, ``webhook_token``) never appear in ``describe()``
or logs (``faultlens.logsafe`` redacts them); signing keys live in their own files
(``[keys] files``), never in this file.

This module imports no faultlens part, so every part may take its section.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from faultlens.errors import CatalogError, ConfigError

SECRET_KEYS = frozenset({"sasl_password", "ssl_password", "webhook_token"})


@dataclass(frozen=True)
class BusConfig:
    """The Kafka bus. No bootstrap servers: the embedded broker (demo, tests)."""

    bootstrap_servers: str = ""
    topic_prefix: str = "faultlens"
    client_id: str = "faultlens"
    security_protocol: str = "PLAINTEXT"  # PLAINTEXT | SSL | SASL_PLAINTEXT | SASL_SSL
    sasl_mechanism: str = ""  # PLAIN | SCRAM-SHA-256 | SCRAM-SHA-512
    sasl_username: str = ""
    sasl_password: str = ""
    ssl_cafile: str = ""
    ssl_certfile: str = ""
    ssl_keyfile: str = ""
    ssl_password: str = ""
    compression: str = "lz4"  # none | gzip | lz4 | zstd (zstd needs its Python package); lz4: ~3x faster to consume than none
    linger_ms: int = 20
    batch_size_bytes: int = 1_048_576
    max_poll_interval_ms: int = 300_000
    session_timeout_ms: int = 45_000


@dataclass(frozen=True)
class LakeConfig:
    path: str = "lake"
    catalog_path: str = "faultlens-catalog.duckdb"
    flush_interval_s: float = 5.0
    flush_rows: int = 200_000
    group_id: str = "faultlens-stream"
    metrics_port: int = 0  # 0: no /metrics endpoint
    metrics_host: str = "127.0.0.1"
    # The processor's Kafka client (stream/bus/lake_fetchers.py): "auto" (confluent-kafka when installed and
    # the bus is a real cluster, else kafka-python), "kafka" (kafka-python: its broker-restart
    # handling covers the memory-only embedded broker) or "confluent" (confluent-kafka: ~1.3-1.7x
    # the lake rate; kafka-python's record parsing is the processor's wall).
    fetcher: str = "auto"


@dataclass(frozen=True)
class AgentConfig:
    node: str = ""  # empty: this host's name
    job: str = ""
    sources: tuple[str, ...] = ("nvml", "kernel", "nccl", "steps", "stacks", "jobs", "elastic", "flight_recorder")
    nvml_interval_s: float = 1.0
    kernel_follow: str = "auto"  # auto | kmsg | journal | file path
    nccl_glob: str = ""
    steps_glob: str = ""
    # torchrun's per-rank error files (TORCHELASTIC_ERROR_FILE, written by @record), e.g.
    # "/var/log/train/**/error.json" under torchrun's --log-dir: the failing rank's traceback.
    error_files_glob: str = ""
    # Flight Recorder dumps the ranks write on their own (faultlens.torch's stall watchdog, NCCL's dump
    # on timeout), e.g. "/tmp/nccl_trace_rank_*" (TORCH_NCCL_DEBUG_INFO_TEMP_FILE + rank): shipped as
    # they appear, not only when diagnosis asks (dump_stacks).
    flight_recorder_glob: str = ""
    # The job's topology as the launcher writes it (job.json, DESIGN.md's batch format): the
    # ``jobs`` source publishes it at start, on change, and again after a broker loss.
    job_file: str = ""
    spool_dir: str = "/var/lib/faultlens/spool"
    spool_max_bytes: int = 256 * 1024 * 1024
    health_interval_s: float = 30.0
    # The loop wakes when a followed file changes (inotify) or /dev/kmsg has a record, so a
    # fault line is read at once; this is the longest sleep without such an event (periodic
    # work, the polling fallback where inotify is missing).
    tick_s: float = 0.5
    # At most one produce request per this many seconds while records keep coming (each
    # costs kafka-python ~1.5 ms of CPU); the first urgent record (a log line, a stack
    # dump, a lost GPU) after a quiet spell of urgent ones is sent at once. 0: every tick.
    min_send_interval_s: float = 2.0
    # A recognised fault line (Xid, SXid, a link down, an NCCL watchdog...) is sent at once
    # unless another went within this interval: in a storm of them one request per interval
    # carries them all (benchmarks/agent_overhead.py writes ~6 a second), and it takes every
    # record queued with it, so the sends of a busy node stay about one a second.
    fault_send_interval_s: float = 1.0
    # Every record sent is kept this long in <spool_dir>/sent; when the broker shows it lost
    # records it had acknowledged (a partition's offsets went back), they are all sent again
    # and the stream processor keeps each once (natural key: node, agent epoch, seq).
    resend_window_s: float = 600.0
    metrics_port: int = 0  # 0: no /metrics endpoint
    metrics_host: str = "127.0.0.1"  # the DaemonSet sets 0.0.0.0 so Prometheus can scrape the pod
    # Ordinary log lines (kind "other", NCCL INFO: noise no pattern recognises) are counted
    # per source, not shipped one record each; true ships them too.
    ship_ordinary_lines: bool = False


@dataclass(frozen=True)
class DiagnosisConfig:
    group_id: str = "faultlens-diagnosis"
    catalog_path: str = "faultlens-diagnosis.duckdb"
    burst_gap_s: float = 180.0
    network_alerts_to_evict: int = 2
    network_window_s: float = 300.0
    hang_no_progress_s: float = 600.0
    # Online: a silence stays a hang this long in wall time before it is called. Draining a backlog (after
    # an outage, or agents resending their spools late) the clients hand the topics over unevenly: GPU
    # samples move event time minutes past step timings that arrive seconds later (benchmarks/scaleout.py
    # counted 22-32 false job hangs on a fleet without faults). 0: call at once. The demo scales it by
    # its --speed (its clock runs that much faster than the wall clock).
    hang_dwell_s: float = 30.0
    # Online: a partition that heard no record for this long (wall time) ticks on its newest record's time
    # plus the quiet: a job whose ranks all died sends nothing (CPU nodes send no GPU samples), and its
    # settle and grace times must still end (benchmarks/realjob.py: an exception's rollback waited for ever).
    # A backlog being drained is never quiet. 0: event time only.
    idle_clock_after_s: float = 2.0
    # ...but never more than this past the partition's newest record: enough for the settle times (an
    # exception 2 s, NaN 15 s), short of the hang threshold (hang_min_silence_s 60 s). When nothing at all
    # is heard the agents or the bus may be what stopped, and a hang needs its hosts seen alive.
    idle_clock_max_s: float = 30.0
    # The live service (`faultlens diagnose` online): an eviction whose newest evidence is older than this
    # (wall clock) becomes a notify with the reason "stale", every action carries the bound, and the runner
    # refuses an action once its evidence's age plus its own passes it. Batch and replayed input are never
    # judged by it. 0: off (tests and benchmarks that feed the live service old timestamps).
    max_evidence_age_s: float = 60.0
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    webhook_url: str = ""  # Alertmanager-compatible webhook for incidents; empty: off
    webhook_token: str = ""  # sent as "Authorization: Bearer <token>"; secret
    webhook_timeout_s: float = 5.0
    webhook_retries: int = 3
    # The service's producer (repartition forwards, checkpoints, outputs; stream/bus/librdkafka_producer.py): "auto"
    # (confluent-kafka when installed: ~2 us a message against kafka-python's ~20), "kafka" or "confluent".
    producer: str = "auto"
    # The consumer's client (stream/bus/librdkafka_consumer.py): "kafka" (kafka-python) or "confluent" (librdkafka: records
    # parsed in C). In the group: kafka-python rebalances eagerly (every instance stops while one joins
    # or leaves), librdkafka cooperatively (only the partitions that move stop, on a real Kafka; on the
    # embedded broker a member lost its whole assignment in a join: slower there). Under membership
    # "members": only which client fetches. "auto": confluent on a real cluster, kafka on the embedded
    # broker (only kafka-python's consumer notices a memory-only broker that restarted).
    consumer: str = "auto"
    # Static membership (group.instance.id), one stable id per instance: a restart within the session
    # timeout keeps its partitions, no rebalance (real Kafka 2.3+; the embedded broker does not honour it).
    # Under membership "members" it is the member id: a restart takes back the same partitions at once.
    instance_id: str = ""
    # Who holds which partition (diagnosis/online/membership.py): "members" (heartbeats on the topic
    # diag-members, manual assignment: no group join, a join or leave stops only the partitions that
    # move, a dead instance's partitions move member_timeout_s after its last heartbeat), "group" (the
    # Kafka consumer group, `consumer` above); "auto": members on the embedded broker (a group join
    # there waits ~2 s and stops every instance), group on a real Kafka.
    membership: str = "auto"
    member_heartbeat_s: float = 0.5
    member_timeout_s: float = 2.0


@dataclass(frozen=True)
class GuardConfig:
    """Guard rails on automatic actions."""

    dry_run: bool = True
    min_confidence_evict: float = 0.9
    # Per job, counted over the last hour of event time across decisions, distinct nodes: at most
    # min(max_evictions_per_job_per_hour, max(1, floor(max_evicted_fraction x the job's nodes))).
    max_evictions_per_job_per_hour: int = 4
    max_evicted_fraction: float = 0.25
    # Every job together, distinct nodes in the last hour; past it the fleet breaker trips.
    max_evictions_fleet_per_hour: int = 16
    storm_nodes: int = 8  # this many nodes blamed within storm_window_s: fabric incident
    storm_window_s: float = 300.0
    dedup_window_s: float = 1800.0
    # The guard log (diagnosis.guardlog) as a JSON-lines file: batch diagnosis keeps its breakers
    # there across runs; online instances keep a copy there (the topic diag-guard is the shared one).
    state_path: str = ""
    suppressions_kept: int = 20  # suppressions listed on an incident (all are counted by reason)


@dataclass(frozen=True)
class RetentionConfig:
    """How long and how much of each lake table is kept (stream/retention.py; `faultlens stream --retention`)."""

    max_age_days: float = 30.0  # every table: hours older than this are dropped; 0: no age bound
    max_gb: float = 0.0  # every table: past this size the oldest hours are dropped; 0: no size bound
    # Per table, overriding both: "TABLE=DAYS" or "TABLE=DAYS:GB" (e.g. "gpu=7:500", "gpu_1m=90").
    tables: tuple[str, ...] = ()
    lock_wait_s: float = 30.0  # how long a drop waits for the explorer's queries to finish before it skips
    # The processor's de-duplication marks (_seq/): folded into one file each round; a restarted agent's
    # older epochs are forgotten once no commit touched them for this long (resends reach 10 min back).
    seq_keep_s: float = 86_400.0


@dataclass(frozen=True)
class RunnerConfig:
    adapter: str = "dry-run"  # dry-run | slurm | kubernetes | command
    group_id: str = "faultlens-runner"
    hook_command: str = ""  # for the command adapter: argv template
    slurm_requeue: bool = True
    k8s_taint: str = "faultlens.io/faulty=true:NoSchedule"
    execute: bool = False  # False: every action is only logged; True: dry_run=false actions run
    diagnostics_command: str = ""  # run_diagnostics: argv template run per node, e.g. "ssh {node} dcgmi diag -r 2"
    command_timeout_s: float = 120.0
    max_action_age_s: float = 3600.0  # older actions (a replayed topic) are refused, never executed
    # Ledger of handled action ids and of what ran (caps), fsynced; survives restarts. Relative paths
    # are under the working directory, as diagnosis.catalog_path and lake.path are. "" is refused with --execute.
    state_path: str = "faultlens-runner-ledger.jsonl"
    metrics_port: int = 0
    # The runner's own caps, a second line behind diagnosis' guard (persisted in the ledger):
    max_actions_per_window: int = 20  # actions executed per rate_window_s; beyond: refused
    rate_window_s: float = 600.0
    max_nodes_evicted_per_hour: int = 32  # distinct nodes drained/cordoned in any hour; beyond: refused
    # An action the scheduler cannot take now (slurmctld down, a node it does not know) is reported
    # `pending` and tried again every pending_retry_s, at most pending_retries times; then `failed`.
    pending_retries: int = 10
    pending_retry_s: float = 30.0
    # Slurm run_diagnostics: the check job's time limit, and the runner's node health memory (a DuckDB
    # file the runner owns: diagnostics passed/failed, evictions, RMA candidates); "" keeps none.
    diagnostics_timeout_s: float = 600.0
    node_health_path: str = ""


@dataclass(frozen=True)
class KeysConfig:
    """Signing keys of actions and agent commands (stream/signing.py; `faultlens keys new`)."""

    files: tuple[str, ...] = ()  # key files; every listed key verifies (rotation). Diagnosis: the private
    # file(s) of `faultlens keys new`; the runner and agents: the public FILE.pub (they warn on a private one)
    active: str = ""  # the key id diagnosis signs with; empty: the first key that can sign
    validity_s: float = 900.0  # a signed action or command expires this long after signing
    max_skew_s: float = 60.0  # dated more than this ahead of the reader's clock: refused


@dataclass(frozen=True)
class AdaptationConfig:
    """The adaptation planner (models/planner.py): adapt around a slow GPU, or evict it.

    Restart costs default to ByteRobust's Table 7: a requeue takes 454 s at 128
    machines up to 768 s at 1,024 (interpolated on log2 of the machine count);
    a warm-standby restart is ``warm_standby_speedup`` times faster.
    """

    enabled: bool = True  # let the remediation policy choose adapt_parallelism over evicting a slow machine
    confirm_wait_s: float = 120.0  # wait this long for a measured slowdown before evicting a throttled GPU
    horizon_s: float = 1800.0  # expected remaining time of a fail-slow fault
    spare_nodes: int = 0  # warm standby machines the runner can swap in
    requeue_s_at_128: float = 454.0
    requeue_s_at_1024: float = 768.0
    warm_standby_speedup: float = 10.87
    reconfigure_s: float = 46.0  # pause to move layers / regroup TP (ByteRobust hot update: 46-65 s)
    rebalance_s: float = 0.0  # micro-batch shares change at the next iteration
    allow_tp_shrink: bool = True
    allow_layer_repartition: bool = True
    allow_microbatch_rebalance: bool = True
    min_tp: int = 1  # smallest TP degree the model fits in (memory)
    min_gain_fraction: float = 0.0  # act only if goodput beats no action by this fraction (hysteresis)
    evict_tie_fraction: float = 0.005  # evict when within this of the best goodput (fixes the cause)
    gain_confidence_z: float = 3.0  # adapt only if the gain exceeds z standard deviations of its realised value
    num_layers: int = 0  # 0: unknown, assume 4 per pipeline stage
    microbatches_per_replica: int = 0  # 0: unknown, assume 4 x pp


@dataclass(frozen=True)
class TimeConfig:
    """What a record's time may be (faultlens/decode.py refuses the rest) and how far a job's clock may lead.

    A stamp in milliseconds or microseconds, a clock set to 2100 or left at 1970 is a damaged
    record, not a time: it is dead-lettered with its reason, never stored or judged on.
    """

    earliest_ts: float = 946_684_800.0  # 2000-01-01T00:00:00Z: older is a clock left at 1970 (or a boot-relative time)
    max_future_s: float = 86_400.0  # a record stamped further ahead of the reader's clock is refused
    max_clock_skew_s: float = 300.0  # a job's diagnosis clock never leads the wall clock by more


@dataclass(frozen=True)
class UiConfig:
    host: str = "127.0.0.1"
    port: int = 8501


@dataclass(frozen=True)
class Config:
    bus: BusConfig = field(default_factory=BusConfig)
    lake: LakeConfig = field(default_factory=LakeConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    diagnosis: DiagnosisConfig = field(default_factory=DiagnosisConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    keys: KeysConfig = field(default_factory=KeysConfig)
    adaptation: AdaptationConfig = field(default_factory=AdaptationConfig)
    time: TimeConfig = field(default_factory=TimeConfig)
    ui: UiConfig = field(default_factory=UiConfig)

    def secrets(self) -> list[str]:
        """The secret values set (passwords, tokens), for log redaction."""
        return [str(v) for sec in dataclasses.fields(self) for k, v in dataclasses.asdict(getattr(self, sec.name)).items()
                if k in SECRET_KEYS and v]

    def describe(self) -> dict[str, dict[str, Any]]:
        """The configuration as a dict, secrets masked."""
        out: dict[str, dict[str, Any]] = {}
        for sec in dataclasses.fields(self):
            values = dataclasses.asdict(getattr(self, sec.name))
            out[sec.name] = {k: ("***" if k in SECRET_KEYS and v else v) for k, v in values.items()}
        return out


# Short environment aliases from DESIGN.md.
ENV_ALIASES = {"FAULTLENS_BOOTSTRAP": ("bus", "bootstrap_servers")}


def _convert(value: Any, tp: Any, *, where: str, key: str) -> Any:
    origin = typing.get_origin(tp) or tp
    try:
        if origin is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"not a boolean: {value!r}")
        if origin is int:
            if isinstance(value, bool):
                raise ValueError("a boolean is not an integer")
            return int(value)
        if origin is float:
            if isinstance(value, bool):
                raise ValueError("a boolean is not a number")
            return float(value)
        if origin is str:
            if not isinstance(value, (str, int, float)):
                raise ValueError(f"not a string: {value!r}")
            return str(value)
        if origin is tuple:
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"not a list: {value!r}")
            return tuple(str(v) for v in value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc), file=where, key=key) from None
    raise ConfigError(f"unsupported type {tp}", file=where, key=key)  # pragma: no cover


def _apply(sections: dict[str, dict[str, Any]], section: str, key: str, value: Any, where: str) -> None:
    sec_fields = {f.name: f for f in dataclasses.fields(Config)}
    if section not in sec_fields:
        raise ConfigError(f"unknown section [{section}]; known: {', '.join(sec_fields)}", file=where, key=section)
    cls: Any = sec_fields[section].default_factory
    hints = typing.get_type_hints(cls)
    if key not in hints:
        raise ConfigError(f"unknown key in [{section}]; known: {', '.join(hints)}", file=where, key=f"{section}.{key}")
    sections.setdefault(section, {})[key] = _convert(value, hints[key], where=where, key=f"{section}.{key}")


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: typing.Mapping[str, str] | None = None,
    overrides: typing.Iterable[str] = (),
    flags: typing.Mapping[str, Any] | None = None,
) -> Config:
    """Build the configuration. ``path=None`` reads ./faultlens.toml when present.

    ``overrides`` are ``section.key=value`` strings; ``flags`` maps
    ``"section.key"`` to values already parsed by argparse (None = not given).
    """
    env = os.environ if env is None else env
    sections: dict[str, dict[str, Any]] = {}
    if path is None and Path("faultlens.toml").is_file():
        path = "faultlens.toml"
    if path is None and env.get("FAULTLENS_CONFIG"):
        path = env["FAULTLENS_CONFIG"]
    if path is not None:
        file = str(path)
        try:
            data = tomllib.loads(Path(file).read_text())
        except FileNotFoundError:
            raise ConfigError("configuration file not found", file=file) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"not valid TOML: {exc}", file=file) from None
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError("top-level keys must be [sections]", file=file, key=section)
            for key, value in values.items():
                _apply(sections, section, key, value, file)
    for name, value in env.items():
        if name in ENV_ALIASES:
            _apply(sections, *ENV_ALIASES[name], value, f"environment {name}")
        elif name.startswith("FAULTLENS_") and name != "FAULTLENS_CONFIG" and not name.startswith("FAULTLENS_TEST"):
            rest = name[len("FAULTLENS_"):].lower()
            section, _, key = rest.partition("_")
            if section in {f.name for f in dataclasses.fields(Config)} and key:
                _apply(sections, section, key, value, f"environment {name}")
    for item in overrides:
        dotted, sep, value = item.partition("=")
        section, dot, key = dotted.strip().partition(".")
        if not sep or not dot:
            raise ConfigError(f"expected section.key=value, got {item!r}", file="--set", key=dotted)
        _apply(sections, section, key, value.strip(), "--set")
    for dotted, value in (flags or {}).items():
        if value is not None:
            section, _, key = dotted.partition(".")
            _apply(sections, section, key, value, "command line")
    kwargs: dict[str, Any] = {}
    for sec in dataclasses.fields(Config):
        cls: Any = sec.default_factory  # every section is a dataclass built by its default factory
        kwargs[sec.name] = cls(**sections.get(sec.name, {}))
    return Config(**kwargs)


def read_catalog(path: str | Path) -> dict[str, Any]:
    """One catalog file (TOML) as a table; a missing file or a syntax error names the file.

    Every part's catalogs (signatures, patterns, rules, detectors, features) load through
    this, so a broken catalog fails at start with the same message whoever reads it.
    """
    file = Path(path)
    try:
        return tomllib.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CatalogError("catalog file not found", file=str(file)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CatalogError(f"cannot read: {exc}", file=str(file)) from None
    except tomllib.TOMLDecodeError as exc:
        raise CatalogError(f"not valid TOML: {exc}", file=str(file)) from None
