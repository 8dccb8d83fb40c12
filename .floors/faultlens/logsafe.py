"""Log hygiene for every service: one line per record, no secrets.

Two things went wrong before this existed: a newline inside a value (a job id, an action
id, a reason from the bus) wrote a second, forged line into the runner's log ("executing
action act-FORGED ..."), and ``--log-level DEBUG`` printed the SASL password (kafka-python
dumps its whole configuration at DEBUG). ``LogHygiene`` is a filter put on the *handlers*
(``install``), so it sees every record that is written, kafka-python's and other
third-party loggers' included, not only faultlens' own:

* control characters in the message become visible escapes (``\\n`` -> ``\\\\n``), so
  one record is always one line (a traceback, formatted separately, keeps its lines);
* values of password-, secret-, token- and key-like names (``password=...``,
  ``'sasl_plain_password': '...'``, ``Authorization: Bearer ...``) become ``***``, and so
  does every secret value registered with ``register_secret`` (the configuration's
  passwords and tokens, the signing keys read by ``stream.signing``), wherever it appears.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

REDACTED = "***"
_MIN_SECRET_CHARS = 4  # a shorter "secret" would blank ordinary words
_SECRETS: set[str] = set()

_NAME = r"[A-Za-z0-9_.-]*(?:password|passwd|passphrase|secret|token|api_?key|private_?key|credentials?)"
_ASSIGNED = re.compile(  # name = value, name: 'value', "name": "value" (a quoted value to its closing quote)
    rf"(?i)(?P<name>{_NAME})(?P<sep>['\"]?\s*[:=]\s*b?)"
    rf"(?:(?P<quote>['\"])(?:\\.|(?!(?P=quote)).)*(?P=quote)|[^'\"\s,;&)}}\]]+)"
)
_BEARER = re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]+")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\n\u2028\u2029\x85]")
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def register_secret(value: str | None) -> None:
    """Redact ``value`` wherever it appears in a log line from now on."""
    if value and len(value) >= _MIN_SECRET_CHARS:
        _SECRETS.add(value)


def register_secrets(values: Iterable[str | None]) -> None:
    for v in values:
        register_secret(v)


def redact(text: str) -> str:
    """``text`` with known secrets and password-like assignments replaced by ``***``."""
    for secret in sorted(_SECRETS, key=len, reverse=True):
        if secret in text:
            text = text.replace(secret, REDACTED)
    text = _ASSIGNED.sub(lambda m: f"{m['name']}{m['sep']}{m['quote'] or ''}{REDACTED}{m['quote'] or ''}", text)
    return _BEARER.sub(lambda m: f"{m[1]} {REDACTED}", text)


def escape_controls(text: str) -> str:
    """One line: newlines, carriage returns and other control characters as visible escapes."""
    return _CONTROL.sub(lambda m: _ESCAPES.get(m[0], f"\\x{ord(m[0]):02x}" if ord(m[0]) < 256
                                               else f"\\u{ord(m[0]):04x}"), text)


class LogHygiene(logging.Filter):
    """Escapes control characters and redacts secrets in every record a handler writes."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string: log what there is, never fail the caller
            message = f"{record.msg!r} {record.args!r}"
        record.msg = redact(escape_controls(message))
        record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


def install(level: int, fmt: str = "%(asctime)s %(levelname)s %(name)s: %(message)s") -> None:
    """Configure the root logger (as ``logging.basicConfig``) with ``LogHygiene`` on each handler."""
    logging.basicConfig(level=level, format=fmt)
    root = logging.getLogger()
    root.setLevel(level)
    for handler in root.handlers:
        if not any(isinstance(f, LogHygiene) for f in handler.filters):
            handler.addFilter(LogHygiene())
