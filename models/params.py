"""Detector thresholds from models/catalogs/detectors.toml (data, not code).

A bad entry fails at start naming the file and the entry, like every catalog.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from faultlens.config import read_catalog
from faultlens.errors import CatalogError

CATALOG = Path(__file__).resolve().parent / "catalogs" / "detectors.toml"


def load_params(section: str, cls: type, path: str | Path | None = None) -> dict[str, Any]:
    """The ``[section]`` of the detector catalog as keyword arguments for ``cls``."""
    file = Path(path) if path else CATALOG
    data = read_catalog(file)
    values = data.get(section, {})
    if not isinstance(values, dict):
        raise CatalogError("expected a table", file=str(file), entry=section)
    known = {f.name: f for f in dataclasses.fields(cls)}
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key not in known:
            raise CatalogError(f"unknown key; known: {', '.join(known)}", file=str(file), entry=f"{section}.{key}")
        default = known[key].default
        if isinstance(default, bool) != isinstance(value, bool) or (
                isinstance(default, (int, float)) and not isinstance(value, (int, float))):
            raise CatalogError(f"expected {type(default).__name__}, got {value!r}", file=str(file),
                               entry=f"{section}.{key}")
        if isinstance(default, int) and not isinstance(default, bool) and not isinstance(value, int):
            raise CatalogError(f"expected an integer, got {value!r}", file=str(file), entry=f"{section}.{key}")
        out[key] = float(value) if isinstance(default, float) else value
    return out
