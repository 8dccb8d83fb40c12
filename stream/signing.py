"""Signed actions and agent commands: who may make faultlens act.

Anyone who can write the actions or commands topic could otherwise drive the runner
(drain, cordon, a site hook) or the agents (py-spy on a job). Diagnosis signs every
action and every command it sends; the runner and the agents carry out only what
verifies, has not expired and is not dated in the future.

The signature is HMAC-SHA256 with a shared secret, over the *canonical envelope*: the
CloudEvent as canonical JSON (keys sorted, no spaces, UTF-8), without the signature
attribute itself. Key id, expiry and signature travel as CloudEvents extension
attributes (lower-case letters and digits, as the CloudEvents spec requires)::

    faultlenskeyid    the id of the key that signed (rotation: several ids verify)
    faultlensexpires  RFC 3339 time after which the event is refused
    faultlenssig      base64url HMAC-SHA256 of the canonical envelope

The key id and the expiry are inside what is signed, so neither can be changed.
Keys live in files (``faultlens keys new --out FILE``, mode 0600) named in
``[keys] files``; ``[keys] active`` picks the one diagnosis signs with (default: the
first), every listed key verifies. This module is in ``stream/`` so that diagnosis
and the collectors (which may import only ``stream``) share it.

    keyring = Keyring.from_config(config.keys)
    event = keyring.sign(cloudevent(action))          # diagnosis
    keyring.verify(event)                             # runner, agent: raises Unverified
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import os
import re
import secrets
import time
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from faultlens.config import KeysConfig
from faultlens.errors import ConfigError, FaultlensError
from faultlens.logsafe import register_secret

KEYID_ATTR = "faultlenskeyid"
EXPIRES_ATTR = "faultlensexpires"
SIG_ATTR = "faultlenssig"
SIGNATURE_ATTRS = (KEYID_ATTR, EXPIRES_ATTR, SIG_ATTR)
KEY_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SECRET_BYTES = 32  # HMAC-SHA256's block-size-safe key length; shorter keys are refused
HOW_TO_MAKE_A_KEY = (
    "make a key with `faultlens keys new --out /etc/faultlens/keys/k1.toml` and name it in "
    "[keys] files (or FAULTLENS_KEYS_FILES) for diagnosis, the runner and the agents"
)

class Unverified(FaultlensError):
    """An action or command that must not be carried out; ``reason`` is a short token for metrics."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Key:
    """One signing key: its id and its secret (never printed: ``repr`` hides it)."""

    id: str
    secret: bytes = field(repr=False)

    def mac(self, message: bytes) -> str:
        digest = hmac.new(self.secret, message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def new_key(key_id: str | None = None) -> Key:
    """A fresh random key; id ``k<UTC date>-<4 hex>`` unless given."""
    key_id = key_id or f"k{time.strftime('%Y%m%d', time.gmtime())}-{secrets.token_hex(2)}"
    if not KEY_ID_RE.match(key_id):
        raise ConfigError(f"key id {key_id!r}: letters, digits and ._- only, at most 64", key="keys.active")
    return Key(key_id, secrets.token_bytes(SECRET_BYTES))


def write_key(key: Key, path: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Write ``key`` as a small TOML file readable by its owner only (mode 0600)."""
    out = Path(path)
    if out.exists() and not force:
        raise ConfigError("the key file exists; pass --force to replace it", file=str(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    text = (f"# faultlens signing key; keep it secret (mode 0600)\nid = \"{key.id}\"\n"
            f"secret = \"{base64.urlsafe_b64encode(key.secret).decode()}\"\n")
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(out, 0o600)  # O_CREAT's mode does not apply to a file that already existed
    return out


def read_key(path: str | os.PathLike[str]) -> Key:
    """A key file written by ``write_key``; ConfigError naming the file when it is not one."""
    file = str(path)
    try:
        data = tomllib.loads(Path(file).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("key file not found (faultlens keys new --out FILE makes one)", file=file) from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"unreadable key file: {exc}", file=file) from None
    key_id, text = data.get("id"), data.get("secret")
    if not isinstance(key_id, str) or not KEY_ID_RE.match(key_id):
        raise ConfigError("the key file needs id = \"...\" (letters, digits, ._-)", file=file, key="id")
    try:
        secret = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)) if isinstance(text, str) else b""
    except ValueError:
        secret = b""
    if len(secret) < SECRET_BYTES:
        raise ConfigError(f"the key file needs secret = \"<base64 of at least {SECRET_BYTES} bytes>\"",
                          file=file, key="secret")
    register_secret(str(text))  # never in a log line from now on
    return Key(key_id, secret)


def canonical(event: Mapping[str, Any]) -> bytes:
    """The bytes that are signed: the envelope without its signature, keys sorted, compact JSON."""
    return orjson.dumps({k: v for k, v in event.items() if k != SIG_ATTR}, option=orjson.OPT_SORT_KEYS)


def _rfc3339(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat().replace("+00:00", "Z")


def _parse_time(value: Any, name: str) -> float:
    if not isinstance(value, str):
        raise Unverified("bad_envelope", f"{name} is not an RFC 3339 time: {value!r}"[:200])
    try:
        parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise Unverified("bad_envelope", f"{name} is not an RFC 3339 time: {value!r}"[:200]) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.UTC)
    return parsed.timestamp()


class Keyring:
    """The keys of one service: sign with the active one, verify with any of them."""

    def __init__(self, keys: list[Key], *, active: str = "", validity_s: float = 900.0,
                 max_skew_s: float = 60.0, clock: Callable[[], float] = time.time):
        self.keys = {k.id: k for k in keys}
        if active and active not in self.keys:
            raise ConfigError(f"no key file holds the active key id {active!r}; known: "
                              f"{', '.join(self.keys) or 'none'}", key="keys.active")
        self.active = self.keys[active] if active else (keys[0] if keys else None)
        self.validity_s = validity_s
        self.max_skew_s = max_skew_s
        self.clock = clock

    @classmethod
    def from_config(cls, cfg: KeysConfig, *, clock: Callable[[], float] = time.time) -> Keyring:
        """Read every file in ``cfg.files`` (a bad file fails at start, named)."""
        return cls([read_key(p) for p in cfg.files], active=cfg.active, validity_s=cfg.validity_s,
                   max_skew_s=cfg.max_skew_s, clock=clock)

    def __bool__(self) -> bool:
        return bool(self.keys)

    def sign(self, event: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of ``event`` with key id, expiry and signature; ConfigError without a key."""
        if self.active is None:
            raise ConfigError(f"no signing key: {HOW_TO_MAKE_A_KEY}", key="keys.files")
        out = {k: v for k, v in event.items() if k not in SIGNATURE_ATTRS}
        out[KEYID_ATTR] = self.active.id
        out[EXPIRES_ATTR] = _rfc3339(self.clock() + self.validity_s)
        out[SIG_ATTR] = self.active.mac(canonical(out))
        return out

    def verify(self, event: Any) -> None:
        """Raise ``Unverified`` unless ``event`` is signed by a listed key, unexpired and not future-dated."""
        if not isinstance(event, Mapping):
            raise Unverified("bad_envelope", "not a JSON object")
        if not self.keys:
            raise Unverified("no_key_configured", HOW_TO_MAKE_A_KEY)
        key_id, sig = event.get(KEYID_ATTR), event.get(SIG_ATTR)
        if not isinstance(sig, str) or not isinstance(key_id, str):
            raise Unverified("unsigned", f"no {KEYID_ATTR}/{SIG_ATTR} attributes")
        key = self.keys.get(key_id)
        if key is None:
            raise Unverified("unknown_key", f"key id {key_id[:64]!r} is not among [keys] files")
        if not hmac.compare_digest(key.mac(canonical(event)), sig):
            raise Unverified("bad_signature", f"the signature does not match key {key_id!r}")
        now = self.clock()
        expires = _parse_time(event.get(EXPIRES_ATTR), EXPIRES_ATTR)
        if now > expires + self.max_skew_s:
            raise Unverified("expired", f"expired {now - expires:.0f} s ago ({event.get(EXPIRES_ATTR)})")
        if "time" in event:
            when = _parse_time(event["time"], "time")
            if when > now + self.max_skew_s:
                raise Unverified("future_dated", f"dated {when - now:.0f} s in the future ({event['time']}), "
                                 f"more than the allowed skew of {self.max_skew_s:g} s")
