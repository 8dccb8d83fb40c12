"""Per-record helpers of online diagnosis's apply stage, kept out of the service module.

Every repartitioned record passes here (tens of thousands a second per
instance): one pass over a message's headers instead of one scan per header,
and no allocation that the record does not need.
"""

from __future__ import annotations

from faultlens.decode import CONTENT_TYPE_HEADER
from faultlens.stream.bus import Message


def forwarded_headers(m: Message) -> tuple[str, str, int, str | None]:
    """(kind, source key, source offset, content type) of a repartition message, as the repartitioner
    wrote them (diagnosis.repartition): ``k``, ``sk``, ``so`` and the passed-through content type.
    A missing or unreadable source offset reads -1 (no de-duplication for that record)."""
    kind = source_key = ""
    source_offset = -1
    content_type = None
    for name, value in m.headers:
        if name == "k":
            kind = value.decode() if value else ""
        elif name == "sk":
            source_key = value.decode() if value else ""
        elif name == "so":
            try:
                source_offset = int(value or b"-1")
            except ValueError:
                source_offset = -1
        elif name == CONTENT_TYPE_HEADER and content_type is None:
            content_type = value.decode("latin-1") if value else None
    return kind, source_key, source_offset, content_type
