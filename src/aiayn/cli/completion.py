"""`aiayn completion bash|zsh`: a completion script written from the parser itself, so that
every command, option and choice the parser has is completed, and nothing else.

The script holds three tables keyed by the command path ("", "tokenizer", "tokenizer train"):
the words after it (subcommands, options, a positional's choices), the subcommands alone (to
follow the path along the line), and each option's choices. An option that takes a value
without choices (a path) completes nothing itself, so the shell's file completion answers
(`complete -o default`). zsh runs the same function through its bashcompinit."""

from __future__ import annotations

import argparse

from aiayn.cli.common import command

HEADER = {
    "bash": '# aiayn bash completion: eval "$(aiayn completion bash)" in ~/.bashrc\n',
    "zsh": (
        "#compdef aiayn\n"
        '# aiayn zsh completion: eval "$(aiayn completion zsh)" in ~/.zshrc\n'
        "autoload -U +X compinit && compinit\n"
        "autoload -U +X bashcompinit && bashcompinit\n"
    ),
}

BODY = r"""
_aiayn() {
  local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}" path="" i w
  for ((i = 1; i < COMP_CWORD; i++)); do
    w="${COMP_WORDS[i]}"
    if [[ " $(_aiayn_subcommands "$path") " == *" $w "* ]]; then path="${path:+$path }$w"; fi
  done
  local choices
  choices="$(_aiayn_choices "$path $prev")"
  if [[ -n "$choices" ]]; then
    COMPREPLY=($(compgen -W "$choices" -- "$cur"))
  elif [[ " $(_aiayn_valued "$path") " == *" $prev "* ]]; then
    COMPREPLY=()  # a value without choices: the shell completes a file name
  else
    COMPREPLY=($(compgen -W "$(_aiayn_words "$path")" -- "$cur"))
  fi
}
complete -o default -F _aiayn aiayn
"""


def add_parsers(sub) -> None:
    p = command(
        sub,
        "completion",
        "print a shell completion script",
        "Print a completion script for bash or zsh, written from this parser. Load it at\n"
        "each start of the shell with the line below in ~/.bashrc (or ~/.zshrc).",
        [
            'eval "$(aiayn completion bash)"',
            "aiayn completion zsh > ~/.zsh/completions/_aiayn",
        ],
    )
    p.add_argument("shell", choices=["bash", "zsh"], help="the shell")


def commands(parser: argparse.ArgumentParser, path: str = ""):
    """(path, parser) for the top-level parser and every subcommand's, depth first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from commands(child, f"{path} {name}".strip())


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    words, subs, valued, choices = {}, {}, {}, {}
    for path, p in commands(parser):
        here, below, takes = [], [], []
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                below += list(action.choices)
            elif action.option_strings:
                here += action.option_strings
                if action.nargs != 0:
                    takes += action.option_strings
                    if action.choices:
                        for flag in action.option_strings:
                            choices[f"{path} {flag}"] = [str(c) for c in action.choices]
            elif action.choices:  # a positional with choices (demo-data's kind)
                here += [str(c) for c in action.choices]
        words[path], subs[path], valued[path] = below + here, below, takes
    return (
        HEADER[shell]
        + _table("_aiayn_words", words)
        + _table("_aiayn_subcommands", subs)
        + _table("_aiayn_valued", valued)
        + _table("_aiayn_choices", choices)
        + BODY
    )


def _table(name: str, table: dict[str, list[str]]) -> str:
    """A shell function printing the words of its argument's row."""
    rows = "".join(f'    "{key}") echo "{" ".join(row)}" ;;\n' for key, row in table.items() if row)
    return f'{name}() {{\n  case "$1" in\n{rows}  esac\n}}\n'


def cmd_completion(args) -> int:
    print(script(args._root, args.shell), end="")
    return 0


COMMANDS = {"completion": cmd_completion}
