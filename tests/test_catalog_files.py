"""Every data file the package ships (catalogs, schemas, the shipped model) loads through the
loader production uses, and no shipped file goes unread.

A catalog file without a loader here fails the test: a new catalog gets one line in
LOADERS (and is then checked on every run); a deleted one loses its line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO

# Folders of shipped data, and the files in them that are documentation, not data.
DATA_DIRS = ("collectors/catalogs", "diagnosis/catalogs", "diagnosis/schemas", "models/catalogs", "models/shipped")
NOT_DATA = {"models/shipped/MODEL_CARD.md"}


def _kernel_kinds() -> Any:
    from faultlens.collectors.kernel import KernelParser

    return KernelParser("n1").kinds


def _nccl_kinds() -> Any:
    from faultlens.collectors.nccl import NcclParser

    return NcclParser("n1").kinds


def _classify_catalogs() -> Any:
    from faultlens.collectors.signatures import all_rules, load_catalogs

    cats = load_catalogs()
    assert all_rules(cats), "the signature catalogs loaded no rule"
    return cats


def _counters() -> Any:
    from faultlens.diagnosis.rules import load_counter_rules

    return load_counter_rules()


def _inhibit() -> Any:
    from faultlens.diagnosis.inhibit import load_inhibit_rules

    return load_inhibit_rules()


def _pauses() -> Any:
    from faultlens.diagnosis.pauses import load_pauses

    return load_pauses()


def _policy() -> Any:
    from faultlens.diagnosis.policy import load_policy

    return load_policy()


def _schema(kind: str) -> Callable[[], Any]:
    def load() -> Any:
        from faultlens.diagnosis.event_schemas import EventValidator, load_schema

        EventValidator(kind)  # compiles the schema as the validator does
        return load_schema(kind)

    return load


def _detectors() -> Any:
    from faultlens.models.classifier import ClassifierParams
    from faultlens.models.failslow import FailSlowParams
    from faultlens.models.params import load_params
    from faultlens.models.peer import PeerParams

    return [FailSlowParams.from_catalog(), PeerParams.from_catalog(),
            ClassifierParams(**load_params("classifier", ClassifierParams))]


def _event_features() -> Any:
    from faultlens.models.features import load_event_catalog

    return load_event_catalog()


def _labels() -> Any:
    from faultlens.models.classifier import load_label_rules

    return load_label_rules()


def _frames() -> Any:
    from faultlens.diagnosis.hangroot import FRAMES_CATALOG, load_frames

    load_frames.cache_clear()
    return load_frames(str(FRAMES_CATALOG))


def _shipped_model() -> Any:
    from faultlens.models.classifier import load_shipped

    return load_shipped()


# shipped file -> the production loader that reads it (files read together share one loader)
LOADERS: dict[str, Callable[[], Any]] = {
    "collectors/catalogs/kernel.toml": _kernel_kinds,
    "collectors/catalogs/nccl.toml": _nccl_kinds,
    "collectors/catalogs/xid.toml": _classify_catalogs,
    "collectors/catalogs/sxid.toml": _classify_catalogs,
    "collectors/catalogs/nvsmi.toml": _classify_catalogs,
    "diagnosis/catalogs/counters.toml": _counters,
    "diagnosis/catalogs/inhibit.toml": _inhibit,
    "diagnosis/catalogs/policy.toml": _policy,
    "diagnosis/catalogs/pauses.toml": _pauses,
    "diagnosis/catalogs/frames.toml": _frames,
    "diagnosis/schemas/incident.schema.json": _schema("incidents"),
    "diagnosis/schemas/action.schema.json": _schema("actions"),
    "models/catalogs/detectors.toml": _detectors,
    "models/catalogs/event_features.toml": _event_features,
    "models/catalogs/labels.toml": _labels,
    "models/shipped/model.json": _shipped_model,
    "models/shipped/model.ubj": _shipped_model,
}


def _shipped_files() -> set[str]:
    out = set()
    for d in DATA_DIRS:
        for f in (REPO / d).rglob("*"):
            if f.is_file() and "__pycache__" not in f.parts:
                out.add(f.relative_to(REPO).as_posix())
    return out - NOT_DATA


def test_every_shipped_data_file_has_a_production_loader() -> None:
    files = _shipped_files()
    assert files, "no shipped data found"
    assert files - set(LOADERS) == set(), "shipped data that no loader here reads: add it to LOADERS"
    assert set(LOADERS) - files == set(), "LOADERS names files that are not shipped any more"


@pytest.mark.parametrize("path", sorted(LOADERS))
def test_shipped_data_file_loads(path: str) -> None:
    loaded = LOADERS[path]()
    assert loaded is not None
    if isinstance(loaded, (list, tuple, dict)):
        assert len(loaded) > 0, f"{path}: loaded but empty"
    elif dataclasses.is_dataclass(loaded):
        # a catalog object: at least one of its collections holds entries
        values = [getattr(loaded, f.name) for f in dataclasses.fields(loaded)]
        sizes = [len(v) for v in values if isinstance(v, (list, tuple, dict))]
        assert not sizes or max(sizes) > 0, f"{path}: every collection is empty"


def test_a_broken_catalog_fails_at_load_naming_the_file(tmp_path: Path) -> None:
    """The loaders fail fast on a bad file, naming it (STYLE.md 3), rather than loading half."""
    from faultlens.diagnosis.inhibit import load_inhibit_rules
    from faultlens.diagnosis.policy import load_policy
    from faultlens.errors import CatalogError

    bad = tmp_path / "broken.toml"
    bad.write_text("[[rule]\nname = ")
    for loader in (load_inhibit_rules, load_policy):
        with pytest.raises(CatalogError, match="broken.toml"):
            loader(bad)
