"""The coercion table: one value as a producer wrote it -> the value a field declares.

faultlens/coercion.toml holds the words (booleans, nulls, units); this module the
rules. Each ``to_*`` function returns the field's value or raises ``Bad(reason)``
(the decoder then nulls the field and reports a ``FieldIssue``):

=============  ==================================================================
field type     accepted
=============  ==================================================================
bool           true/false, integers (NVML's 0/1: nonzero is set), 0.0/1.0, the
               words of ``[booleans]`` ("Yes", "No", "Enabled", "Active"...)
float          numbers; numeric strings with the field's unit ("412.35 W")
int            integers; integral floats (3.0); numeric strings; hex masks
               ("0x0000000000000004"); beyond 64 bits: out_of_range
str            strings; a finite number as its text (a node named 17)
ts             unix seconds (number or string) or ISO-8601 ("...Z")
any            ``N/A``, ``[N/A]``, ``[Not Supported]``... (``[nulls]``), NaN and
               Infinity: null, with the reason the table names
=============  ==================================================================

Split from faultlens/decode.py so that the table (what is accepted) reads apart
from the decoding machinery (when it is applied).
"""

from __future__ import annotations

import datetime as dt
import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from faultlens import schema

ISSUE_VALUE_MAX = 200  # characters of a bad value kept in a FieldIssue
_TABLE = tomllib.loads((Path(__file__).with_name("coercion.toml")).read_text())
TRUE_WORDS = frozenset(_TABLE["booleans"]["true"])
FALSE_WORDS = frozenset(_TABLE["booleans"]["false"])
NULL_WORDS: dict[str, str] = dict(_TABLE["nulls"])
UNITS: dict[str, frozenset[str]] = {k: frozenset(v) for k, v in _TABLE["units"].items()}
NONFINITE_FIELDS = frozenset(_TABLE["nonfinite_values"]["fields"])
NONFINITE_WORDS: dict[str, float] = {k: float(v) for k, v in _TABLE["nonfinite_values"]["words"].items()}
_NUMBER_UNIT = re.compile(r"^([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([A-Za-z%]*)$")
_INT64 = (-(1 << 63), (1 << 63) - 1)


@dataclass(frozen=True, slots=True)
class FieldIssue:
    """One field the decoder could not read as declared (nulled), or an unknown key."""

    field: str  # "gpus.temp_c", "duration_s", ...
    reason: str  # not_available, not_supported, nan, infinity, bad_type, bad_unit, out_of_range, unknown_field ...
    value: str  # the value as JSON text, truncated


UNKNOWN_FIELD = "unknown_field"


class Bad(Exception):
    """A value a field cannot hold: the field becomes null, with this reason."""

    def __init__(self, reason: str):
        self.reason = reason


def text_of(value: Any) -> str:
    """A value as JSON text (its repr when it is no JSON), truncated: what a FieldIssue keeps."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    try:
        out = msgspec.json.encode(value).decode()
    except (TypeError, msgspec.EncodeError, ValueError):
        out = repr(value)
    return out[:ISSUE_VALUE_MAX]


# --------------------------------------------------------------------------- the coercion table


def _word(value: str) -> str:
    return value.strip().lower()


def _number(value: str, name: str) -> float:
    """A numeric string, with the field's unit if it carries one ("412.35 W")."""
    w = _word(value)
    if w in NULL_WORDS:
        raise Bad(NULL_WORDS[w])
    m = _NUMBER_UNIT.match(value.strip())
    if m is None:
        raise Bad("bad_type")
    unit = m.group(2).lower()
    if unit and unit not in UNITS.get(name, ()):
        raise Bad("bad_unit")
    return float(m.group(1)) if any(c in m.group(1) for c in ".eE") else int(m.group(1))


def to_float(value: Any, name: str) -> float:
    """A float field's value per the table; raises Bad(reason)."""
    if isinstance(value, bool):
        raise Bad("bad_type")
    if name in NONFINITE_FIELDS:  # NaN / Infinity is the measurement here (coercion.toml)
        if isinstance(value, float) and not math.isfinite(value):
            return value
        if isinstance(value, str) and _word(value) in NONFINITE_WORDS:
            return NONFINITE_WORDS[_word(value)]
    if isinstance(value, str):
        value = _number(value, name)
    if isinstance(value, int):
        return float(value)
    if isinstance(value, float):
        if math.isnan(value):
            raise Bad("nan")
        if math.isinf(value):
            raise Bad("infinity")
        return value
    raise Bad("bad_type")


