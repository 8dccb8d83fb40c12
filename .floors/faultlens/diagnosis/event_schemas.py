"""The shipped JSON Schemas of the incident and action CloudEvents.

``diagnosis/schemas/incident.schema.json`` and ``action.schema.json`` describe
the envelope that ``faultlens.schema.cloudevent()`` produces, with the
Incident / Action record as ``data``. Outside consumers validate against the
files; inside faultlens the runner validates every action before touching a
machine. A schema is loaded and compiled once per ``EventValidator``.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from faultlens.errors import CatalogError

SCHEMA_FILES = {"incidents": "incident.schema.json", "actions": "action.schema.json"}


def load_schema(kind: str) -> dict[str, Any]:
    """The JSON Schema (a dict) of ``kind`` ("incidents" or "actions")."""
    if kind not in SCHEMA_FILES:
        raise ValueError(f"no JSON Schema for {kind!r}; known: {', '.join(SCHEMA_FILES)}")
    res = resources.files("faultlens.diagnosis").joinpath("schemas", SCHEMA_FILES[kind])
    try:
        return json.loads(res.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CatalogError(f"unreadable JSON Schema: {exc}", file=str(res)) from exc


class EventValidator:
    """Validates CloudEvent dicts of one kind; ``errors(event)`` lists what is wrong."""

    def __init__(self, kind: str):
        from jsonschema import Draft202012Validator
        from jsonschema.exceptions import SchemaError as JsonSchemaError

        schema = load_schema(kind)
        try:
            Draft202012Validator.check_schema(schema)
        except JsonSchemaError as exc:
            raise CatalogError(f"invalid JSON Schema: {exc.message}", file=SCHEMA_FILES[kind]) from exc
        self.kind = kind
        self._validator = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)

    def errors(self, event: Any) -> list[str]:
        """Short messages, each with the JSON path of the bad value; empty when valid."""
        out = []
        for err in sorted(self._validator.iter_errors(event), key=lambda e: list(e.absolute_path)):
            path = "/".join(str(p) for p in err.absolute_path) or "(envelope)"
            out.append(f"{path}: {err.message}")
        return out

    def is_valid(self, event: Any) -> bool:
        return self._validator.is_valid(event)
