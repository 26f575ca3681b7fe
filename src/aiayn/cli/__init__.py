"""`aiayn` subcommands. Thin: each parses its arguments and calls one function.

One module per group of commands, each with `add_parsers(sub)` and its `COMMANDS`:
training.py (train, tokenizer, data, params, demo-data), inference.py (translate, evaluate,
score, generate), checkpoints.py (average, finish, export, import-hf), config_commands.py
(config show|check), completion.py (shell completion); common.py holds the convention they
all follow (tests/unit/test_cli.py checks it on every subcommand).

Exit codes (docs/cli.md): 0 done; 2 a person must act (a usage error, or an AiaynError: the
message says what to change), printed as `aiayn CMD: error: ...` without a traceback; 1 a
failure that is not the user's (a traceback: a bug, or a fault a launcher may restart); 75
a preempted `train` that asks to be requeued (distributed/preemption.py); 141 the reader of
stdout went away (a closed pipe)."""

from __future__ import annotations

import argparse
import os
import sys

import aiayn
from aiayn.cli import checkpoints, completion, config_commands, inference, training
from aiayn.cli.common import HelpFormatter, finish_args
from aiayn.distributed.parent_death import end_with_launcher
from aiayn.errors import AiaynError, ConfigError
from aiayn.runtime import startup

PIPE_CLOSED = 141  # 128 + SIGPIPE: what a tool the signal ended would report

GROUPS = (training, inference, checkpoints, config_commands, completion)
COMMANDS = {name: fn for group in GROUPS for name, fn in group.COMMANDS.items()}

DESCRIPTION = """\
Train, evaluate and serve the Transformer of "Attention Is All You Need".
Each command's --help has examples; docs/cli.md lists them all.

  aiayn demo-data numbers --output data/demo/numbers
  aiayn train --config configs/demo.yaml train.max_steps=200
  echo 'forty-two thousand one' | aiayn translate runs/demo

Exit codes: 0 done, 2 something to fix (the message says what), 1 a failure with a
traceback (a bug, or a fault a launcher may restart)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiayn", description=DESCRIPTION, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"aiayn {aiayn.__version__}",
        help="print the version and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in GROUPS:
        group.add_parsers(sub)
    parser.set_defaults(_root=parser)
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, settled: positional-or-option arguments and overrides in place."""
    args, extra = build_parser().parse_known_args(argv)
    return finish_args(args, extra)


def main(argv: list[str] | None = None) -> int:
    startup.mark_main()  # the end of the interpreter's start (the start-up line of `train`)
    end_with_launcher()  # under torchrun: this worker ends when its launcher dies
    args = parse(argv)
    try:
        return COMMANDS[args.command](args) or 0
    except AiaynError as exc:
        # A config error is every rank's alike: under a launcher, rank 0 says it.
        if not isinstance(exc, ConfigError) or os.environ.get("RANK", "0") == "0":
            print(f"aiayn {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        # The reader went away (`aiayn config show | head`): nothing to report. Python would
        # fail again flushing stdout at exit; point it at /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return PIPE_CLOSED