def to_int(value: Any, name: str) -> int:
    """An integer field's value per the table (integral floats, hex masks); raises Bad(reason)."""
    if isinstance(value, bool):
        raise Bad("bad_type")
    if isinstance(value, str):
        w = _word(value)
        if w.startswith(("0x", "-0x")):
            try:
                value = int(w, 16)
            except ValueError:
                raise Bad("bad_type") from None
        else:
            value = _number(value, name)
    if isinstance(value, float):
        if math.isnan(value):
            raise Bad("nan")
        if math.isinf(value):
            raise Bad("infinity")
        if not value.is_integer():
            raise Bad("not_integral")
        value = int(value)
    if isinstance(value, int):
        if not _INT64[0] <= value <= _INT64[1]:
            raise Bad("out_of_range")
        return value
    raise Bad("bad_type")


def to_bool(value: Any, name: str) -> bool:
    """A boolean field's value per the table (0/1, "Yes"/"No", "Enabled"...); raises Bad(reason)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value != 0  # NVML's flags are unsigned ints: nonzero is set
    if isinstance(value, float):
        if value in (0.0, 1.0):
            return value == 1.0
        raise Bad("nan" if math.isnan(value) else "bad_type")
    if isinstance(value, str):
        w = _word(value)
        if w in TRUE_WORDS:
            return True
        if w in FALSE_WORDS:
            return False
        if w in NULL_WORDS:
            raise Bad(NULL_WORDS[w])
    raise Bad("bad_type")


def to_str(value: Any, name: str) -> str:
    """A string field: strings as they are, a number as its text (a node named 17)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return str(value)
    raise Bad("bad_type")


def to_ts(value: Any, name: str) -> float:
    """A time: unix seconds (number or numeric string) or an ISO-8601 string ("...Z")."""
    if isinstance(value, str) and ("-" in value[1:] or "T" in value):
        try:
            t = dt.datetime.fromisoformat(value.strip().replace("Z", "+00:00").replace("z", "+00:00"))
        except ValueError:
            raise Bad("bad_type") from None
        return (t if t.tzinfo else t.replace(tzinfo=dt.UTC)).timestamp()
    return to_float(value, name)  # its range: decode.check_time, on every path alike


MAX_TS = 253_402_300_799.0  # 9999-12-31T23:59:59Z: a larger time is a damaged one (the lake cannot partition it)


def to_list(value: Any, name: str) -> list[Any]:
    if isinstance(value, list):
        return value
    raise Bad("bad_type")


def to_dict(value: Any, name: str) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    raise Bad("bad_type")


# ---------------------------------------------------------------- how each record field is read
_COERCE = {float: to_float, int: to_int, bool: to_bool, str: to_str, list: to_list, dict: to_dict}


@dataclass(frozen=True, slots=True)
class FieldPlan:
    """One field of a record kind: its name, the coercer that reads it, and its default."""

    name: str
    coerce: Any
    optional: bool
    required: bool
    default: Any


_FIELD_PLANS: dict[type, tuple[FieldPlan, ...]] = {}


def field_plan(cls: type) -> tuple[FieldPlan, ...]:
    """The fields of a record kind in declaration order, each with its coercer (cached)."""
    plan = _FIELD_PLANS.get(cls)
    if plan is None:
        hints = schema._hints(cls)
        defaults = schema.field_defaults(cls)
        out = []
        for name in schema.field_names(cls):
            base, optional = schema._base_type(hints[name])
            origin = getattr(base, "__origin__", None) or base
            coerce = to_ts if name == "ts" else _COERCE.get(origin, to_list)
            default = defaults[name]
            out.append(FieldPlan(name, coerce, optional, default is msgspec.NODEFAULT, default))
        plan = _FIELD_PLANS[cls] = tuple(out)
    return plan

