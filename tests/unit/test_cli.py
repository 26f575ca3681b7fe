"""The `aiayn` command line: one convention on every subcommand, read from the parser itself
(so a new command that breaks it fails here), the config commands, shell completion, and the
exit-code policy (docs/cli.md)."""

from __future__ import annotations

import argparse
import json
import re
import select
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from export_models import write_model  # tests/unit/export_models.py

import aiayn
from aiayn.cli import build_parser, main, parse
from aiayn.cli.common import OVERRIDE, HelpFormatter
from aiayn.cli.completion import commands, script
from aiayn.config import load_config

ROOT = Path(__file__).resolve().parents[2]

# Every leaf command, sorted by whether it reports numbers (then it takes --json). A new
# command must be put in one of the two, which is the point.
REPORTS_NUMBERS = {
    "tokenizer train",
    "data prepare",
    "params",
    "evaluate",
    "score",
    "finish",
    "config show",
    "config check",
    "translate",  # --n-best: each hypothesis's score
}
REPORTS_NO_NUMBERS = {
    "train",  # its numbers go to the log, TensorBoard and run_dir
    "data download",
    "demo-data",
    "generate",
    "average",
    "export",
    "import-hf",
    "completion",
}
# The section a command's override examples must name (what its overrides act on).
OVERRIDE_SECTION = {
    "train": "train.",
    "tokenizer train": "tokenizer.",
    "data prepare": "data.",
    "params": "model.",
    "config show": "train.",
    "config check": "train.",
    "translate": "decode.",
    "evaluate": "decode.",
    "generate": "data.lm_order",
}
# Positional arguments that are neither what the command works on nor overrides.
OTHER_POSITIONALS = {("data download", "name")}


def leaves() -> dict[str, argparse.ArgumentParser]:
    """Each runnable command path ("tokenizer train") -> its parser."""
    found = {}
    for path, p in commands(build_parser()):
        if path and not any(isinstance(a, argparse._SubParsersAction) for a in p._actions):
            found[path] = p
    return found


def options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: a for a in p._actions for flag in a.option_strings}


def test_every_command_is_sorted_into_reports_numbers_or_not():
    assert set(leaves()) == REPORTS_NUMBERS | REPORTS_NO_NUMBERS
    assert not REPORTS_NUMBERS & REPORTS_NO_NUMBERS


@pytest.mark.parametrize("path", sorted(REPORTS_NUMBERS | REPORTS_NO_NUMBERS))
def test_every_command_follows_the_convention(path):
    p = leaves()[path]
    # A description for users, examples, defaults shown.
    assert p.formatter_class is HelpFormatter, f"{path}: made without cli.common.command"
    assert p.get_default("_parser") is p
    assert p.description and len(p.description) > 40, path
    help_text = p.format_help()
    examples = p.get_default("_examples")
    assert 2 <= len(examples) <= 3, f"{path}: two or three examples"
    assert "examples:" in help_text
    for action in p._actions:
        assert action.help, f"{path}: {action.dest} has no help"
        shown = action.default not in (None, False, [], argparse.SUPPRESS)
        if shown and action.option_strings:
            assert f"(default: {action.default}" in " ".join(help_text.split()), action.dest
    # What the command works on: as a positional argument and as an option, both.
    flags = options(p)
    for action in p._actions:
        if action.option_strings or action.dest in ("overrides", "help"):
            continue
        if action.dest.endswith("_arg"):
            flag = "--" + action.dest[: -len("_arg")]
            assert flag in flags, f"{path}: {action.metavar} has no {flag}"
        else:
            assert action.choices or (path, action.dest) in OTHER_POSITIONALS, (
                f"{path}: positional {action.dest} has no option form (common.add_either)"
            )
    if "--checkpoint" in flags:
        assert "checkpoint_arg" in {a.dest for a in p._actions}, f"{path}: no positional form"
    # --output everywhere, --out its alias.
    if "--output" in flags or "--out" in flags:
        assert flags.get("--output") is flags.get("--out"), f"{path}: --output and --out"
    # --json where the command reports numbers.
    assert ("--json" in flags) == (path in REPORTS_NUMBERS), path
    # Override examples that fit the command.
    overrides = [a for a in p._actions if a.dest == "overrides"]
    if overrides:
        examples = overrides[0].help.split("e.g. ", 1)[-1].split()
        named = [w for w in examples if OVERRIDE.match(w)]
        assert named and named[0].startswith(OVERRIDE_SECTION[path]), (
            f"{path}: its override examples {named} should start with {OVERRIDE_SECTION[path]}"
        )
        load_config(None, [*named, "data.train=x"])  # known keys, valid values


