"""``faultlens keys``: make the signing keys of actions and agent commands."""

from __future__ import annotations

import argparse

from faultlens.config import Config
from faultlens.errors import ConfigError
from faultlens.stream.signing import Ed25519Key, new_key, public_path, write_key

HELP = (
    "Make a signing key pair for actions and agent commands (Ed25519, stream/signing.py). Diagnosis signs "
    "with the private file FILE (mode 0600, keep it on the diagnosis hosts only); the runner and the agents "
    "verify with the public file FILE.pub and carry out only what verifies. A runner or agent host that is "
    "broken into can then read the public key but never forge an action. --type hmac writes the older "
    "shared secret instead (every host that verifies could also sign). To rotate: make a new pair, list "
    "both public files on the runner and agents and both private files on diagnosis, set [keys] active to "
    "the new id on diagnosis, then drop the old files."
)
EXAMPLE = ("faultlens keys new --out /etc/faultlens/keys/k1.toml   # diagnosis: [keys] files = [\"k1.toml\"]; "
           "runner, agents: [\"k1.toml.pub\"]")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", choices=["new"], help="new: write a fresh random key (pair)")
    p.add_argument("--out", required=True, metavar="FILE", help="where to write the private key (mode 0600)")
    p.add_argument("--pub-out", metavar="FILE", default=None,
                   help="where to write the public key (mode 0644; default FILE.pub); ed25519 only")
    p.add_argument("--type", dest="key_type", choices=["ed25519", "hmac"], default="ed25519",
                   help="ed25519: a private key that signs and a public one that only verifies; "
                        "hmac: one shared secret that does both")
    p.add_argument("--purposes", default="actions,commands", metavar="LIST",
                   help="what the key may sign: actions, commands or both (comma-separated)")
    p.add_argument("--id", dest="key_id", default=None,
                   help="key id (letters, digits, ._-); default k<UTC date>-<4 hex digits>")
    p.add_argument("--force", action="store_true", help="replace FILE (and the public file) when they exist")


def run(args: argparse.Namespace, config: Config) -> int:
    from pathlib import Path


    purposes = [p.strip() for p in args.purposes.split(",") if p.strip()]
    if args.key_type == "hmac" and args.pub_out:
        raise ConfigError("--pub-out: an HMAC key has no public half (use --type ed25519)")
    key = new_key(args.key_id, kind=args.key_type, purposes=purposes)
    if not isinstance(key, Ed25519Key):
        path = write_key(key, args.out, force=args.force)
        print(f"wrote HMAC key {key.id} to {path} (mode 0600): a shared secret, every holder can sign")
        print(f"configure it on diagnosis, the runner and the agents: [keys] files = [\"{path}\"]  "
              f"(or FAULTLENS_KEYS_FILES={path})")
        return 0
    pub = public_path(args.out) if args.pub_out is None else args.pub_out
    for target in (args.out, pub):  # check both before writing either: never half a pair
        if Path(target).exists() and not args.force:
            raise ConfigError("the key file exists; pass --force to replace it", file=str(target))
    path = write_key(key, args.out, force=args.force)
    pub_path = write_key(key.public_half(), pub, force=args.force)
    print(f"wrote Ed25519 key {key.id}: private {path} (mode 0600), public {pub_path} (mode 0644)")
    print(f"diagnosis (signs): [keys] files = [\"{path}\"]  (or FAULTLENS_KEYS_FILES={path})")
    print(f"runner and agents (verify): [keys] files = [\"{pub_path}\"]  (or FAULTLENS_KEYS_FILES={pub_path})")
    return 0
