"""A validation's wall time on the whole dev set at 1 and 2 ranks (each translating its share).

    python benchmarks/validation_ranks.py --checkpoint runs/demo          # make demo's model
    python benchmarks/validation_ranks.py --checkpoint runs/m30k decode.beam=4

For each row, benchmarks/_validate_rank.py runs one validation of the checkpoint as the
training loop does (loss batches, then the dev set translated with the run's decode settings
and scored), under torchrun with W processes of T threads each; rank 0 reports valid/seconds.
Rows are interleaved over --repeats; the table gives medians, and checks that every row gave
the same BLEU (the same hypotheses at every W).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import machine, markdown_table, torchrun

WORKER = str(Path(__file__).with_name("_validate_rank.py"))


def once(checkpoint: str, world: int, threads: int, overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        cmd = torchrun(world) + [WORKER, checkpoint, out, f"train.threads={threads}", *overrides]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
        if proc.returncode != 0:
            sys.exit(f"W={world}: failed\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
        return json.loads(Path(out, "result.json").read_text())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default="runs/demo")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("overrides", nargs="*", help="KEY=VALUE for the run's config (decode.beam=4)")
    args = p.parse_args(argv)
    rows = [(1, 1), (1, 2), (2, 1)]  # (ranks, threads each): one process of 1 and 2 threads
    got: dict[tuple[int, int], list[dict]] = {row: [] for row in rows}
    for r in range(args.repeats):
        for row in rows[r % len(rows) :] + rows[: r % len(rows)]:
            got[row].append(once(args.checkpoint, *row, args.overrides))
    print(f"Machine: {machine()}")
    first = got[rows[0]][0]
    print(f"{first['checkpoint']}: {first['sentences']} dev sentences, {args.repeats} repeats\n")
    base = statistics.median(r["seconds"] for r in got[(1, 1)])
    table = []
    for (world, threads), results in got.items():
        seconds = [r["seconds"] for r in results]
        bleu = {round(r["bleu"], 6) for r in results}
        table.append(
            [
                str(world),
                str(threads),
                f"{statistics.median(seconds):.2f} ({min(seconds):.2f} - {max(seconds):.2f})",
                f"{base / statistics.median(seconds):.2f}x",
                ", ".join(f"{b:.2f}" for b in sorted(bleu)),
            ]
        )
    header = ["ranks", "threads each", "valid/seconds", "speed-up on 1 rank, 1 thread", "BLEU"]
    print(markdown_table(header, table))


if __name__ == "__main__":
    main()