@pytest.mark.parametrize("path", sorted(REPORTS_NUMBERS | REPORTS_NO_NUMBERS))
def test_every_example_in_the_help_parses_and_its_config_loads(path):
    for line in leaves()[path].get_default("_examples"):
        # the aiayn command of `echo ... | aiayn ...`, `eval "$(aiayn ...)"`, `aiayn ... > F`
        argv = shlex.split(re.search(r"aiayn [^)>|]*", line.split("|")[-1]).group(0))
        args = parse(argv[1:])
        assert args.command == argv[1]
        if getattr(args, "config", None):
            assert (ROOT / args.config).is_file(), f"{line}: no {args.config}"
            load_config(ROOT / args.config, args.overrides)


def test_the_checkpoint_is_taken_as_an_argument_or_an_option_with_overrides_anywhere():
    a = parse(["translate", "runs/demo", "--input", "x", "decode.beam=1"])
    b = parse(["translate", "--checkpoint", "runs/demo", "--input", "x", "decode.beam=1"])
    c = parse(["translate", "decode.beam=1", "--checkpoint", "runs/demo", "--input", "x"])
    for args in (a, b, c):  # translate takes several (an ensemble): a list
        assert (args.checkpoint, args.overrides, args.input) == (
            ["runs/demo"],
            ["decode.beam=1"],
            "x",
        )
    d = parse(["translate", "r1", "r2", "decode.beam=1", "--checkpoint", "r3", "decode.alpha=0"])
    assert (d.checkpoint, d.overrides) == (["r1", "r2", "r3"], ["decode.beam=1", "decode.alpha=0"])
    assert parse(["export", "--checkpoint", "r", "--out", "o"]).checkpoint == "r"
    assert parse(["average", "a", "b", "--checkpoint", "c", "--out", "o"]).checkpoint == [
        "a",
        "b",
        "c",
    ]
    assert parse(["finish", "--checkpoint", "runs/x", "--last", "2"]).checkpoint == "runs/x"
    assert parse(["import-hf", "--model", "m", "--output", "o"]).model == "m"
    assert parse(["demo-data", "lm", "--out", "d"]).output == "d"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["translate"], "give CHECKPOINT: as an argument or as --checkpoint"),
        (["generate", "a", "--checkpoint", "b"], "CHECKPOINT given twice"),
        (["export", "r", "--out", "x", "stray"], "unrecognized argument: stray"),
        (["finish", "--last", "2"], "give RUN"),
    ],
)
def test_a_usage_error_names_the_command_and_exits_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert f"aiayn {argv[0]}: error: {message}" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"aiayn {aiayn.__version__}"


def test_a_key_without_its_section_is_answered_with_the_section(capsys):
    config = str(ROOT / "configs" / "demo.yaml")
    assert main(["params", "--config", config, "max_steps=5"]) == 2
    assert "unknown key max_steps; did you mean train.max_steps?" in capsys.readouterr().err
    assert main(["params", "--config", config, "model.max_steps=5"]) == 2
    assert "did you mean train.max_steps?" in capsys.readouterr().err


