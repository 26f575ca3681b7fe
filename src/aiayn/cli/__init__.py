"""`aiayn` subcommands. Thin: each parses its arguments and calls one function.

One module per group of commands, each with `add_parsers(sub)` and its `COMMANDS`:
training.py (train, tokenizer, data, params, demo-data), inference.py (translate, evaluate,
score, generate), checkpoints.py (average, finish, export, import-hf); common.py holds the
arguments they share."""

from __future__ import annotations

import argparse
import sys

from aiayn.cli import checkpoints, inference, training
from aiayn.distributed.parent_death import end_with_launcher
from aiayn.errors import AiaynError
from aiayn.runtime import startup

GROUPS = (training, inference, checkpoints)
COMMANDS = {name: fn for group in GROUPS for name, fn in group.COMMANDS.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiayn",
        description="`aiayn` subcommands. Thin: each parses its arguments and calls one function.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    startup.mark_main()  # the end of the interpreter's start (the start-up line of `train`)
    end_with_launcher()  # under torchrun: this worker ends when its launcher dies
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args) or 0
    except AiaynError as exc:
        print(f"aiayn {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
