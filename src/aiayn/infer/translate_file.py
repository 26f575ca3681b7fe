"""Translating a large file: in chunks, shared among ranks, resumable, output in input order.

    aiayn translate --checkpoint RUN --input mono.en --output mono.de          # one process
    torchrun --nproc_per_node=8 -m aiayn translate --checkpoint RUN --input mono.en --output mono.de

The input is cut into chunks of about `chunk_bytes` at line starts; every rank finds the same
cuts by reading a line at each, not the file. Chunk j is rank j mod W's: it reads its chunks'
bytes only, translates them, and writes each one's hypotheses, atomically, to
OUTPUT.parts/NNNNNN.txt. When every chunk is there, rank 0 joins them, in order, into OUTPUT
(written atomically) and removes the parts. Killed and run again with the same command, a
translation skips the chunks already written: what is lost is at most one chunk per rank. The
parts record what they were made from (OUTPUT.parts/plan.json: the input's size and
modification time, the checkpoint, the settings); parts from another input or other settings
are refused rather than mixed in. An n-best list numbers its sentences (`INDEX ||| TEXT |||
SCORE`): a chunk numbers its own from 0, since it does not know how many lines the chunks
before it hold, and rank 0 renumbers each part as it joins them, counting the sentences of
the parts before. A part holds whole sentences, so a resume never splits a sentence's lines.

Back-translation (a large monolingual file through a reverse model) is what this is for
(docs/cli.md); a gzip input cannot be cut, so each rank reads it whole and keeps its chunks.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from aiayn.errors import DataError
from aiayn.runtime.durable import fsync_path, write_atomic

log = logging.getLogger(__name__)

PLAN = "plan.json"

Renumber = Callable[[list[str], int], tuple[list[str], int]]
"""A part's lines, numbering its sentences from 0, and the sentences of the parts before it ->
the lines numbered from there, and how many sentences they hold."""


def chunk_starts(path: Path, chunk_bytes: int) -> list[int]:
    """Byte offsets of the chunks' first lines (the file's size last): the line start at or
    after each multiple of chunk_bytes. One seek and one line read per cut."""
    size = path.stat().st_size
    starts = [0]
    with open(path, "rb") as fh:
        for at in range(chunk_bytes, size, chunk_bytes):
            fh.seek(at - 1)
            fh.readline()  # to the end of the line holding byte at - 1: the next starts a line
            here = fh.tell()
            if here < size and here > starts[-1]:
                starts.append(here)
    return [*dict.fromkeys(starts), size]


def _lines(path: Path, start: int, end: int) -> list[str]:
    with open(path, "rb") as fh:
        fh.seek(start)
        data = fh.read(end - start)
    try:
        lines = data.decode("utf-8").split("\n")  # one hypothesis per input line: \n only
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path} is not UTF-8 (bytes {start + exc.start}-{start + exc.end}): "
            "convert it to UTF-8 first"
        ) from None
    if lines[-1] == "":  # the file's (or the chunk's) final newline
        lines.pop()
    return lines


def translate_file(
    translate: Callable[[list[str], int], list[str]],
    source: Path,
    output: Path,
    settings: dict,
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], None] = lambda: None,
    chunk_bytes: int = 1 << 20,
    gather: Callable[[object], list] = lambda mine: [mine],
    renumber: Renumber | None = None,
) -> None:
    """Translate `source` into `output` with `translate` (a chunk's lines and its number ->
    their output lines: the number and a line's place in the chunk seed its samples), this
    rank taking chunks rank, rank + W, ...; every rank calls it. `settings` (the checkpoint and
    overrides) go into the plan that resumed parts must match. `barrier` and `gather` (every
    rank's value, in rank order) are the group's; rank 0 logs each rank's lines and speed.
    `renumber`, where the output lines number their sentences from 0 in each chunk (n-best
    lists), numbers them across the file as rank 0 joins the parts."""
    parts = output.with_name(output.name + ".parts")
    # A file smaller than 16 chunks is cut into 16, so that a few ranks all get work; the cut
    # depends on the file alone, so that a translation resumes on another world size.
    chunk_bytes = min(chunk_bytes, max(source.stat().st_size // 16, 4096))
    if source.suffix == ".gz":
        chunks = _gzip_chunks(source)
    else:
        starts = chunk_starts(source, chunk_bytes)
        chunks = list(zip(starts, starts[1:], strict=False))
    stat = source.stat()
    plan = {
        "input": str(source.resolve()),
        "bytes": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "chunks": len(chunks),
        "chunk_bytes": chunk_bytes,
        **settings,
    }
    if rank == 0:
        _start_or_check(parts, plan)
    barrier()
    if rank != 0 and json.loads((parts / PLAN).read_text()) != plan:
        raise DataError(f"{parts / PLAN} is not this translation's: the ranks differ")
    mine = range(rank, len(chunks), world_size)
    done = sum((parts / f"{j:06d}.txt").is_file() for j in mine)
    if done:
        log.info("rank %d: %d of its %d chunks already translated: skipped", rank, done, len(mine))
    started, lines_done = time.perf_counter(), 0
    for j in mine:
        part = parts / f"{j:06d}.txt"
        if part.is_file():
            continue
        lines = chunks[j]() if callable(chunks[j]) else _lines(source, *chunks[j])
        hyps = translate(lines, j)
        write_atomic(part, "".join(h + "\n" for h in hyps))
        lines_done += len(lines)
    seconds = time.perf_counter() - started
    ranks = gather((lines_done, seconds))  # on rank 0: the group's figures, for its log
    if rank == 0 and sum(n for n, _ in ranks):
        slowest = max(s for _, s in ranks)
        log.info(
            "translated %d lines on %d rank(s) in %.1f s (%.1f lines/s); per rank: %s",
            sum(n for n, _ in ranks),
            world_size,
            slowest,
            sum(n for n, _ in ranks) / slowest,
            ", ".join(f"rank {r}: {n} lines in {s:.1f} s" for r, (n, s) in enumerate(ranks)),
        )
    barrier()
    if rank == 0:
        _join(parts, len(chunks), output, renumber)
    barrier()


def _gzip_chunks(source: Path, lines_per_chunk: int = 10_000) -> list[Callable[[], list[str]]]:
    """A gzip file cannot be cut: every rank reads it, keeping its chunks' lines."""
    with gzip.open(source, "rt", encoding="utf-8", newline="\n") as fh:
        lines = fh.read().split("\n")
    if lines[-1] == "":
        lines.pop()
    return [
        (lambda a=a: lines[a : a + lines_per_chunk])
        for a in range(0, max(len(lines), 1), lines_per_chunk)
    ]


def _start_or_check(parts: Path, plan: dict) -> None:
    if parts.is_dir():
        try:
            before = json.loads((parts / PLAN).read_text())
        except (OSError, ValueError):
            before = None
        if before != plan:
            raise DataError(
                f"{parts} holds parts of another translation (another input, checkpoint or "
                f"settings than this one): remove it to start over, or run the command that "
                "made it to finish that one"
            )
        return
    parts.mkdir(parents=True)
    write_atomic(parts / PLAN, json.dumps(plan, indent=1))


def _join(parts: Path, n: int, output: Path, renumber: Renumber | None = None) -> None:
    tmp = output.with_name(f".{output.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as out:
        before = 0  # sentences in the parts joined so far
        for j in range(n):
            part = parts / f"{j:06d}.txt"
            if renumber is None:
                with open(part, "rb") as fh:
                    shutil.copyfileobj(fh, out)
                continue
            lines = part.read_bytes().decode("utf-8").split("\n")[:-1]  # \n only, as written
            lines, held = renumber(lines, before)
            out.write("".join(line + "\n" for line in lines).encode("utf-8"))
            before += held
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, output)
    fsync_path(output.parent)
    shutil.rmtree(parts)
