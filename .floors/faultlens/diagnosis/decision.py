"""What the policy decides for an incident: an action (``Decision``) or a reason to wait (``Hold``).

Their own module because incidents keep a held-back decision and the policy makes them: both
import these, neither imports the other for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Decision:
    type: str  # one of ACTION_TYPES
    nodes: tuple[str, ...]
    reason: str
    confidence: float
    plan: dict[str, Any] | None = None
    blame: bool = True  # False: the nodes are checked, not blamed (a whole job's machines after NaN loss)


@dataclass(frozen=True)
class Hold:
    """No decision yet, and why (shown on the incident): the engine asks again on a later tick."""

    reason: str
