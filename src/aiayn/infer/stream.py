"""Translating a stream as it comes: `aiayn translate` reading a pipe or a terminal.

Each hypothesis is written and flushed as soon as its batch is decoded, so the command serves
a pipe that waits for each answer before it sends the next line (an interactive session, a
process that feeds it sentence by sentence). The lines already readable when a batch starts
are decoded together, up to decode.batch_size: a file or a full pipe is still translated in
whole batches, a line typed alone is not kept waiting for others."""

from __future__ import annotations

import os
import select
from collections.abc import Callable, Iterator
from typing import BinaryIO, TextIO

READ_BYTES = 1 << 16


def available_batches(source: BinaryIO, max_lines: int) -> Iterator[list[str]]:
    """Lists of at most `max_lines` lines (without their line break): each waits for one whole
    line, then takes those that can be read without waiting. The last line needs no break."""
    fd = source.fileno()
    buf, eof = b"", False
    while buf or not eof:
        while b"\n" not in buf and not eof:  # wait for one line
            chunk = os.read(fd, READ_BYTES)
            buf, eof = buf + chunk, not chunk
        # Then what is ready now, no more than a batch holds (a file is always ready).
        while not eof and buf.count(b"\n") < max_lines and select.select([fd], [], [], 0)[0]:
            chunk = os.read(fd, READ_BYTES)
            buf, eof = buf + chunk, not chunk
        lines = buf.split(b"\n")
        buf = lines.pop()  # a line not yet ended
        if eof and buf:
            lines, buf = [*lines, buf], b""
        for i in range(0, len(lines), max_lines):
            yield [_text(line) for line in lines[i : i + max_lines]]


def _text(line: bytes) -> str:
    return line.decode("utf-8").removesuffix("\r")


def translate_stream(
    source: BinaryIO,
    out: TextIO,
    translate: Callable[[list[str]], list[str]],
    batch_size: int,
) -> int:
    """Translate `source` line by line into `out`, flushed after every line; the line count."""
    n = 0
    for lines in available_batches(source, batch_size):
        for hyp in translate(lines):
            out.write(hyp + "\n")
            out.flush()
            n += 1
    return n
