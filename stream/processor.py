"""The stream processor: Kafka topics -> Parquet lake, every row exactly once.

One ``StreamProcessor`` is one member of a consumer group over the telemetry topics
(and incidents, actions, action-status, commands, so the explorer finds them in the
lake); instances of one group split the partitions. Exactly once without Kafka
transactions: buffers are written as files named by their offset range, and a commit's
manifest in the lake (not a Kafka offset commit) makes them part of it; on assignment the
files no manifest names are deleted and each partition is sought to its last committed
offset + 1. Records an agent sent twice are dropped by their natural key
(stream/dedupe.py), undecodable ones become dead-letter rows. stream/README.md, "Exactly
once (design)", says how each step keeps that, and why this is not stream/bus/'s
``ConsumeLoop``.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pyarrow as pa

from faultlens import schema
from faultlens.config import Config
from faultlens.errors import BusError, LakeError
from faultlens.stream import catalog as catalog_mod
from faultlens.stream import decode_arrow, topics
from faultlens.stream.bus import Producer, ensure_topics
from faultlens.stream.bus.lake_fetchers import Fetcher, Key, choose_backend, open_fetcher
from faultlens.stream.dedupe import SeqLedger, parse_seq
from faultlens.stream.lake import LakeWriter
from faultlens.stream.processor_ranges import PROCESSOR_FILE, PendingRange, WrittenRange, wait_for
from faultlens.stream.processor_runtime import CHECK_CRCS, fewer_collections
from faultlens.stream.processor_stats import ProcessorStats

log = logging.getLogger(__name__)

# What the processor consumes: telemetry plus the diagnosis outputs the UI shows.
# Not the deadletter topic: dead letters reach the lake straight from here.
CONSUMED_KINDS = (*topics.TELEMETRY, "incidents", "actions", "action-status", "commands")
DEADLETTER_PAYLOAD_MAX = decode_arrow.DEADLETTER_PAYLOAD_MAX


# Messages per poll. The flush rules (rows, age) are checked after each poll: a poll of
# 50,000 messages (400,000 GPU rows) overshot the 200,000-row flush twice over before
# the commit thread got any work; with 10,000 a backlog's commits start on time and
# overlap the polling of the next messages.
POLL_MAX_RECORDS = 10_000



# --------------------------------------------------------------------------- decoding
# One decoder (faultlens/decode.py); stream/decode_arrow.py lays its records out as Arrow.
decode_batch = decode_arrow.decode_batch
Decoded = decode_arrow.Decoded


# --------------------------------------------------------------------------- the processor


class StreamProcessor:
    """Consumes the faultlens topics into the lake. ``run()`` until ``stop()``.

    >>> proc = StreamProcessor(load_config(), lake_path="lake", catalog_path="catalog.duckdb")  # doctest: +SKIP
    >>> proc.run(exit_when_idle_s=5)                                                           # doctest: +SKIP

    Three stages overlap (kafka-python's record parsing holds the GIL; Arrow's
    group-by and the Parquet writer release it): the ``run`` thread polls and
    decodes each partition's batch (or hands it to ``decode_threads`` decode
    workers); ``write_threads`` writers write partition ranges (Parquet files
    and rollups) ahead of their commit; a flush hands the decoded buffers to one
    commit thread, which waits for their ranges and commits in order while the
    next buffers fill. At most one commit is in flight and at most
    ``max_decoding_messages`` wait for a decoder (memory).
    """

    def __init__(
        self,
        config: Config,
        *,
        bootstrap: str | None = None,
        lake_path: str | None = None,
        catalog_path: str | None = None,
        group_id: str | None = None,
        kinds: Iterable[str] = CONSUMED_KINDS,
        flush_interval_s: float | None = None,
        flush_rows: int | None = None,
        rollups: bool = True,
        registry: Any = None,
        consumer_overrides: dict[str, Any] | None = None,
        decode_threads: int | None = None,
        max_decoding_messages: int = 20_000,
        fetcher: str = "kafka",
        write_ahead_rows: int | None = None,
        write_threads: int = 2,
    ):
        self.config = config
        self.bus = config.bus
        self.bootstrap = bootstrap or config.bus.bootstrap_servers
        self.lake = LakeWriter(lake_path or config.lake.path)
        self.catalog = catalog_mod.Catalog(catalog_path or config.lake.catalog_path, self.lake.root)
        self.group_id = group_id or config.lake.group_id
        self.kinds = tuple(kinds)
        self.flush_interval_s = config.lake.flush_interval_s if flush_interval_s is None else flush_interval_s
        self.flush_rows = config.lake.flush_rows if flush_rows is None else flush_rows
        self.rollups = rollups
        self.stats = ProcessorStats(registry)
        self.consumer_overrides = consumer_overrides or {}
        self.fetcher_backend = fetcher  # kafka (kafka-python) | confluent (confluent-kafka) | auto: stream/bus/lake_fetchers.py
        # A partition buffer this large is written ahead by the writer pool (files only; the
        # next commit's manifest names them), so that writing overlaps polling instead of
        # following it. Files not named by a manifest are a crash's leftovers: deleted on
        # assignment, like any. 0: write at the commit only.
        self.write_ahead_rows = max(self.flush_rows // 8, 1) if write_ahead_rows is None else write_ahead_rows
        self.max_decoding_messages = max_decoding_messages
        self._pending: dict[tuple[str, int], PendingRange] = {}
        self._pending_rows = 0
        self._stop = threading.Event()
        # Decoding is msgspec + numpy, mostly holding the GIL: on the poll thread by default
        # (decode_threads=0). Worker threads only add GIL hand-offs (each numpy/Arrow call
        # that releases the GIL waits up to a switch interval to get it back while
        # kafka-python's IO thread runs); they pay where cores are many and messages JSON.
        self._decode_threads = 0 if decode_threads is None else decode_threads
        self._decoder = ThreadPoolExecutor(max(1, self._decode_threads), thread_name_prefix="faultlens-decode")
        self._decoding: deque[tuple[Future[Decoded], int]] = deque()  # submitted, maybe not done
        self._decoding_messages = 0
        # One thread: commits happen in the order of their flushes.
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="faultlens-commit")
        # Ranges (one partition's Parquet files and rollups) are written by this pool, several
        # partitions at once: Arrow's group-by and Parquet's encoding and compression release
        # the GIL. A commit waits for its ranges, then writes its manifest.
        self._writers = ThreadPoolExecutor(max(1, write_threads), thread_name_prefix="faultlens-write")
        self._commit_running: Future[None] | None = None
        self._fetch: Fetcher | None = None
        self._producer: Any = None
        self._assigned: set[tuple[str, int]] = set()
        self._ever_assigned = False
        # kafka-python 3 calls the rebalance listener on its IO thread, concurrently
        # with this loop: the lock orders callbacks against adding and flushing, and
        # the expected next offset per partition drops records delivered twice
        # (fetched before a rebalance's seek, then fetched again after it).
        self._lock = threading.RLock()
        self._next_offset: dict[tuple[str, int], int | None] = {}
        self._fatal: BaseException | None = None
        self.last_message_at = time.monotonic()
        # Agent records' natural keys: taken so far (poll thread: committed + pending) and
        # committed (commit thread); both read back from the lake on assignment.
        self._seen = SeqLedger()
        self._durable = SeqLedger()
        self._topic_ids: dict[str, str] = {}  # topic -> the broker's id the offsets here refer to

    # -- lifecycle

    def stop(self) -> None:
        """Ask ``run`` to flush and return (thread- and signal-safe)."""
        self._stop.set()

    def _connect(self) -> None:

        ensure_topics(self.bus, self.bootstrap)
        self.fetcher_backend = choose_backend(self.fetcher_backend, self.bootstrap)
        log.info("fetching with %s", "confluent-kafka" if self.fetcher_backend == "confluent" else "kafka-python")
        if not CHECK_CRCS and self.fetcher_backend == "kafka":
            log.info("no C crc32c module: record-batch CRC checks are off (pip install crc32c turns them on)")
        self._fetch = open_fetcher(
            self.fetcher_backend, self.bus, self.kinds, group_id=self.group_id, bootstrap=self.bootstrap,
            on_assigned=self._on_assigned, on_revoked=self._on_revoked, on_reset=self._on_offsets_reset,
            check_crcs=CHECK_CRCS or self.fetcher_backend == "confluent", overrides=self.consumer_overrides,
        )
        self._producer = Producer(self.bus, self.bootstrap)

    def close(self) -> None:
        for closer in (self._fetch, self._producer):
            if closer is not None:
                try:
                    closer.close()
                except Exception as exc:  # noqa: BLE001 - closing after a failure must not mask it
                    log.warning("closing %s: %s", type(closer).__name__, exc)
        self._fetch = self._producer = None
        self._committer.shutdown(wait=True)
        self._writers.shutdown(wait=True)
        self._decoder.shutdown(wait=True, cancel_futures=True)
        self.catalog.close()

    def run(
        self,
        *,
        exit_when_idle_s: float | None = None,
        max_runtime_s: float | None = None,
        on_progress: Callable[[ProcessorStats], None] | None = None,
        poll_timeout_ms: int = 200,
    ) -> ProcessorStats:
        """Consume until ``stop()``, or idle for ``exit_when_idle_s`` after the first assignment."""
        with fewer_collections():
            return self._run(exit_when_idle_s, max_runtime_s, on_progress, poll_timeout_ms)

    def _run(self, exit_when_idle_s: float | None, max_runtime_s: float | None,
             on_progress: Callable[[ProcessorStats], None] | None, poll_timeout_ms: int) -> ProcessorStats:
        self._connect()
        assert self._fetch is not None
        start = time.monotonic()
        cpu_start = time.thread_time()
        last_flush = last_lag = time.monotonic()
        try:
            while not self._stop.is_set():
                try:
                    batch = self._fetch.poll(poll_timeout_ms, POLL_MAX_RECORDS)
                except BusError as exc:  # the broker went away: keep trying, the client reconnects
                    log.warning("poll failed (%s); retrying", exc)
                    time.sleep(0.5)
                    continue
                self._check_fatal()
                batch = self._new_logs(batch)
                now = time.monotonic()
                with self._lock:
                    if batch:
                        self.last_message_at = now
                        for (topic, partition), records in batch.items():
                            self._add(topic, partition, records)
                    age = now - last_flush
                    # Flush on size, on age, or when caught up (an empty poll): waiting
                    # longer then would only delay the rows, not make bigger files. Caught up
                    # with a buffer of a written-ahead range's size (the end of a backlog), at
                    # once: the 0.5 s floor only keeps a trickle from committing tiny files.
                    big = bool(self.write_ahead_rows) and self._pending_rows >= self.write_ahead_rows
                    caught_up = not batch and (big or age >= min(0.5, self.flush_interval_s))
                    if self._pending and (self._pending_rows >= self.flush_rows or age >= self.flush_interval_s or caught_up):
                        self._flush_async()
                        last_flush = now
                    elif not self._pending:
                        last_flush = now
                if now - last_lag >= 2.0:
                    self._update_lag()
                    last_lag = now
                    if on_progress:
                        on_progress(self.stats)
                if exit_when_idle_s is not None and self._idle(now, exit_when_idle_s):
                    break
                if max_runtime_s is not None and now - start >= max_runtime_s:
                    break
            with self._lock:
                self.flush()
        finally:
            self.stats.poll_thread_cpu_s += time.thread_time() - cpu_start
            self.close()
        return self.stats

    def _idle(self, now: float, idle_s: float) -> bool:
        """True once this processor has had partitions and nothing left to read on them for ``idle_s``.

        Time without partitions (before the first assignment, between a rebalance's revoke and
        its assign) never counts: a member that joins a group still holding a killed member's
        session gets some partitions, loses them when that session expires, and is given the
        rest a moment later. The broker is asked for the lag only once the quiet time is reached.
        """
        with self._lock:
            if not self._assigned or self._pending:
                self.last_message_at = now  # idle time counts from the next assignment / commit
                return False
            if now - self.last_message_at < idle_s or self._fetch is None:
                return False
        try:
            behind = sum(self._fetch.lag().values())
        except Exception as exc:  # noqa: BLE001 - an unknown lag is not idle
            log.debug("lag for the idle check failed: %s", exc)
            behind = 1
        if behind:
            self.last_message_at = now  # records wait on assigned partitions: not idle
            return False
        return True

    def _check_fatal(self) -> None:
        if self._fatal is not None:
            raise LakeError(f"cannot continue safely: {self._fatal}") from self._fatal

    # -- consuming

    def _add(self, topic: str, partition: int, records: list[Any]) -> None:
        key = (topic, partition)
        if key not in self._assigned:
            return  # fetched before a rebalance took the partition away
        expected = self._next_offset.get(key)
        if expected is not None and records[0].offset < expected:
            records = [r for r in records if r.offset >= expected]
            if not records:
                return
        self._next_offset[key] = records[-1].offset + 1
        kind = topics.kind_of(topic, self.bus.topic_prefix)
        self.stats.consumed(kind, len(records))
        first_offset, last_offset = records[0].offset, records[-1].offset
        records, taken = self._drop_duplicates(kind, records)
        if self.stats.first_message_at is None:
            self.stats.first_message_at = time.monotonic()
        p = self._pending.get((topic, partition))
        if p is None:
            p = self._pending[(topic, partition)] = PendingRange(kind, first_offset, last_offset)
            p.chunk_first = p.first
        p.last = last_offset
        p.seqs.extend(taken)
        # Decoding runs on worker threads: Arrow releases the GIL, so it overlaps
        # kafka-python's record parsing in this thread.
        if self._decode_threads:
            fut = self._decoder.submit(decode_batch, kind, topic, partition, records)
        else:
            fut = Future()
            try:
                fut.set_result(decode_batch(kind, topic, partition, records))
            except Exception as exc:  # noqa: BLE001 - surfaces at the commit, as a worker's would
                fut.set_exception(exc)
        p.decoding.append(fut)
        p.messages += len(records)
        est = len(records) * (8 if kind == "gpu" else 1)  # an estimate until decoded
        self._pending_rows += est
        p.rows_est += est
        if self.write_ahead_rows and p.rows_est >= self.write_ahead_rows and self._fatal is None:
            futs, p.decoding, p.rows_est = p.decoding, [], 0
            first, p.chunk_first = p.chunk_first, p.last + 1
            p.ahead.append(self._writers.submit(self._write_ahead, topic, partition, p.kind, first, p.last, futs))
        self._decoding.append((fut, len(records)))
        self._decoding_messages += len(records)
        # Back-pressure: polling is faster than decoding; undecoded records are
        # the bulkiest thing in memory, so wait for the oldest batches.
        while self._decoding and (self._decoding[0][0].done() or self._decoding_messages > self.max_decoding_messages):
            done, n = self._decoding.popleft()
            wait_for(done)
            self._decoding_messages -= n

    def _drop_duplicates(self, kind: str, records: list[Any]) -> tuple[list[Any], list[tuple[tuple[str, int, str], int]]]:
        """The records whose natural key is new (stream/dedupe.py), and the keys they take."""
        taken: list[tuple[tuple[str, int, str], int]] = []
        kept: list[Any] = []
        seen = self._seen
        dropped = 0
        for r in records:
            stamp = parse_seq(r.headers)
            if stamp is not None:
                key = (stamp[0], stamp[1], kind)
                if not seen.take(key, stamp[2]):
                    dropped += 1
                    continue
                taken.append((key, stamp[2]))
            kept.append(r)
        if dropped:
            self.stats.duplicates_dropped[kind] += dropped
        return (kept if dropped else records), taken

    def _send_dead(self, dead: list[schema.DeadLetter]) -> None:
        for d in dead:
            log.warning("dead letter %s[%d]@%d: %s %s", d.topic, d.partition, d.offset, d.reason, d.detail[:200])
            try:
                self._producer.send(d)
            except BusError as exc:
                log.warning("could not send the dead letter to the bus (it is kept in the lake): %s", exc)

    def flush(self, *, confirm_dead_letters: bool = True) -> None:
        """Write every pending buffer and commit it (files, then the manifest); returns when committed."""
        self._flush_async(confirm_dead_letters=confirm_dead_letters)
        self._wait_commit()

    def _flush_async(self, *, confirm_dead_letters: bool = True) -> None:
        """Hand the pending buffers to the commit thread (after the previous commit is done)."""
        if not self._pending:
            return
        self._wait_commit()  # one commit in flight: bounds memory, keeps order obvious
        pending, self._pending, self._pending_rows = self._pending, {}, 0
        self._commit_running = self._committer.submit(self._commit, pending, confirm_dead_letters)

    def _wait_commit(self) -> None:
        running, self._commit_running = self._commit_running, None
        if running is not None:
            running.result()  # re-raises a failed commit
        self._check_fatal()

    def _commit(self, pending: dict[tuple[str, int], PendingRange], confirm_dead_letters: bool) -> None:
        """On the commit thread: decoded buffers -> lake files (writer pool) -> manifest (the commit point)."""
        if self._fatal is not None:  # never commit a later range after an earlier one failed
            raise LakeError(f"an earlier commit failed: {self._fatal}")
        try:
            self._write_commit(pending, confirm_dead_letters)
        except BaseException as exc:
            self._fatal = exc
            raise

    def _write_ahead(self, topic: str, partition: int, kind: str, first: int, last: int,
                     futs: list[Future[Decoded]]) -> WrittenRange:
        """In the writer pool: one partition's range, written before its commit (see ``write_ahead_rows``)."""
        if self._fatal is not None:  # the commit that would name these files never comes
            raise LakeError(f"an earlier write failed: {self._fatal}")
        try:
            return self._write_range(topic, partition, kind, first, last, futs)
        except BaseException as exc:
            self._fatal = self._fatal or exc
            raise

    def _write_range(self, topic: str, partition: int, kind: str, first: int, last: int,
                     futs: list[Future[Decoded]]) -> WrittenRange:
        """The files of one partition's offset range, and the manifest rows that will name them."""
        stem = f"{kind}-p{partition}-o{first}-{last}-{time.time_ns():x}{uuid.uuid4().hex[:8]}"
        out = WrittenRange([], Counter(), Counter(), [], Counter())
        parts: dict[str, list[pa.Table]] = {}
        dead_letters: list[schema.DeadLetter] = []
        for fut in futs:
            decoded = fut.result()
            for t, table in decoded.tables.items():
                parts.setdefault(t, []).append(table)
            dead_letters.extend(decoded.dead)
            out.quarantine.extend(decoded.quarantine)
            out.unknown.update(decoded.unknown)
        futs.clear()  # let the decoded batches go once they are concatenated
        tables = {t: pa.concat_tables(ps) if len(ps) > 1 else ps[0] for t, ps in parts.items()}
        del parts
        if dead_letters:
            self._send_dead(dead_letters)
            tables["deadletter"] = pa.Table.from_pylist(
                [row for d in dead_letters for row in schema.lake_row(d)], schema=schema.lake_schema("deadletter")
            )
            out.dead.update(d.reason for d in dead_letters)
        if out.quarantine:
            tables["quarantine"] = pa.Table.from_pylist(
                [row for q in out.quarantine for row in schema.lake_row(q)], schema=schema.lake_schema("quarantine")
            )
        if self.rollups and "gpu" in tables and tables["gpu"].num_rows:
            tables["gpu_1m"] = catalog_mod.gpu_rollup_partial(tables["gpu"])
        if self.rollups and "steps" in tables and tables["steps"].num_rows:
            tables["steps_1m"] = catalog_mod.steps_rollup_partial(tables["steps"])
        base = {"kind": kind, "topic": topic, "partition": partition, "first_offset": first, "last_offset": last}
        for t, data in tables.items():
            for path, n in self.lake.write_table_counted(t, data, stem=stem):
                out.manifest.append({**base, "lake_table": t, "file": self.lake.relative(path), "rows": n})
                out.rows[t] += n
        if not out.manifest:  # the range had no rows (all empty): still record that it was consumed
            out.manifest.append({**base, "lake_table": None, "file": None, "rows": 0})
        return out

    def _write_commit(self, pending: dict[tuple[str, int], PendingRange], confirm_dead_letters: bool) -> None:
        commit_id = f"{time.time_ns():x}{uuid.uuid4().hex[:8]}"
        manifest: list[dict[str, Any]] = []
        rows: Counter[str] = Counter()
        dead: Counter[str] = Counter()
        decoded_reports: list[tuple[str, list[schema.Quarantine], Counter[str]]] = []
        ranges: list[tuple[str, Future[WrittenRange]]] = []
        for (topic, partition), p in pending.items():
            ranges.extend((p.kind, f) for f in p.ahead)
            if p.decoding:  # the rest of the partition's buffer, beside the other partitions'
                rest = self._writers.submit(self._write_range, topic, partition, p.kind, p.chunk_first, p.last, p.decoding)
                ranges.append((p.kind, rest))
        for _, f in ranges:
            wait_for(f)  # every range written (or failed) before anything is committed
        for kind, f in ranges:
            w = f.result()  # re-raises a failed write: nothing of this commit is named
            manifest.extend(w.manifest)
            rows.update(w.rows)
            dead.update(w.dead)
            decoded_reports.append((kind, w.quarantine, w.unknown))
        if dead and confirm_dead_letters and self._producer is not None:
            try:
                self._producer.flush(timeout_s=10)
            except BusError as exc:
                log.warning("dead letters not confirmed by the bus (kept in the lake): %s", exc)
        touched = self._durable.add_all(t for p in pending.values() for t in p.seqs)
        # before the manifest: named by its commit id, it counts only once the manifest does
        self._durable.write(self.lake.root, commit_id, touched, dict(self._topic_ids))
        self.catalog.commit(commit_id, manifest)
        self.stats.committed(dict(rows), dead)
        for kind, quarantine, unknown in decoded_reports:
            if quarantine or unknown:
                self.stats.decoded(kind, quarantine, dict(unknown))

    # -- rebalancing

    def _on_revoked(self, revoked: list[Key]) -> None:
        log.info("partitions revoked: %d", len(revoked))
        with self._lock:
            try:
                self.flush(confirm_dead_letters=False)  # on the IO thread: no blocking bus calls
            except Exception as exc:  # noqa: BLE001 - kafka-python would only log it; we must stop
                log.exception("flushing before a rebalance failed")
                self._fatal = self._fatal or exc
            for key in revoked:
                self._assigned.discard(key)
                self._next_offset.pop(key, None)
            self.last_message_at = time.monotonic()  # a rebalance is not idle time

    def _current_topic_ids(self) -> dict[str, str]:
        ids = getattr(self._fetch, "topic_ids", None)
        return ids() if ids is not None else {}

    def _new_logs(self, batch: dict[Key, list[Any]]) -> dict[Key, list[Any]]:
        """A topic the broker created again (new id): commit what its old log gave, read the new log
        from its start, and drop what this poll fetched from it at the old position."""
        current = self._current_topic_ids()
        changed = {t for t, tid in current.items() if self._topic_ids.get(t, tid) != tid}
        if not changed:
            if current.keys() - self._topic_ids.keys():
                self._topic_ids.update(current)
            return batch
        with self._lock:
            self.flush(confirm_dead_letters=False)  # the old logs' records, under the old ids
            self._topic_ids.update(current)
            keys = [k for k in self._assigned if k[0] in changed]
            for key in keys:
                self._next_offset.pop(key, None)
            rewind = getattr(self._fetch, "rewind", None)
            if rewind is not None:
                rewind(keys)
        log.warning("topics created again (the broker lost them): %s read from their start", ", ".join(sorted(changed)))
        return {k: v for k, v in batch.items() if k[0] not in changed}

    def _on_offsets_reset(self, reset: list[Key]) -> None:
        """stream.bus: the broker lost these partitions' logs (a memory-only broker restarted); they are
        read again from offset 0. On the poll thread, before the new log's first records are added:
        commit what the old log gave, then take offsets from 0 again (no "delivered twice" filter)."""
        with self._lock:
            self.flush(confirm_dead_letters=False)
            for key in reset:
                self._next_offset.pop(key, None)

    def _on_assigned(self, assigned: list[Key]) -> dict[Key, int | None]:
        """The next offset of each assigned partition (None: from the beginning); the fetcher seeks there.

        May run on the client's IO thread (kafka-python): local work only (files,
        DuckDB), no blocking consumer calls.
        """
        with self._lock:
            return self._prepare_assigned(assigned)

    def _prepare_assigned(self, assigned: list[Key]) -> dict[Key, int | None]:
        out: dict[Key, int | None] = {}
        try:
            self.flush(confirm_dead_letters=False)  # nothing should be pending; be sure
            owned = {(topics.kind_of(topic, self.bus.topic_prefix), partition) for topic, partition in assigned}
            self.catalog.sync_from_lake()
            self.stats.orphans_deleted += self.delete_orphans(owned)
            self._durable = SeqLedger.load(self.lake.root, self.catalog.commit_ids())
            self._seen = self._durable.copy()
            positions = self.catalog.next_offsets()
            current = self._current_topic_ids()
            recreated = {t for t, tid in current.items() if self._durable.topic_ids.get(t, tid) != tid}
            if recreated:
                log.warning("topics created again since the last commit (the broker lost them): %s read from "
                            "their start", ", ".join(sorted(recreated)))
            self._topic_ids = {**self._durable.topic_ids, **current}
            for key in assigned:
                out[key] = self._next_offset[key] = None if key[0] in recreated else positions.get(key)
                self._assigned.add(key)
            self._ever_assigned = True
            self.last_message_at = time.monotonic()  # idle time counts from here, not from start-up
            if self.stats.assigned_at is None:
                self.stats.assigned_at = time.monotonic()
            log.info("partitions assigned: %d", len(assigned))
        except Exception as exc:  # noqa: BLE001 - kafka-python would only log it; we must stop
            log.exception("preparing assigned partitions failed")
            self._fatal = self._fatal or exc
        return out

    def delete_orphans(self, owned: set[tuple[str, int]]) -> int:
        """Delete files of ``owned`` (kind, partition)s that no manifest names: a crash's leftovers."""
        committed = self.catalog.committed_files()
        deleted = 0
        root = self.lake.root
        for path in root.glob("*/date=*/hour=*/*"):
            name = path.name
            tmp = name.startswith(".") and name.endswith(".tmp")
            m = PROCESSOR_FILE.match(name[1:-4] if tmp else name)
            if not m or (m["kind"], int(m["partition"])) not in owned:
                continue
            if tmp or path.relative_to(root).as_posix() not in committed:
                path.unlink(missing_ok=True)
                deleted += 1
        if deleted:
            log.info("deleted %d uncommitted file(s) left by an earlier crash", deleted)
        return deleted

    def _update_lag(self) -> None:
        if self._fetch is None:
            return
        try:
            lag = self._fetch.lag()
            if lag:
                self.stats.set_lag(lag)
        except Exception as exc:  # noqa: BLE001 - lag is a metric; never stop ingest for it
            log.debug("lag update failed: %s", exc)


__all__ = ["StreamProcessor", "ProcessorStats", "decode_batch", "CONSUMED_KINDS"]