def test_params_reports_json(capsys):
    config = str(ROOT / "configs" / "demo.yaml")
    assert main(["params", "--config", config, "--vocab-size", "200", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["N"] == 2 and result["d_model"] == 128 and result["vocab"] == 200
    assert 500_000 < result["parameters"] < 5_000_000


# ---- aiayn config show | check ------------------------------------------------------------


def _corpus(root: Path) -> Path:
    for split in ("train", "valid"):
        for lang in ("en", "de"):
            (root / f"{split}.{lang}").write_text("one\ntwo\n")
    return root


def _config(tmp_path: Path, **train) -> Path:
    corpus = _corpus(tmp_path)
    config = tmp_path / "run.yaml"
    body = {
        "run_dir": str(tmp_path / "run"),
        "model": {"preset": "tiny", "dropout": 0.2},
        "data": {"train": str(corpus / "train"), "valid": str(corpus / "valid")},
        "train": {"max_steps": 7, **train},
    }
    config.write_text(json.dumps(body))  # JSON is YAML
    return config


def test_config_show_says_where_each_value_came_from(tmp_path, capsys):
    config = _config(tmp_path)
    argv = ["config", "show", "--config", str(config), "--json", "train.max_steps=9"]
    assert main(argv) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["train.max_steps"] == {"value": 9, "source": "override"}
    assert shown["model.dropout"] == {"value": 0.2, "source": "file"}
    assert shown["model.d_model"] == {"value": 128, "source": "preset"}
    assert shown["decode.beam"] == {"value": 4, "source": "default"}
    cfg = load_config(config, ["train.max_steps=9"])
    assert {k: v["value"] for k, v in shown.items() if k.startswith("model.")} == {
        f"model.{k}": v for k, v in cfg.to_dict()["model"].items()
    }


def test_config_check_accepts_a_good_config_and_reports_every_problem_of_a_bad_one(
    tmp_path, capsys
):
    config = _config(tmp_path, max_tokens=1000, tokens_per_step=4000)
    assert main(["config", "check", "--config", str(config), "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "x 2 accumulated x 2 ranks per step = 4,000 tokens a step" in out
    assert "a start would accept it" in out
    # Four problems at once: a missing corpus, a tokenizer other than the one the run's
    # checkpoint recorded, an option of another engine, and 5 ranks for 4 micro-batches.
    (tmp_path / "valid.de").unlink()
    tok_path = tmp_path / "run" / "tokenizer" / "spm.model"
    _tokenizer(tok_path)
    step = tmp_path / "run" / "checkpoints" / "step_5"
    step.mkdir(parents=True)
    contract = {"sha256": "0" * 64, "vocab_size": 99}
    (step / "manifest.json").write_text(json.dumps({"tokenizer": contract, "files": {}}))
    argv = ["config", "check", "--config", str(config), "--world-size", "5", "--json"]
    assert main([*argv, "distributed.zero_stage=2"]) == 2
    captured = capsys.readouterr()
    problems = json.loads(captured.out)["problems"]
    assert len(problems) == 4, problems
    assert "valid.de" in problems[0]
    assert "not the one" in problems[1] and "vocab_size: recorded 99" in problems[1]
    assert "distributed.zero_stage need distributed.backend=deepspeed" in problems[2]
    assert "fewer than the 5 ranks: run on at most 4 ranks" in problems[3]
    assert "aiayn config: error: 4 problem(s) a start would stop on" in captured.err


def _tokenizer(path: Path) -> None:
    from aiayn.config import TokenizerConfig
    from aiayn.tokenizer import train_tokenizer

    sents = [f"{a} {b}" for a in ("one", "two", "three", "four") for b in ("five", "six", "ten")]
    train_tokenizer(TokenizerConfig(vocab_size=40), sents * 20, path)


# ---- shell completion -----------------------------------------------------------------------


def _complete(shell_script: str, line: str) -> list[str]:
    """What bash's completion of `line` (up to its end) offers, run in a real bash."""
    words = line.split(" ")
    program = (
        f"{shell_script}\nCOMP_WORDS=({' '.join(shlex.quote(w) for w in words)})\n"
        f"COMP_CWORD={len(words) - 1}\n_aiayn\nprintf '%s\\n' \"${{COMPREPLY[@]}}\""
    )
    out = subprocess.run(["bash", "-c", program], capture_output=True, text=True, check=True)
    return [w for w in out.stdout.split("\n") if w]


def test_bash_completion_offers_commands_options_and_choices_from_the_parser():
    bash = script(build_parser(), "bash")
    assert _complete(bash, "aiayn tr") == ["train", "translate"]
    assert _complete(bash, "aiayn tokenizer ") == ["train", "-h", "--help"]
    assert "--checkpoint" in _complete(bash, "aiayn export --")
    assert _complete(bash, "aiayn translate --device ") == ["auto", "cpu", "cuda"]
    assert _complete(bash, "aiayn data prepare --f") == ["--force"]
    assert _complete(bash, "aiayn demo-data n") == ["numbers"]
    assert _complete(bash, "aiayn export --output ") == []  # the shell's file names then
    assert _complete(bash, "aiayn config ") == ["show", "check", "-h", "--help"]


def test_the_zsh_script_is_the_bash_function_under_bashcompinit(capsys):
    assert main(["completion", "zsh"]) == 0
    zsh = capsys.readouterr().out
    assert zsh.startswith("#compdef aiayn\n") and "bashcompinit" in zsh
    assert "complete -o default -F _aiayn aiayn" in zsh
    assert zsh.split("bashcompinit\n", 2)[-1] == script(build_parser(), "bash").split("\n", 1)[1]


# ---- bugs a user met (issue 56.2): each test failed before its fix -------------------------


@pytest.fixture(scope="module")
def exported(tok, tmp_path_factory) -> Path:
    """A random 2-layer seq2seq model as `aiayn export` writes it."""
    return write_model(tmp_path_factory.mktemp("model"), tok)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of a missing GPU")
def test_evaluate_runs_on_the_device_it_is_given(exported, capsys):
    assert main(["evaluate", str(exported), "--device", "cuda"]) == 2
    assert "--device=cuda but no CUDA device is visible" in capsys.readouterr().err


def test_finish_names_a_missing_run_directory(tmp_path, capsys):
    assert main(["finish", str(tmp_path / "nope"), "--last", "2"]) == 2
    err = capsys.readouterr().err
    assert f"aiayn finish: error: no run directory {tmp_path / 'nope'}" in err
    assert "keep more" not in err


@pytest.mark.parametrize("select", ["--best", "--last"])
def test_finish_on_a_run_without_checkpoints_says_so(tmp_path, capsys, select):
    (tmp_path / "run").mkdir()
    assert main(["finish", str(tmp_path / "run"), select, "2"]) == 2
    assert "has no checkpoints" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, env, message",
    [
        (["demo-data", "lm", "--out", "x", "--n-train", "5"], {}, "are for the numbers corpus"),
        (["translate", "MODEL"], {"WORLD_SIZE": "2"}, "on several ranks shares a file"),
    ],
)
def test_errors_exit_2_through_aiayn_cmd_error(
    exported, tmp_path, monkeypatch, capsys, argv, env, message
):
    """Not SystemExit(message), which exits 1 and reads like a crash (docs/cli.md's policy)."""
    monkeypatch.chdir(tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    argv = [str(exported) if a == "MODEL" else a for a in argv]
    assert main(argv) == 2
    assert f"aiayn {argv[0]}: error: " in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def _read_line(proc: subprocess.Popen, timeout: float) -> str | None:
    """One line of proc's stdout, or None if none came within `timeout` seconds."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline().decode() if ready else None


def test_translate_answers_each_line_of_a_pipe_before_the_next_is_sent(exported):
    """A pipe that waits for each answer (a person at a terminal, a program feeding sentence
    by sentence) gets it: before, translate read stdin to its end first."""
    argv = [sys.executable, "-m", "aiayn", "translate", str(exported), "--device", "cpu"]
    proc = subprocess.Popen(
        [*argv, "decode.beam=1", "decode.max_len_b=3"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        answers = []
        for line in ("dreihundert", "vierzig"):
            proc.stdin.write(f"{line}\n".encode())
            proc.stdin.flush()
            answers.append(_read_line(proc, timeout=120))  # the model loads before the first
            assert answers[-1] is not None, f"no answer to {line!r} while stdin stays open"
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0, proc.stderr.read().decode()
        assert proc.stdout.read() == b""
    finally:
        proc.kill()
        proc.wait()


def test_n_best_lists_go_to_output_as_to_stdout_numbered_across_its_chunks(
    exported, corpus, tmp_path
):
    """--n-best with --input and --output writes the `INDEX ||| TEXT ||| SCORE` lines stdout
    gets (it was refused without --json), INDEX counting the file's lines through its chunks;
    with --json, a JSON line per input line, numbered the same way."""
    lines = (corpus / "train.de").read_text().splitlines()[:120]
    source = tmp_path / "in.txt"
    source.write_text("".join(line + "\n" for line in lines))
    assert source.stat().st_size > 2 * 1024  # several chunks of --chunk-kb 1
    argv = ["translate", str(exported), "--device", "cpu", "--n-best", "2", "--input", str(source)]
    argv += ["--chunk-kb", "1", "decode.beam=2", "decode.max_len_b=3"]
    assert main([*argv, "--output", str(tmp_path / "text")]) == 0
    assert main([*argv, "--output", str(tmp_path / "json"), "--json"]) == 0
    text = (tmp_path / "text").read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in (tmp_path / "json").read_text().splitlines()]
    assert [row["index"] for row in rows] == list(range(len(lines)))
    listed = [
        f"{r['index']} ||| {h['text']} ||| {h['score']:.6f}" for r in rows for h in r["hypotheses"]
    ]
    assert text == listed and len(text) > len(lines)


def test_lines_that_wait_together_are_read_as_one_batch(tmp_path):
    """What is readable at once is one batch (up to its size: then reading stops, and the
    line not yet ended waits for the next read); the last line needs no break."""
    from aiayn.infer.stream import available_batches

    (tmp_path / "in.txt").write_bytes(b"a\nb\r\n\nc\nd\ne")
    with open(tmp_path / "in.txt", "rb") as source:
        assert list(available_batches(source, 4)) == [["a", "b", "", "c"], ["d"], ["e"]]
