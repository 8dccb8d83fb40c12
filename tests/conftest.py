"""Shared fixtures. The broker is real: one embedded Tansu per test session."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from faultlens.config import BusConfig
from faultlens.stream.bus.embedded_broker import EmbeddedBroker

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
# The real-log reference set, copied into the repository with its sources (see its README):
# tests read nothing outside the repository.
REAL_LOGS = FIXTURES / "real_logs"
_prefixes = itertools.count()


@pytest.fixture(scope="session")
def broker() -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker() as b:
        yield b


@pytest.fixture
def bus(broker: EmbeddedBroker) -> BusConfig:
    """Bus settings on the session broker with a topic prefix of this test's own."""
    return BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix=f"t{next(_prefixes)}", linger_ms=5)


@pytest.fixture(scope="session")
def real_logs() -> Path:
    if not (REAL_LOGS / "kernel.jsonl").is_file():
        pytest.fail(f"real-log fixtures missing at {REAL_LOGS}")
    return REAL_LOGS


@pytest.fixture(scope="module")
def slurm_cluster() -> Iterator[object]:
    """A real 4-node Slurm cluster on localhost (datasets/slurm_local.py), once per module; `make test`
    installs Slurm as root (the Makefile's `slurm` target)."""
    from faultlens.datasets.slurm_local import LocalSlurm, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.fail(f"{reason}; `make test` installs it when run as root")
    with LocalSlurm(nodes=4) as cluster:
        yield cluster
