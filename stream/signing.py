"""Signed actions and agent commands: who may make faultlens act.

Anyone who can write the actions or commands topic could otherwise drive the runner
(drain, cordon, a site hook) or the agents (py-spy on a job). Diagnosis signs every
action and every command it sends; the runner and the agents carry out only what
verifies, has not expired and is not dated in the future.

The signature is Ed25519 (default) or HMAC-SHA256 over the *canonical envelope*: the
CloudEvent as canonical JSON (keys sorted, no spaces, UTF-8), without the signature
attribute itself. Ed25519 is asymmetric: diagnosis alone holds the private key, the
runner and the agents hold only its public half, so a compromised GPU node can verify
but never forge an ``evict_nodes`` for the fleet. (With HMAC every verifier holds a
secret that also signs; it stays for sites that already run it.) Key id, algorithm,
expiry and signature travel as CloudEvents extension attributes (lower-case letters
and digits, as the CloudEvents spec requires)::

    faultlenskeyid    the id of the key that signed (rotation: several ids verify)
    faultlenssigalg   ed25519 | hmac-sha256 (absent: hmac-sha256, as signed before it existed)
    faultlensexpires  RFC 3339 time after which the event is refused
    faultlenssig      base64url signature of the canonical envelope

The key id, algorithm and expiry are inside what is signed, so none can be changed; the
verifier uses its own key's algorithm and refuses an event naming another. Keys live in
files (``faultlens keys new --out FILE``: FILE, mode 0600, for diagnosis; FILE.pub for
the runner and agents) named in ``[keys] files``; ``[keys] active`` picks the key
diagnosis signs with (default: the first that can sign), every listed key verifies. A
key file may restrict its key to ``purposes = ["actions"]`` or ``["commands"]``: an
event verifies only with a key allowed its purpose (from the CloudEvent type). This
module is in ``stream/`` so that diagnosis and the collectors (which may import only
``stream``) share it.

    keyring = Keyring.from_config(config.keys)
    event = keyring.sign(cloudevent(action))          # diagnosis
    keyring.verify(event)                             # runner, agent: raises Unverified
"""

from __future__ import annotations

import base64
import datetime as dt
import functools
import hashlib
import hmac
import logging
import os
import re
import secrets
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import orjson
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from faultlens.config import KeysConfig
from faultlens.errors import ConfigError, FaultlensError
from faultlens.logsafe import register_secret
from faultlens.schema import CLOUDEVENT_TYPES

KEYID_ATTR = "faultlenskeyid"
SIGALG_ATTR = "faultlenssigalg"
EXPIRES_ATTR = "faultlensexpires"
SIG_ATTR = "faultlenssig"
SIGNATURE_ATTRS = (KEYID_ATTR, SIGALG_ATTR, EXPIRES_ATTR, SIG_ATTR)
KEY_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SECRET_BYTES = 32  # HMAC-SHA256's block-size-safe key length; shorter keys are refused
ED25519_BYTES = 32  # an Ed25519 private seed and a public key are both 32 bytes
HMAC_ALG = "hmac-sha256"
ED25519_ALG = "ed25519"
KeyType = Literal["hmac-sha256", "ed25519-private", "ed25519-public"]
KEY_TYPES: tuple[KeyType, ...] = ("hmac-sha256", "ed25519-private", "ed25519-public")
PURPOSES = frozenset({"actions", "commands"})  # what a key may sign: the CloudEvent types it covers
PURPOSE_OF_TYPE = {ce_type: kind for kind, ce_type in CLOUDEVENT_TYPES.items() if kind in PURPOSES}
log = logging.getLogger(__name__)

HOW_TO_MAKE_A_KEY = (
    "make a key pair with `faultlens keys new --out /etc/faultlens/keys/k1.toml`: name k1.toml in "
    "[keys] files (or FAULTLENS_KEYS_FILES) for diagnosis, and k1.toml.pub for the runner and the agents"
)


