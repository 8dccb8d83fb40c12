"""argparse types for numbers that must make sense: ``--nodes 0`` or ``--duration -5`` is an
argparse error naming the option, before anything is built or written (no traceback, no
partial output directory)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer >= 1 (nodes, GPUs, scenarios)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive whole number (1 or more)")
    return value


def _finite_float(text: str, *, allow_zero: bool, wanted: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value >= 0 if allow_zero else value > 0) or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not {wanted}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (durations, speeds)."""
    return _finite_float(text, allow_zero=False, wanted="a positive number of seconds (more than 0)")


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (onsets, offsets)."""
    return _finite_float(text, allow_zero=True, wanted="a number of seconds (0 or more)")


__all__ = ["positive_int", "positive_float", "non_negative_float"]
