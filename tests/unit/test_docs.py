"""The README and docs/ stay true: the configuration reference is the schema's, every command
shown parses, every link resolves.

Commands are taken from the fenced shell blocks of README.md and docs/*.md. None is run: an
`aiayn` command goes through `aiayn.cli.parse()` (and, with a `--config` in configs/,
its overrides through `load_config`), `make X` must be a target of the Makefile, torchrun and
`accelerate launch` go through their own parsers and then the command they wrap, a script
(`python launch/X.py`, `python benchmarks/X.py`, `launch/*.sh`, `slurm/*`) must exist and,
for Python scripts, every `--flag` used must be one its argparse declares (read with `ast`).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib.util
import io
import re
import shlex
import sys
from functools import cache
from pathlib import Path

import pytest

from aiayn.errors import AiaynError

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
SEPARATORS = {"|", "||", "&&", ";", "&"}
REDIRECTS = {"<", ">", ">>", "2>", "2>&1"}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ---- the configuration reference ----------------------------------------------------------


@cache
def _generator():
    spec = importlib.util.spec_from_file_location(
        "gen_config_reference", ROOT / "docs" / "gen_config_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_every_config_field_has_a_docstring():
    missing = _generator().missing()
    assert not missing, (
        "config fields without a docstring (write the string literal right after the field "
        f"in its class): {missing}"
    )


@dataclasses.dataclass
class _Sample:
    documented: int = 1
    """The text."""
    undocumented: str = "x"


def test_field_docs_reads_the_string_after_each_field():
    docs = _generator().field_docs(_Sample)
    assert docs == {"documented": ("int", "The text."), "undocumented": ("str", None)}


def test_configuration_reference_is_up_to_date():
    gen = _generator()
    assert gen.OUTPUT.read_text() == gen.render(), (
        "docs/configuration.md is out of date: run python docs/gen_config_reference.py"
    )


# ---- commands ------------------------------------------------------------------------------


def _fenced_blocks(text: str):
    """(language, first line number, body) of each fenced code block."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^\s*(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2).lower(), i + 1
        i += 1
        body = []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1
        yield lang, start + 1, body


def _commands(body: list[str]):
    """(line offset, command text) with backslash continuations joined."""
    joined, first = "", None
    for n, line in enumerate(body):
        if first is None:
            first = n
        if line.rstrip().endswith("\\"):
            joined += line.rstrip()[:-1] + " "
            continue
        joined += line
        if joined.strip():
            yield first, joined.strip()
        joined, first = "", None
    if joined.strip():
        yield first, joined.strip()


def _segments(command: str) -> list[list[str]]:
    """The simple commands of a pipeline or list, without redirections and env assignments."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    tokens = list(lexer)
    out, current, skip = [], [], False
    for tok in tokens:
        if skip:
            skip = False
            continue
        if tok in SEPARATORS:
            out.append(current)
            current = []
        elif tok in REDIRECTS or tok in {">&", "<&"}:
            skip = True
        else:
            current.append(tok)
    out.append(current)
    cleaned = []
    for seg in out:
        while seg and re.match(r"^[A-Z_][A-Z0-9_]*=", seg[0]):
            seg = seg[1:]
        if seg:
            cleaned.append(seg)
    return cleaned


CHECKED = ("aiayn", "make", "torchrun", "accelerate", "sbatch", "python", "launch/", "slurm/")


def _is_checked(seg: list[str]) -> bool:
    head = seg[0]
    if head == "python":
        return len(seg) > 1 and (
            seg[1:3] in (["-m", "aiayn"], ["-m", "aiayn.distributed.run"])
            or seg[1].startswith(("launch/", "benchmarks/"))
        )
    if head == "accelerate":
        return seg[1:2] == ["launch"]
    return head in {"aiayn", "make", "torchrun", "sbatch"} or head.startswith(("launch/", "slurm/"))


def _doc_commands():
    found = []
    for path in DOCS:
        for lang, start, body in _fenced_blocks(path.read_text()):
            if lang not in SHELL_LANGS:
                continue
            for offset, command in _commands(body):
                try:
                    segments = _segments(command)
                except ValueError:
                    continue  # not shell (sample output)
                for seg in segments:
                    if seg[0] == ".venv/bin/aiayn":  # the README's way without activating
                        seg = ["aiayn", *seg[1:]]
                    if _is_checked(seg):
                        found.append((f"{_rel(path)}:{start + offset}", seg))
    return found


@cache
def _makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M)}


@cache
def _script_flags(path: Path) -> set[str]:
    """Option strings the script's argparse declares (add_argument calls, read with ast)."""
    flags = {"-h", "--help"}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    flags.add(arg.value)
    return flags


def _check_aiayn(argv: list[str]) -> None:
    from aiayn.cli import parse  # what main() parses with: overrides anywhere on the line

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = parse(argv)
    except SystemExit as exc:
        if argv[-1:] in (["--help"], ["--version"]) and exc.code == 0:
            return
        raise AssertionError(f"aiayn {' '.join(argv)}: {err.getvalue().strip()}") from None
    config = getattr(args, "config", None)
    if config is not None:
        assert (ROOT / config).is_file(), f"--config {config} does not exist"
        _check_config(config, args.overrides)


def _check_config(config: str, overrides: list[str]) -> None:
    from aiayn.config import load_config

    load_config(ROOT / config, list(overrides))  # unknown keys and bad values raise


