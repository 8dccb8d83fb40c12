"""``faultlens keys``: make the signing keys of actions and agent commands."""

from __future__ import annotations

import argparse

from faultlens.config import Config

HELP = (
    "Make a signing key for actions and agent commands (HMAC-SHA256, stream/signing.py). Diagnosis signs "
    "with it; the runner and the agents carry out only what verifies against a key listed in [keys] files. "
    "The file is written with mode 0600: copy it to the diagnosis, runner and agent hosts (a Kubernetes "
    "Secret, a config-management vault) and name it in [keys] files. To rotate: make a new key, list both "
    "files everywhere, set [keys] active to the new id on diagnosis, then drop the old file."
)
EXAMPLE = "faultlens keys new --out /etc/faultlens/keys/k1.toml   # then: [keys] files = [\"/etc/faultlens/keys/k1.toml\"]"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", choices=["new"], help="new: write a fresh random key")
    p.add_argument("--out", required=True, metavar="FILE", help="where to write the key (mode 0600)")
    p.add_argument("--id", dest="key_id", default=None,
                   help="key id (letters, digits, ._-); default k<UTC date>-<4 hex digits>")
    p.add_argument("--force", action="store_true", help="replace FILE when it exists")


def run(args: argparse.Namespace, config: Config) -> int:
    from faultlens.stream.signing import new_key, write_key

    key = new_key(args.key_id)
    path = write_key(key, args.out, force=args.force)
    print(f"wrote key {key.id} to {path} (mode 0600)")
    print(f"configure it on diagnosis, the runner and the agents: [keys] files = [\"{path}\"]  "
          f"(or FAULTLENS_KEYS_FILES={path})")
    return 0
