"""The convention every `aiayn` subcommand follows, in one place so that none can drift:

- a description for users, two or three examples, and every default shown in `--help`;
- what a command works on (a checkpoint, a run, a model) as a positional argument or as an
  option (`aiayn export runs/demo` and `aiayn export --checkpoint runs/demo` are one command);
- `--output` for what it writes, with `--out` as an alias;
- `--json` where it reports numbers;
- `section.key=value` overrides anywhere on the line, with examples that fit the command.

tests/unit/test_cli.py walks the parser and checks each of these on every subcommand."""

from __future__ import annotations

import argparse
import re

# `section.key=value` (or `key=value`, which the config answers with a suggestion): what an
# unparsed word must look like to be taken as an override.
OVERRIDE = re.compile(r"^[A-Za-z_][\w-]*(\.[\w-]+)*=")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each option's help; descriptions and examples kept as written.
    An empty default (None, False, []) is not shown: the help says what happens without the
    option ("default: stdin") where that is not plain."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default == []:
            return action.help or ""
        return super()._get_help_string(action)


def command(sub, name: str, summary: str, description: str, examples: list[str]):
    """A subcommand's parser: `summary` in the list of commands, `description` and the
    examples (whole command lines, each parsed by the tests) in its own --help."""
    epilog = "examples:\n" + "\n".join(f"  {line}" for line in examples)
    p = sub.add_parser(
        name,
        help=summary,
        description=description,
        epilog=epilog,
        formatter_class=HelpFormatter,
    )
    p.set_defaults(_parser=p, _either=[], _examples=examples)
    return p


def group(sub, name: str, summary: str, dest: str):
    """A command of subcommands (`aiayn tokenizer train`, `aiayn data prepare`)."""
    p = sub.add_parser(name, help=summary, description=summary, formatter_class=HelpFormatter)
    return p.add_subparsers(dest=dest, required=True, metavar="COMMAND")


def add_config(p: argparse.ArgumentParser, examples: str) -> None:
    """--config and the overrides; `examples`: overrides that make sense for this command."""
    p.add_argument("--config", required=True, help="YAML run config (configs/*.yaml)")
    add_overrides(p, f"config overrides, section.key=value, e.g. {examples}")


def add_overrides(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("overrides", nargs="*", metavar="section.key=value", default=[], help=help)


def add_either(
    p: argparse.ArgumentParser, dest: str, metavar: str, help: str, many: bool = False
) -> None:
    """What the command works on, as a positional argument or as --DEST (repeatable where
    `many`); `finish_args` takes whichever was given and refuses both or neither."""
    p.add_argument(
        f"{dest}_arg", metavar=metavar, nargs="*" if many else "?", default=None, help=help
    )
    p.add_argument(
        f"--{dest}",
        dest=dest,
        metavar=metavar,
        action="append" if many else "store",
        default=None,
        help=f"the same as {metavar}, as an option" + (" (repeatable)" if many else ""),
    )
    p.get_default("_either").append((dest, metavar, many))


def add_output(p: argparse.ArgumentParser, help: str, required: bool = False) -> None:
    p.add_argument("--output", "--out", dest="output", required=required, help=help)


def add_json(p: argparse.ArgumentParser, note: str | None = None) -> None:
    """--json; `note` where the command prints JSON without it."""
    help = "print the result as JSON" + (f" ({note})" if note else "")
    p.add_argument("--json", action="store_true", help=help)


def add_checkpoint(p: argparse.ArgumentParser, overrides_example: str, many: bool = False) -> None:
    """The checkpoint and how to run it: translate, evaluate, generate; several (`many`) are
    an ensemble."""
    add_either(
        p,
        "checkpoint",
        "CHECKPOINT",
        "a run_dir (its latest checkpoint), a step or averaged dir, an exported .safetensors, "
        "or with --engine ctranslate2 a CTranslate2 export directory"
        + ("; several, or a glob: an ensemble (docs/serving.md)" if many else ""),
        many=many,
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where the model runs (auto: CUDA when visible)",
    )
    p.add_argument(
        "--engine",
        default="torch",
        choices=["torch", "ctranslate2"],
        help="ctranslate2: run a `aiayn export --format ctranslate2` directory (the "
        "project's [serve] extra); greedy output is the same, but its beam search divides "
        "log P by len^alpha, not GNMT's ((5 + len) / 6)^alpha",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="ctranslate2: CPU threads per batch (default: every core this process may use)",
    )
    add_overrides(p, f"overrides of the checkpoint's config, e.g. {overrides_example}")


def finish_args(args: argparse.Namespace, extra: list[str]) -> argparse.Namespace:
    """Settle what argparse leaves open: the positional-or-option arguments, and overrides
    argparse could not place (one given after an option that follows a positional)."""
    parser = args._parser
    overrides = getattr(args, "overrides", None)
    for word in extra:
        if overrides is None or not OVERRIDE.match(word):
            parser.error(f"unrecognized argument: {word}")
        overrides.append(word)
    for dest, metavar, many in args._either:
        given, option = getattr(args, f"{dest}_arg"), getattr(args, dest)
        if many:
            given = list(given or [])
            if overrides is not None:  # "*" then "*": the first positional took the overrides
                overrides[:0] = [w for w in given if OVERRIDE.match(w)]
                given = [w for w in given if not OVERRIDE.match(w)]
            value = given + list(option or [])
        else:
            if given is not None and option is not None:
                if overrides is not None and OVERRIDE.match(given):
                    # argparse gave the first override to the empty positional slot
                    overrides.insert(0, given)
                    given = None
                else:
                    parser.error(f"{metavar} given twice ({given} and --{dest} {option}): give one")
            value = option if option is not None else given
        if not value:
            parser.error(f"give {metavar}: as an argument or as --{dest}")
        setattr(args, dest, value)
    return args


def print_result(result: dict, width: int) -> None:
    """One `key: value` line each, keys right-aligned to `width`, floats to 4 decimals."""
    for key, value in result.items():
        shown = f"{value:.4f}" if isinstance(value, float) else value
        print(f"{key:>{width}}: {shown}")