def _check_script(argv: list[str]) -> None:
    script = ROOT / argv[0]
    assert script.is_file(), f"{argv[0]} does not exist"
    if script.suffix == ".py":
        known = _script_flags(script)
        for arg in argv[1:]:
            if arg.startswith("-"):
                flag = arg.split("=", 1)[0]
                assert flag in known, f"{argv[0]} has no option {flag} (it has {sorted(known)})"
    elif script.suffix in {".sh", ".sbatch"}:
        # launch/*.sh and slurm/train.sbatch take CONFIG [key=value ...]; accelerate.sh takes
        # the accelerate config first.
        rest = argv[1:]
        if script.name == "accelerate.sh":
            assert (ROOT / rest[0]).is_file(), f"{rest[0]} does not exist"
            rest = rest[1:]
        if script.name == "chain.sh":
            _check_sbatch(rest[1:])
            return
        config, overrides = rest[0], rest[1:]
        assert (ROOT / config).is_file(), f"{config} does not exist"
        _check_config(config, overrides)


def _check_wrapped(module: bool, script: str, args: list[str]) -> None:
    if module:
        assert script == "aiayn", f"-m {script}: expected -m aiayn"
        _check_aiayn(args)
    else:
        _check_script([script, *args])


def _check_sbatch(argv: list[str]) -> None:
    """sbatch [options] SCRIPT [args]: the first argument that names a file is the script."""
    for i, arg in enumerate(argv):
        if not arg.startswith("-") and (ROOT / arg).is_file():
            _check_script(argv[i:])
            return
    raise AssertionError(f"no batch script in sbatch {' '.join(argv)}")


def _check_torchrun(argv: list[str]) -> None:
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(argv)
    _check_wrapped(args.module, args.training_script, args.training_script_args)


def _check(seg: list[str]) -> None:
    head = seg[0]
    if head == "aiayn":
        _check_aiayn(seg[1:])
    elif head == "python" and seg[1:3] == ["-m", "aiayn"]:
        _check_aiayn(seg[3:])
    elif head == "python" and seg[1:3] == ["-m", "aiayn.distributed.run"]:
        _check_torchrun(seg[3:])  # torchrun's options and command
    elif head == "python":
        _check_script(seg[1:])
    elif head == "make":
        for target in (t for t in seg[1:] if "=" not in t and not t.startswith("-")):
            assert target in _makefile_targets(), f"make {target}: no such target in the Makefile"
    elif head == "torchrun":
        _check_torchrun(seg[1:])
    elif head == "accelerate":
        from accelerate.commands.launch import launch_command_parser

        args = launch_command_parser().parse_args(seg[2:])
        if args.config_file:
            assert (ROOT / args.config_file).is_file(), f"{args.config_file} does not exist"
        _check_wrapped(args.module, args.training_script, args.training_script_args)
    elif head == "sbatch":
        _check_sbatch(seg[1:])
    else:  # launch/*.sh, slurm/*
        _check_script(seg)


COMMANDS = _doc_commands()


def test_docs_show_commands():
    heads = {seg[0] for _, seg in COMMANDS}
    assert {"aiayn", "make", "torchrun", "accelerate", "sbatch", "python"} <= heads


@pytest.mark.parametrize("where,seg", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_command_parses(where, seg):
    try:
        _check(seg)
    except SystemExit as exc:  # a launcher's parser refused it
        raise AssertionError(f"{where}: {shlex.join(seg)}: exit {exc.code}") from None
    except AssertionError as exc:
        raise AssertionError(f"{where}: {shlex.join(seg)}: {exc}") from None
    except AiaynError as exc:  # load_config refused the overrides
        raise AssertionError(f"{where}: {shlex.join(seg)}: {exc}") from None


# ---- links ---------------------------------------------------------------------------------


def _prose(text: str, keep_code: bool = False) -> str:
    """The text outside fenced code blocks; inline code dropped, or kept without its backticks."""
    out, fence = [], None
    for line in text.splitlines():
        m = re.match(r"^\s*(```+|~~~+)", line)
        if fence is None and m:
            fence = m.group(1)
            continue
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
            continue
        out.append(line.replace("`", "") if keep_code else re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose(path.read_text(), keep_code=True).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = github_slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links():
    for path in DOCS:
        for m in re.finditer(
            r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", _prose(path.read_text())
        ):
            yield path, m.group(1)


LINKS = list(_links())


@pytest.mark.parametrize("path,target", LINKS, ids=[f"{_rel(p)}->{t}" for p, t in LINKS])
def test_link_resolves(path, target):
    if re.match(r"^[a-z]+:", target):
        return  # http(s), mailto: not checked offline
    file, _, anchor = target.partition("#")
    dest = (path.parent / file).resolve() if file else path
    assert dest.exists(), f"{_rel(path)}: {target}: {file} does not exist"
    if anchor:
        assert dest.suffix == ".md", f"{_rel(path)}: {target}: an anchor into a non-markdown file"
        assert anchor in _anchors(dest), (
            f"{_rel(path)}: {target}: no heading with the anchor #{anchor} in {_rel(dest)} "
            f"(it has {sorted(_anchors(dest))})"
        )


def test_slugs_match_github():
    assert github_slug("Multi30k de-en") == "multi30k-de-en"
    assert github_slug("serving.py: aiayn translate against CTranslate2") == (
        "servingpy-aiayn-translate-against-ctranslate2"
    )
    assert github_slug("DeepSpeed's compiled ops") == "deepspeeds-compiled-ops"
    assert github_slug("train.precision") == "trainprecision"