class Unverified(FaultlensError):
    """An action or command that must not be carried out; ``reason`` is a short token for metrics."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: object) -> bytes:
    """Unpadded or padded base64url; b"" for anything that is not (the caller names the field)."""
    if not isinstance(text, str):
        return b""
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except ValueError:
        return b""


@dataclass(frozen=True)
class Key:
    """A shared HMAC-SHA256 key: whoever holds it can verify *and* sign (``repr`` hides the secret)."""

    id: str
    secret: bytes = field(repr=False)
    purposes: frozenset[str] = field(default=PURPOSES, repr=False)
    alg: ClassVar[str] = HMAC_ALG
    can_sign: ClassVar[bool] = True

    @property
    def type(self) -> KeyType:
        return "hmac-sha256"

    def mac(self, message: bytes) -> str:
        digest = hmac.new(self.secret, message, hashlib.sha256).digest()
        return _b64(digest)

    def signature(self, message: bytes) -> str:
        """base64url HMAC-SHA256 of ``message`` (43 characters)."""
        return self.mac(message)

    def matches(self, message: bytes, sig: str) -> bool:
        return hmac.compare_digest(self.mac(message), sig)


@dataclass(frozen=True)
class Ed25519Key:
    """An Ed25519 key: with ``private`` it signs (diagnosis); with only ``public`` it verifies (runner, agents)."""

    id: str
    public: bytes = field(repr=False)
    private: bytes | None = field(default=None, repr=False)
    purposes: frozenset[str] = field(default=PURPOSES, repr=False)
    alg: ClassVar[str] = ED25519_ALG

    @classmethod
    def from_seed(cls, key_id: str, seed: bytes, purposes: Iterable[str] | None = None) -> Ed25519Key:
        """The key pair of a 32-byte private seed (its public half derived)."""
        public = Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        return cls(key_id, public, seed, _purposes(purposes))

    @property
    def type(self) -> KeyType:
        return "ed25519-private" if self.private is not None else "ed25519-public"

    @property
    def can_sign(self) -> bool:
        return self.private is not None

    @functools.cached_property
    def _verifier(self) -> Ed25519PublicKey:
        return Ed25519PublicKey.from_public_bytes(self.public)

    @functools.cached_property
    def _signer(self) -> Ed25519PrivateKey:
        if self.private is None:
            raise ConfigError(f"key {self.id!r} is a public key: it verifies but cannot sign; "
                              "diagnosis needs the private key file", key="keys.files")
        return Ed25519PrivateKey.from_private_bytes(self.private)

    def signature(self, message: bytes) -> str:
        """base64url Ed25519 signature of ``message`` (86 characters)."""
        return _b64(self._signer.sign(message))

    def matches(self, message: bytes, sig: str) -> bool:
        raw = _unb64(sig)
        if len(raw) != 64:
            return False
        try:
            self._verifier.verify(raw, message)
        except InvalidSignature:
            return False
        return True

    def public_half(self) -> Ed25519Key:
        """The same key without its private part: what the runner and the agents are given."""
        return Ed25519Key(self.id, self.public, None, self.purposes)


AnyKey = Key | Ed25519Key


def _new_id(key_id: str | None) -> str:
    key_id = key_id or f"k{time.strftime('%Y%m%d', time.gmtime())}-{secrets.token_hex(2)}"
    if not KEY_ID_RE.match(key_id):
        raise ConfigError(f"key id {key_id!r}: letters, digits and ._- only, at most 64", key="keys.active")
    return key_id


def _purposes(purposes: Iterable[str] | None, file: str | None = None) -> frozenset[str]:
    if purposes is None:
        return PURPOSES
    chosen = frozenset(purposes)
    if not chosen or not chosen <= PURPOSES:
        raise ConfigError(f"purposes must be a non-empty list of {sorted(PURPOSES)}, not {sorted(chosen)}",
                          file=file, key="purposes")
    return chosen


def new_key(key_id: str | None = None, *, kind: Literal["ed25519", "hmac"] = "ed25519",
            purposes: Iterable[str] | None = None) -> AnyKey:
    """A fresh random key; id ``k<UTC date>-<4 hex>`` unless given. Ed25519 unless ``kind="hmac"``."""
    key_id = _new_id(key_id)
    allowed = _purposes(purposes)
    if kind == "hmac":
        return Key(key_id, secrets.token_bytes(SECRET_BYTES), allowed)
    seed = Ed25519PrivateKey.generate().private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    return Ed25519Key.from_seed(key_id, seed, allowed)


def public_path(private_file: str | os.PathLike[str]) -> Path:
    """Where ``faultlens keys new`` puts the public half of FILE by default: FILE.pub."""
    return Path(f"{os.fspath(private_file)}.pub")


def write_key(key: AnyKey, path: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Write ``key`` as a small TOML file stating its type: mode 0600 when it can sign, 0644 when public."""
    out = Path(path)
    if out.exists() and not force:
        raise ConfigError("the key file exists; pass --force to replace it", file=str(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"type = \"{key.type}\"", f"id = \"{key.id}\""]
    if isinstance(key, Key):
        lines.insert(0, "# faultlens signing key (HMAC-SHA256, shared): keep it secret (mode 0600)")
        lines.append(f"secret = \"{base64.urlsafe_b64encode(key.secret).decode()}\"")
    elif key.private is not None:
        lines.insert(0, "# faultlens signing key (Ed25519, private): diagnosis only; keep it secret (mode 0600)")
        lines.append(f"secret = \"{base64.urlsafe_b64encode(key.private).decode()}\"")
        lines.append(f"public = \"{base64.urlsafe_b64encode(key.public).decode()}\"")
    else:
        lines.insert(0, "# faultlens verifying key (Ed25519, public): for the runner and the agents")
        lines.append(f"public = \"{base64.urlsafe_b64encode(key.public).decode()}\"")
    if key.purposes != PURPOSES:
        lines.append("purposes = [" + ", ".join(f"\"{p}\"" for p in sorted(key.purposes)) + "]")
    mode = 0o600 if key.can_sign else 0o644
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    os.chmod(out, mode)  # O_CREAT's mode does not apply to a file that already existed
    return out


def _raw_field(data: Mapping[str, Any], name: str, size: int, file: str, *, at_least: bool = False) -> bytes:
    raw = _unb64(data.get(name))
    if (len(raw) < size) if at_least else (len(raw) != size):
        need = f"at least {size}" if at_least else str(size)
        raise ConfigError(f"the key file needs {name} = \"<base64 of {need} bytes>\"", file=file, key=name)
    return raw


def read_key(path: str | os.PathLike[str]) -> AnyKey:
    """A key file written by ``write_key``; ConfigError naming the file when it is not one.

    A file without ``type`` is an HMAC key (what faultlens wrote before Ed25519)."""
    file = str(path)
    try:
        data = tomllib.loads(Path(file).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("key file not found (faultlens keys new --out FILE makes one)", file=file) from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"unreadable key file: {exc}", file=file) from None
    key_id, key_type = data.get("id"), data.get("type", "hmac-sha256")
    if not isinstance(key_id, str) or not KEY_ID_RE.match(key_id):
        raise ConfigError("the key file needs id = \"...\" (letters, digits, ._-)", file=file, key="id")
    if key_type not in KEY_TYPES:
        raise ConfigError(f"unknown key type {key_type!r}; one of {', '.join(KEY_TYPES)}", file=file, key="type")
    listed = data.get("purposes")
    if listed is not None and not (isinstance(listed, list) and all(isinstance(p, str) for p in listed)):
        raise ConfigError("purposes must be a list of strings", file=file, key="purposes")
    allowed = _purposes(listed, file)
    if key_type == "hmac-sha256":
        secret = _raw_field(data, "secret", SECRET_BYTES, file, at_least=True)
        register_secret(str(data["secret"]))  # never in a log line from now on
        return Key(key_id, secret, allowed)
    if key_type == "ed25519-public":
        if "secret" in data:
            raise ConfigError("a public key file holds no secret; is this the private file?", file=file, key="secret")
        return Ed25519Key(key_id, _raw_field(data, "public", ED25519_BYTES, file), None, allowed)
    seed = _raw_field(data, "secret", ED25519_BYTES, file)
    register_secret(str(data["secret"]))
    key = Ed25519Key.from_seed(key_id, seed, allowed)
    if "public" in data and _unb64(data["public"]) != key.public:
        raise ConfigError("public does not belong to this secret (a damaged or edited file)", file=file, key="public")
    return key


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


def purpose_of(event: Mapping[str, Any]) -> str | None:
    """``actions`` or ``commands`` from the CloudEvent type; None for any other type."""
    ce_type = event.get("type")
    return PURPOSE_OF_TYPE.get(ce_type) if isinstance(ce_type, str) else None


def _merge(keys: Iterable[AnyKey]) -> dict[str, AnyKey]:
    """Keys by id; a private and a public file of the same key merge (the private one kept)."""
    by_id: dict[str, AnyKey] = {}
    for key in keys:
        held = by_id.get(key.id)
        if held is None:
            by_id[key.id] = key
            continue
        same = (isinstance(held, Ed25519Key) and isinstance(key, Ed25519Key) and held.public == key.public
                and held.purposes == key.purposes) or held == key
        if not same:
            raise ConfigError(f"two key files hold key id {key.id!r} with different keys", key="keys.files")
        if key.can_sign and not held.can_sign:
            by_id[key.id] = key
    return by_id


class Keyring:
    """The keys of one service: sign with the active private key, verify with any listed key."""

    def __init__(self, keys: Iterable[AnyKey], *, active: str = "", validity_s: float = 900.0,
                 max_skew_s: float = 60.0, clock: Callable[[], float] = time.time):
        self.keys = _merge(keys)
        if active and active not in self.keys:
            raise ConfigError(f"no key file holds the active key id {active!r}; known: "
                              f"{', '.join(self.keys) or 'none'}", key="keys.active")
        if active and not self.keys[active].can_sign:
            raise ConfigError(f"the active key {active!r} is a public key: it cannot sign; name its private "
                              "file in [keys] files on diagnosis", key="keys.active")
        self.active: AnyKey | None = (self.keys[active] if active
                                      else next((k for k in self.keys.values() if k.can_sign), None))
        self.validity_s = validity_s
        self.max_skew_s = max_skew_s
        self.clock = clock

    @classmethod
    def from_config(cls, cfg: KeysConfig, *, clock: Callable[[], float] = time.time) -> Keyring:
        """Read every file in ``cfg.files`` (a bad file fails at start, named)."""
        return cls([read_key(p) for p in cfg.files], active=cfg.active, validity_s=cfg.validity_s,
                   max_skew_s=cfg.max_skew_s, clock=clock)

    @classmethod
    def for_signer(cls, cfg: KeysConfig, who: str) -> Keyring:
        """The keyring of a part that signs what it sends (diagnosis): only public keys fail at start, no key
        at all is a warning (what it sends goes out unsigned, and only dry-run obeys it)."""
        ring = cls.from_config(cfg)
        if ring and not ring.can_sign:
            raise ConfigError(f"{who} signs what it sends, but [keys] files hold only public keys "
                              f"({', '.join(ring.keys)}): name the private key file (not FILE.pub)", key="keys.files")
        if not ring:
            log.warning("%s: no signing key, what it sends goes out unsigned: the runner only dry-runs it and "
                        "agents ignore it; %s", who, HOW_TO_MAKE_A_KEY)
        return ring

    def __bool__(self) -> bool:
        return bool(self.keys)

    @property
    def can_sign(self) -> bool:
        """Whether this keyring holds a key that can sign (diagnosis must; the runner and agents need not)."""
        return self.active is not None

    def signing_key_ids(self) -> list[str]:
        """Ids of the keys that could sign: a runner or agent should list none (start-up warning)."""
        return [k.id for k in self.keys.values() if k.can_sign]

    def _signer_for(self, purpose: str | None) -> AnyKey:
        if self.active is None:
            if self.keys:
                raise ConfigError(f"[keys] files hold only public keys ({', '.join(self.keys)}): this service "
                                  "can verify but not sign; diagnosis needs the private key file",
                                  key="keys.files")
            raise ConfigError(f"no signing key: {HOW_TO_MAKE_A_KEY}", key="keys.files")
        if purpose is None or purpose in self.active.purposes:
            return self.active
        for key in self.keys.values():  # a key kept for the other purpose, e.g. commands-only
            if key.can_sign and purpose in key.purposes:
                return key
        raise ConfigError(f"no private key in [keys] files may sign {purpose} (key {self.active.id!r} is "
                          f"restricted to {', '.join(sorted(self.active.purposes))})", key="keys.files")

    def sign(self, event: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of ``event`` with key id, algorithm, expiry and signature; ConfigError without a private key."""
        key = self._signer_for(purpose_of(event))
        out = {k: v for k, v in event.items() if k not in SIGNATURE_ATTRS}
        out[KEYID_ATTR] = key.id
        out[SIGALG_ATTR] = key.alg
        out[EXPIRES_ATTR] = _rfc3339(self.clock() + self.validity_s)
        out[SIG_ATTR] = key.signature(canonical(out))
        return out

    def verify(self, event: Any) -> None:
        """Raise ``Unverified`` unless ``event`` is signed by a listed key allowed its purpose, unexpired
        and not future-dated."""
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
        alg = event.get(SIGALG_ATTR, HMAC_ALG)  # events signed before the attribute existed are HMAC
        if alg != key.alg:  # the key decides the algorithm, never the event
            raise Unverified("wrong_algorithm", f"{SIGALG_ATTR} {str(alg)[:32]!r}, but key {key_id!r} is {key.alg}")
        if not key.matches(canonical(event), sig):
            raise Unverified("bad_signature", f"the signature does not match key {key_id!r}")
        purpose = purpose_of(event)
        if key.purposes != PURPOSES and purpose not in key.purposes:
            raise Unverified("wrong_purpose", f"key {key_id!r} may sign only {', '.join(sorted(key.purposes))}, "
                             f"not {purpose or repr(event.get('type'))[:64]}")
        now = self.clock()
        expires = _parse_time(event.get(EXPIRES_ATTR), EXPIRES_ATTR)
        if now > expires + self.max_skew_s:
            raise Unverified("expired", f"expired {now - expires:.0f} s ago ({event.get(EXPIRES_ATTR)})")
        if "time" in event:
            when = _parse_time(event["time"], "time")
            if when > now + self.max_skew_s:
                raise Unverified("future_dated", f"dated {when - now:.0f} s in the future ({event['time']}), "
                                 f"more than the allowed skew of {self.max_skew_s:g} s")


SEAL_MAGIC = b"FLSEAL1\n"  # a sealed record: magic, 2-byte header length, JSON header, payload


def _seal_message(payload: bytes, context: bytes) -> bytes:
    """What a seal signs: the context (where the record belongs) and a digest of the payload, so that
    the signature costs the same for a 100-byte marker and a 1 MB checkpoint."""
    return SEAL_MAGIC + hashlib.sha256(context).digest() + hashlib.sha256(payload).digest()


def seal(keyring: Keyring, payload: bytes, context: bytes) -> bytes:
    """``payload`` signed with the active key for one place (``context``: topic, partition, key), for
    records a service writes for itself to read back (diagnosis's changelog). No expiry: a checkpoint
    of an idle job stays valid; a record copied to another key or partition does not verify."""
    key = keyring._signer_for(None)
    head = orjson.dumps({"kid": key.id, "alg": key.alg, "sig": key.signature(_seal_message(payload, context))})
    return SEAL_MAGIC + len(head).to_bytes(2, "big") + head + payload


def unseal(keyring: Keyring, value: bytes | None, context: bytes) -> bytes:
    """The payload of a record ``seal`` wrote for ``context``; ``Unverified`` for anything else
    (unsigned, another key, another place, altered)."""
    if not value:
        raise Unverified("unsigned", "a null or empty record")
    if not value.startswith(SEAL_MAGIC) or len(value) < len(SEAL_MAGIC) + 2:
        raise Unverified("unsigned", "no seal")
    start = len(SEAL_MAGIC) + 2
    end = start + int.from_bytes(value[len(SEAL_MAGIC):start], "big")
    try:
        head = orjson.loads(value[start:end])
    except orjson.JSONDecodeError:
        raise Unverified("bad_envelope", "the seal's header is not JSON") from None
    if not isinstance(head, dict) or not all(isinstance(head.get(f), str) for f in ("kid", "alg", "sig")):
        raise Unverified("bad_envelope", "the seal's header lacks kid, alg or sig")
    key = keyring.keys.get(head["kid"])
    if key is None:
        raise Unverified("unknown_key", f"key id {head['kid'][:64]!r} is not among [keys] files")
    if head["alg"] != key.alg:
        raise Unverified("wrong_algorithm", f"alg {head['alg'][:32]!r}, but key {key.id!r} is {key.alg}")
    payload = value[end:]
    if not key.matches(_seal_message(payload, context), head["sig"]):
        raise Unverified("bad_signature", f"the seal does not match key {key.id!r} for this record's place")
    return payload


def verifier_warning(keyring: Keyring, service: str) -> str | None:
    """The start-up warning for a service that only verifies (runner, agent) but holds a key that signs."""
    ids = keyring.signing_key_ids()
    if not ids:
        return None
    shared = [i for i in ids if isinstance(keyring.keys[i], Key)]
    why = (f"HMAC key(s) {', '.join(shared)} sign as well as verify: make an Ed25519 pair with "
           "`faultlens keys new` and " if shared else "")
    return (f"{service} holds a signing key ({', '.join(ids)}): {why}give it the .pub file; whoever breaks "
            f"into this host could otherwise sign actions and commands for the whole fleet")
