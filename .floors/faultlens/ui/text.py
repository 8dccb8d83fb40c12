"""Log text in Markdown: shown as the text it is, never as markup.

Log lines, node names and job ids come from machines and users: a kernel line may
carry ``<script>``, ``<img onerror=...>`` or ``![x](http://host/pixel)``, a job id a
backtick. Markdown renderers (GitHub, chat, Streamlit's ``st.markdown``) would run,
fetch or break on them, so every such string goes through one of these two:

- ``md_code``: a code span whose fence is one backtick longer than the longest run
  inside (CommonMark), on one line; nothing inside a code span is markup.
- ``md_escape``: every character that can open inline markup backslash-escaped
  (emphasis, code, links and images, tables, strike-through, Streamlit's ``:colour[]``,
  ``:emoji:`` and ``$math$``), ``<``, ``>`` and ``&`` as entities, on one line. Block
  markers (``#``, ``-``, ``1.``) only count at a line's start, where these strings never are;
  an underscore inside a word (``gpu_lost``) opens nothing and is left as it is.

Both fold line breaks and other control characters into spaces: a line break would let
the next line start an HTML block outside the span.
"""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f\x7f\u2028\u2029]")
_ENTITIES = {"<": "&lt;", ">": "&gt;", "&": "&amp;"}
_INLINE = re.compile(r"[\\`*\[\]<>&!|~$:{}]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    return _ENTITIES.get(c) or "\\" + c


def one_line(text: object) -> str:
    """``text`` as one line: control characters (line breaks included) become spaces."""
    return _CONTROL.sub(" ", str(text))


def md_escape(text: object) -> str:
    """``text`` as plain Markdown text: no emphasis, link, image, HTML, table cell or heading."""
    return _INLINE.sub(_escape, one_line(text))


def md_code(text: object) -> str:
    """``text`` as an inline code span that no backtick inside can close early."""
    line = one_line(text)
    longest = max((len(run) for run in re.findall(r"`+", line)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if line.startswith("`") or line.endswith("`") or (line.startswith(" ") and line.endswith(" ")) else ""
    if not line.strip():
        return md_escape(line) or "(empty)"
    return f"{fence}{pad}{line}{pad}{fence}"


__all__ = ["md_code", "md_escape", "one_line"]
