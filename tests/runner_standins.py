"""Stand-in executables for runner tests: they record their argv and exit as told.

Written into a tmp dir that goes first on the PATH the runner passes to its
commands (never this process's PATH).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from faultlens.config import KeysConfig
from faultlens.stream.signing import Ed25519Key, Keyring, public_path, write_key

# The tests' signing key pair: diagnosis' side signs with the private key (``signed``), the
# runner or agent under test reads only the public half from a file (``keys_config``), as a
# deployment does.
TEST_KEY = Ed25519Key.from_seed("test-key", bytes(range(32)))

_SCRIPT = """#!{python}
import json, sys
with open({record!r}, "a") as f:
    f.write(json.dumps([{name!r}] + sys.argv[1:]) + "\\n")
{stdin}sys.stderr.write({stderr!r})
sys.exit({code})
"""


def write_standin(bindir: Path, name: str, record: Path, *, exit_code: int = 0, stderr: str = "",
                  stdin_to: Path | None = None) -> Path:
    """An executable ``bindir/name`` appending its argv (JSON) to ``record``."""
    bindir.mkdir(parents=True, exist_ok=True)
    stdin = f"open({str(stdin_to)!r}, 'wb').write(sys.stdin.buffer.read())\n" if stdin_to else ""
    path = bindir / name
    path.write_text(_SCRIPT.format(python=sys.executable, record=str(record), name=name, stdin=stdin,
                                   stderr=stderr, code=exit_code))
    path.chmod(0o755)
    return path


def env_with(bindir: Path) -> dict[str, str]:
    """This process's environment with ``bindir`` first on PATH (for the commands only)."""
    return dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")


def recorded(record: Path) -> list[list[str]]:
    if not record.exists():
        return []
    return [json.loads(line) for line in record.read_text().splitlines() if line.strip()]


def keys_config(directory: Path) -> KeysConfig:
    """``[keys]`` naming the public file of ``TEST_KEY`` (written into ``directory``): verify only."""
    path = write_key(TEST_KEY.public_half(), public_path(directory / "test-key.toml"), force=True)
    return KeysConfig(files=(str(path),))


def signed(event: dict[str, Any]) -> dict[str, Any]:
    """``event`` signed as diagnosis signs it."""
    return Keyring([TEST_KEY]).sign(event)


def signing_keyring() -> Keyring:
    """Diagnosis' side of ``keys_config``: a keyring that signs with ``TEST_KEY`` (for ``Producer``)."""
    return Keyring([TEST_KEY])
