"""collectors.unparsed.read_byte_lines (chunked) gives what one ``readline`` a line gave, long lines cut the same."""

from __future__ import annotations

import io
import random

from faultlens.collectors.unparsed import read_byte_lines


def _by_readline(data: bytes, max_bytes: int) -> list[bytes]:
    """The reference: the former readline loop."""
    fh = io.BufferedReader(io.BytesIO(data))
    out = []
    while True:
        raw = fh.readline(max_bytes + 1)
        if not raw:
            return out
        if len(raw) > max_bytes and not raw.endswith(b"\n"):
            while True:
                more = fh.readline(max_bytes)
                if not more or more.endswith(b"\n"):
                    break
        out.append(raw[:-1] if raw.endswith(b"\n") else raw)


def test_chunked_lines_equal_readline_lines_on_random_input() -> None:
    rng = random.Random(36)
    for _ in range(400):
        parts = [bytes(rng.choice(b"ab\n") for _ in range(rng.choice((0, 1, 3, 9, 17, 40)))) for _ in range(rng.randint(0, 6))]
        data = b"".join(parts)
        max_bytes, chunk = rng.choice((4, 8, 16)), rng.choice((1, 2, 3, 5, 7, 64))
        got = list(read_byte_lines(io.BufferedReader(io.BytesIO(data)), max_bytes=max_bytes, chunk_bytes=chunk))
        assert got == _by_readline(data, max_bytes), (data, max_bytes, chunk)


def test_a_long_line_is_cut_and_the_next_line_kept() -> None:
    data = b"x" * 50 + b"\nok\n" + b"y" * 30
    got = list(read_byte_lines(io.BytesIO(data), max_bytes=10, chunk_bytes=4))
    assert got == [b"x" * 11, b"ok", b"y" * 11]
