"""One vocabulary: categories, severities, actions and kinds are declared once.

faultlens/vocabulary.py is the one place these names are declared. A module that spells
two or more of one enum's values as string literals in the same set, list, tuple or dict
is redeclaring part of the vocabulary (a set of "machine fault" kinds, a kind -> action
table): when a kind is added or renamed, that copy silently disagrees. This test reads the
source of every part with ``ast`` and names each such literal with its file and line.

Values that are ordinary English words used as generic states ("none", "unknown",
"other", "healthy", "info", "warning", "critical", "notify") are left out: two of them
side by side say nothing about a copy of the vocabulary.
"""

from __future__ import annotations

import ast
from enum import StrEnum
from pathlib import Path

import pytest

from faultlens import vocabulary

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("faultlens", "collectors", "stream", "models", "diagnosis", "ui", "datasets")
GENERIC = {"none", "unknown", "other", "healthy", "info", "warning", "critical", "notify"}
ENUMS: tuple[type[StrEnum], ...] = (
    vocabulary.Category,
    vocabulary.Severity,
    vocabulary.LineAction,
    vocabulary.ActionType,
    vocabulary.FaultKind,
    vocabulary.IncidentKind,
)


def _strings(node: ast.AST) -> list[str]:
    """The string constants that are direct members of a collection literal."""
    if isinstance(node, ast.Dict):
        members = [k for k in node.keys if k is not None] + list(node.values)
    elif isinstance(node, (ast.Set, ast.List, ast.Tuple)):
        members = list(node.elts)
    else:
        return []
    return [m.value for m in members if isinstance(m, ast.Constant) and isinstance(m.value, str)]


def stray_declarations(path: Path) -> list[str]:
    """``file:line: Enum values`` for each literal spelling >= 2 values of one enum."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        strings = set(_strings(node)) - GENERIC
        if len(strings) < 2:
            continue
        for enum in ENUMS:
            hits = sorted(strings & {m.value for m in enum})
            if len(hits) >= 2:
                found.append(f"{path}:{node.lineno}: {enum.__name__} {hits}")
                break  # one report per literal
    return found


def _sources() -> list[Path]:
    files = []
    for part in PARTS:
        for path in sorted((ROOT / part).rglob("*.py")):
            if path.name == "vocabulary.py" or "/.venv/" in str(path):
                continue
            files.append(path)
    return files


def test_the_vocabulary_is_declared_once() -> None:
    stray = [line for path in _sources() for line in stray_declarations(path)]
    assert not stray, "vocabulary values redeclared outside faultlens/vocabulary.py " \
        "(use the enum members or a catalog):\n" + "\n".join(stray)


@pytest.mark.parametrize(
    "source, expected",
    [
        ("KINDS = {'gpu_lost', 'ecc_uncorrectable'}\n", 1),
        ("ACTION = {'hang': 'restart_job', 'nan_loss': 'run_diagnostics'}\n", 1),
        ("X = ('none', 'unknown', 'notify')\n", 0),
        ("X = [IncidentKind.GPU_LOST, IncidentKind.HANG]\n", 0),
        ("X = {'gpu_lost'}\n", 0),
    ],
)
def test_the_check_finds_a_redeclaration(tmp_path: Path, source: str, expected: int) -> None:
    path = tmp_path / "probe.py"
    path.write_text(source, encoding="utf-8")
    assert len(stray_declarations(path)) == expected
