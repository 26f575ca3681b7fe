"""`aiayn` subcommands. Thin: each parses its arguments and calls one function."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from aiayn.config.decode import BLEU_TOKENIZERS
from aiayn.distributed.parent_death import end_with_launcher
from aiayn.errors import AiaynError
from aiayn.runtime import startup

CONFIG_HELP = "YAML run config (configs/*.yaml)"
OVERRIDES_HELP = "dotted overrides, e.g. train.max_steps=200 model.dropout=0"


def _add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help=CONFIG_HELP)
    p.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)


def _add_checkpoint(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint",
        required=True,
        help="run_dir (its latest checkpoint), a step or averaged dir, an exported .safetensors, "
        "or with --engine ctranslate2 a CTranslate2 export directory",
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--engine",
        default="torch",
        choices=["torch", "ctranslate2"],
        help="ctranslate2: run a `aiayn export --format ctranslate2` directory (pip install "
        "'aiayn[serve]'); greedy output is the same, but its beam search divides log P by "
        "len^alpha, not GNMT's ((5 + len) / 6)^alpha",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="ctranslate2: CPU threads per batch (default: every core this process may use)",
    )
    p.add_argument(
        "overrides", nargs="*", help="overrides of the checkpoint's config, e.g. decode.beam=1"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aiayn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    _training_commands(sub)
    _inference_commands(sub)
    _checkpoint_commands(sub)
    _demo_data_command(sub)
    return parser


def _training_commands(sub) -> None:
    """train, and what prepares for it: tokenizer, data, params."""
    p = sub.add_parser("train", help="train (resumes from run_dir's latest checkpoint)")
    _add_config(p)

    tok = sub.add_parser("tokenizer", help="SentencePiece tokenizer")
    tok_sub = tok.add_subparsers(dest="tokenizer_command", required=True)
    p = tok_sub.add_parser("train", help="train the joint tokenizer from the training stream")
    _add_config(p)
    p.add_argument("--force", action="store_true", help="replace an existing tokenizer")

    data = sub.add_parser("data", help="a recipe's corpus; the token cache of the training split")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    p = data_sub.add_parser(
        "prepare", help="tokenise the training split into data.cache_dir (all ranks under torchrun)"
    )
    _add_config(p)
    p.add_argument("--force", action="store_true", help="rebuild an existing cache")
    p = data_sub.add_parser(
        "download", help="a recipe's public corpus, checked against its recorded sha256"
    )
    p.add_argument("name", nargs="?", help="multi30k, tinyshakespeare or wikitext-2 (none: --list)")
    p.add_argument("--list", action="store_true", help="list the corpora, their sources, licences")
    p.add_argument("--output", help="the corpus's folder (default data/corpora/NAME)")
    p.add_argument("--force", action="store_true", help="download files that are already right")
    p.add_argument(
        "--mirror", help="base URL holding NAME/<upstream file> (default $AIAYN_DATA_MIRROR)"
    )

    p = sub.add_parser("params", help="print the model's parameter count")
    _add_config(p)
    p.add_argument("--vocab-size", type=int, help="vocabulary size (default: the tokenizer's)")


def _inference_commands(sub) -> None:
    """translate, evaluate, score, generate: a trained model at work, and its output scored."""
    p = sub.add_parser("translate", help="translate lines from stdin or a file")
    _add_checkpoint(p)
    p.add_argument("--input", help="source file (default stdin)")
    p.add_argument(
        "--output",
        help="hypotheses file (default stdout). With --input: translated in chunks, resumable, "
        "shared among the ranks under torchrun (docs/cli.md)",
    )
    p.add_argument(
        "--chunk-kb", type=int, default=1024, help="with --input and --output: chunk size"
    )

    p = sub.add_parser("evaluate", help="BLEU / perplexity / accuracy of a checkpoint")
    _add_checkpoint(p)
    p.add_argument("--split", default="test", choices=["train", "valid", "test"])
    p.add_argument("--json", action="store_true", help="print the result as JSON")

    p = sub.add_parser(
        "score", help="score a hypotheses file against a references file (any system's output)"
    )
    p.add_argument("--hyp", required=True, help="hypotheses, one detokenized sentence a line")
    p.add_argument("--ref", required=True, help="references, line by line with --hyp")
    p.add_argument(
        "--tokenize", default="13a", choices=BLEU_TOKENIZERS, help="sacreBLEU's tokenizer"
    )
    p.add_argument(
        "--compound-split",
        action="store_true",
        help="also the paper's BLEU: both sides Moses-tokenized, hyphens split off as "
        "##AT##-##AT##, case-sensitive BLEU of the tokens (its WMT14 en-de 27.3 and 28.4)",
    )
    p.add_argument("--lang", default="de", help="--compound-split: the Moses tokenizer's rules")
    p.add_argument("--json", action="store_true", help="print the result as JSON")

    p = sub.add_parser("generate", help="sample from a language model")
    _add_checkpoint(p)
    p.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="prompt text (repeatable; \\n is a line break)",
    )
    p.add_argument("--max-new-tokens", type=int, default=50)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)


def _checkpoint_commands(sub) -> None:
    """average, finish, export, import-hf: checkpoints made into others."""
    p = sub.add_parser("average", help="average checkpoints into a new one (§6.1)")
    p.add_argument("checkpoints", nargs="+", help="run dirs and/or checkpoint step dirs")
    p.add_argument("--last", type=int, help="the newest K of them (default: all)")
    p.add_argument("--output", required=True, help="the new checkpoint directory")

    p = sub.add_parser(
        "finish",
        help="average a run's last (or best) K checkpoints into RUN/averaged and score it",
    )
    p.add_argument("run_dir", help="the run directory")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--last", type=int, help="the newest K checkpoints")
    which.add_argument("--best", type=int, help="the K best by checkpoint.best_metric")

    p = sub.add_parser(
        "export", help="the model for inference: safetensors, CTranslate2 or Hugging Face"
    )
    p.add_argument("checkpoint", help="run_dir (its latest valid checkpoint) or a step dir")
    p.add_argument(
        "--format",
        default="safetensors",
        choices=["safetensors", "ctranslate2", "hf"],
        help="safetensors: FILE.safetensors for aiayn itself; ctranslate2: a CTranslate2 model "
        "directory; hf: a transformers directory (MarianMT or OPT)",
    )
    p.add_argument("--output", required=True, help="FILE.safetensors, or a new directory")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="safetensors, hf")
    p.add_argument(
        "--quantization",
        choices=[
            "float32",
            "int8",
            "int8_float32",
            "int8_float16",
            "int8_bfloat16",
            "int16",
            "float16",
            "bfloat16",
        ],
        help="ctranslate2 only: weights stored in this type (default float32)",
    )

    p = sub.add_parser(
        "import-hf",
        help="a Hugging Face MarianMT (OPUS-MT) model as an aiayn model, to fine-tune or serve",
    )
    p.add_argument(
        "model", help="a MarianMT directory, or a hub name such as Helsinki-NLP/opus-mt-de-en"
    )
    p.add_argument("--output", required=True, help="FILE.safetensors (as aiayn export writes)")
    p.add_argument("--revision", help="hub names only: the commit, tag or branch to download")


def _demo_data_command(sub) -> None:
    p = sub.add_parser("demo-data", help="write a generated demo corpus")
    p.add_argument("kind", choices=["numbers", "lm", "classify"])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--digits",
        type=int,
        nargs="+",
        choices=[4, 5, 6],
        help="numbers: the lengths of the numbers above 999 (default 4 5 6)",
    )
    p.add_argument("--n-train", type=int, help="numbers: training pairs (default 40,000)")


def main(argv: list[str] | None = None) -> int:
    startup.mark_main()  # the end of the interpreter's start (the start-up line of `train`)
    end_with_launcher()  # under torchrun: this worker ends when its launcher dies
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args) or 0
    except AiaynError as exc:
        print(f"aiayn {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code


def cmd_train(args) -> int:
    import os

    from aiayn.config import keys_set, load_config
    from aiayn.distributed.launcher import accelerate_overrides
    from aiayn.distributed.preemption import REQUEUE_EXIT_CODE, Preempted
    from aiayn.train import train

    launcher = accelerate_overrides(os.environ)
    if launcher and os.environ.get("RANK", "0") == "0":
        print(f"aiayn train: from accelerate launch: {' '.join(launcher)}", file=sys.stderr)
    try:
        overrides = launcher + args.overrides
        train(load_config(args.config, overrides), keys_set(args.config, overrides))
    except Preempted as exc:
        print(f"aiayn train: {exc}; exit code {REQUEUE_EXIT_CODE}: requeue me", file=sys.stderr)
        return REQUEUE_EXIT_CODE
    except Exception as exc:
        if "TORCHELASTIC_ERROR_FILE" in os.environ:
            # torchrun's agent reads the message from this file: the launcher's summary and
            # the run's faults.jsonl then say why this rank failed, not only its exit code.
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

            ErrorHandler().record_exception(exc)
        raise
    return 0


def cmd_tokenizer(args) -> int:
    from aiayn.config import load_config
    from aiayn.data.prepare import prepare_tokenizer
    from aiayn.errors import TokenizerError
    from aiayn.train.monitor import setup_logging

    setup_logging(None)
    cfg = load_config(args.config, args.overrides)
    if cfg.tokenizer_path.is_file() and not args.force:
        raise TokenizerError(
            f"{cfg.tokenizer_path} exists; runs trained with it depend on it. Pass --force to "
            "replace it, or set tokenizer.path to a new file"
        )
    tok = prepare_tokenizer(cfg, retrain=True)
    print(json.dumps({"path": str(tok.path), **tok.contract()}, indent=1))
    return 0


def cmd_data(args) -> int:
    if args.data_command == "download":
        return _data_download(args)
    import time

    from aiayn.config import load_config
    from aiayn.data.hub_revision import pin_hub_revision
    from aiayn.data.prepare import prepare_data
    from aiayn.distributed.env import setup, teardown
    from aiayn.train.monitor import setup_logging

    cfg = load_config(args.config, args.overrides)
    cfg.data.cache = True
    # Tokenising needs no accelerator; gloo joins the ranks.
    env = setup("cpu", cfg.distributed.setup_timeout_minutes)
    try:
        setup_logging(None, env.rank)
        started = time.perf_counter()
        cfg = pin_hub_revision(cfg, env.decide)  # as the run will read it
        _, cache = prepare_data(cfg, env, rebuild=args.force)
        seconds = time.perf_counter() - started
    finally:
        teardown()
    if env.is_main:
        for one in cache if isinstance(cache, list) else [cache]:  # data.sources: one each
            counts = {"cache": str(one.root), "seconds": round(seconds, 2), **one.counts()}
            print(json.dumps(counts, indent=1))
    return 0


def _data_download(args) -> int:
    from aiayn.data.download import download, listing

    if args.list or args.name is None:
        print(listing())
        return 0
    download(args.name, Path(args.output) if args.output else None, args.force, args.mirror)
    return 0


def cmd_params(args) -> int:
    import torch

    from aiayn.config import load_config
    from aiayn.model import build_model, count_parameters
    from aiayn.tokenizer import PAD_ID, Tokenizer

    cfg = load_config(args.config, args.overrides)
    vocab = args.vocab_size
    if vocab is None:
        path = cfg.tokenizer_path
        vocab = Tokenizer(path).vocab_size if path.is_file() else cfg.tokenizer.vocab_size
    with torch.device("meta"):  # count without allocating: big is 213M parameters
        model = build_model(cfg.model, vocab, PAD_ID)
    n = count_parameters(model)
    print(
        f"{cfg.model.kind} N={cfg.model.N} d_model={cfg.model.d_model} d_ff={cfg.model.d_ff} "
        f"h={cfg.model.h} vocab={vocab} share_embeddings={cfg.model.share_embeddings}"
    )
    print(f"parameters: {n:,} ({n / 1e6:.1f}M)")
    return 0


def cmd_translate(args) -> int:
    from aiayn.checkpoint.inference import load_for_inference
    from aiayn.export.ct2_runtime import check_engine, translate_ct2
    from aiayn.infer.translate import translate

    check_engine(args.checkpoint, args.engine)
    if args.input and not Path(args.input).is_file():
        from aiayn.errors import DataError

        raise DataError(f"--input {args.input}: no such file")
    if args.input and args.output and args.engine == "torch":
        return _translate_file(args)
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        raise SystemExit(
            "aiayn translate on several ranks shares a file: give --input and --output "
            "(and --engine torch)"
        )
    text = Path(args.input).read_text(encoding="utf-8") if args.input else sys.stdin.read()
    lines = text.splitlines()
    if args.engine == "ctranslate2":
        hyps = translate_ct2(
            args.checkpoint, lines, args.overrides, device=args.device, threads=args.threads
        )
    else:
        cfg, model, tok, _ = load_for_inference(args.checkpoint, args.overrides, args.device)
        device = next(model.parameters()).device
        hyps = translate(model, tok, lines, cfg.decode, device)
    out = "".join(h + "\n" for h in hyps)
    if args.output:
        Path(args.output).write_text(out, encoding="utf-8")
    else:
        sys.stdout.write(out)
    return 0


def _translate_file(args) -> int:
    """--input to --output in chunks, on every rank of the launcher's group (one process
    without one), resumable (aiayn/infer/translate_file.py)."""
    from aiayn.checkpoint.inference import load_for_inference
    from aiayn.checkpoint.locate import locate
    from aiayn.distributed.env import setup, teardown
    from aiayn.infer.translate import translate
    from aiayn.infer.translate_file import translate_file
    from aiayn.train.monitor import setup_logging
    from aiayn.train.report import log_checksums

    env = setup(args.device)
    setup_logging(None, env.rank)
    try:
        # Rank 0 finds and verifies the checkpoint, and every rank loads what it found: W
        # ranks hashing it would read it W times from shared storage.
        found = env.decide(lambda: locate(args.checkpoint))
        cfg, model, tok, ckpt = load_for_inference(found, args.overrides, env.device)
        log_checksums(env)
        settings = {"checkpoint": str(ckpt.resolve()), "overrides": list(args.overrides)}
        translate_file(
            lambda lines: translate(model, tok, lines, cfg.decode, env.device),
            Path(args.input),
            Path(args.output),
            settings,
            env.rank,
            env.world_size,
            env.barrier,
            chunk_bytes=args.chunk_kb * 1024,
            gather=env.gather_to_main,  # O(W) on rank 0 only
        )
    finally:
        teardown()
    return 0


def cmd_evaluate(args) -> int:
    from aiayn.eval.evaluate import evaluate, evaluate_ct2
    from aiayn.export.ct2_runtime import check_engine

    check_engine(args.checkpoint, args.engine)
    if args.engine == "ctranslate2":
        result = evaluate_ct2(
            args.checkpoint, args.split, args.overrides, device=args.device, threads=args.threads
        )
    else:
        result = evaluate(args.checkpoint, args.split, args.overrides)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"checkpoint {result['checkpoint']}  split {args.split}")
    for src, ref, hyp in result.pop("samples", []):
        print(f"  src: {src}\n  ref: {ref}\n  hyp: {hyp}\n")
    _print_result({k: v for k, v in result.items() if k not in ("checkpoint", "split")}, 18)
    return 0


def _print_result(result: dict, width: int) -> None:
    """One `key: value` line each, keys right-aligned to `width`, floats to 4 decimals."""
    for key, value in result.items():
        shown = f"{value:.4f}" if isinstance(value, float) else value
        print(f"{key:>{width}}: {shown}")


def cmd_score(args) -> int:
    from aiayn.eval.scores import file_scores

    result = file_scores(
        args.hyp, args.ref, args.tokenize, args.lang if args.compound_split else None
    )
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"hypotheses {args.hyp}  references {args.ref}")
    _print_result(result, 29)
    return 0


def cmd_generate(args) -> int:
    from aiayn.checkpoint.inference import load_for_inference
    from aiayn.errors import ConfigError
    from aiayn.export.ct2_runtime import Ct2Model, check_engine, generate_ct2
    from aiayn.infer.generate import sample_text

    check_engine(args.checkpoint, args.engine)
    if args.engine == "ctranslate2":
        model = Ct2Model(args.checkpoint, args.overrides, args.device, args.threads)
        cfg = model.cfg
    else:
        cfg, model, tok, _ = load_for_inference(args.checkpoint, args.overrides, args.device)
    if cfg.model.kind != "lm":
        raise ConfigError(f"generate needs an lm checkpoint; this one is {cfg.model.kind}")
    prompts = [p.replace("\\n", "\n") for p in args.prompt or [""]]
    running_text = cfg.data.lm_order == "stream"
    sample = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
    )
    if args.engine == "ctranslate2":
        texts = generate_ct2(model, prompts, **sample)
    else:
        texts = sample_text(model, tok, prompts, running_text=running_text, **sample)
    for prompt, text in zip(prompts, texts, strict=True):
        print(text if running_text else f"{prompt}{' ' if prompt else ''}{text}")
        if running_text and len(prompts) > 1:
            print("---")
    return 0


def cmd_average(args) -> int:
    from aiayn.checkpoint.tools import average
    from aiayn.train.monitor import setup_logging

    setup_logging(None)
    out = average(args.checkpoints, args.output, args.last)
    print(f"averaged checkpoint in {out}")
    return 0


def cmd_finish(args) -> int:
    from aiayn.eval.finish import finish
    from aiayn.train.monitor import setup_logging

    setup_logging(None)
    summary = finish(args.run_dir, args.last or args.best, "last" if args.last else "best")
    print(json.dumps(summary, indent=1))
    return 0


def cmd_export(args) -> int:
    from aiayn.checkpoint.tools import export_paths
    from aiayn.export import export_model
    from aiayn.train.monitor import setup_logging

    setup_logging(None)
    out = export_model(
        args.checkpoint,
        args.output,
        args.format,
        dtype=args.dtype,
        quantization=args.quantization,
    )
    if args.format == "safetensors":
        weights, config, tokenizer = export_paths(out)
        print(f"exported {weights} ({args.dtype}) with {config.name} and {tokenizer.name}")
    else:
        print(f"exported {out} ({args.format}): {', '.join(sorted(p.name for p in out.iterdir()))}")
    if args.format == "ctranslate2":
        from aiayn.export.ct2 import METADATA_FILE

        meta = json.loads((out / METADATA_FILE).read_text())
        print(
            f"decodes at most {meta['max_positions']} positions ({meta['positions']} positions); "
            f"run it with `aiayn translate|generate --engine ctranslate2 --checkpoint {out}`. "
            "Greedy output equals aiayn's; CTranslate2's beam search divides log P by "
            "len^alpha, not GNMT's ((5 + len) / 6)^alpha"
        )
    return 0


def cmd_import_hf(args) -> int:
    import time

    from aiayn.checkpoint.tools import read_export
    from aiayn.export.hf_import import import_hf
    from aiayn.train.monitor import setup_logging

    setup_logging(None)
    start = time.perf_counter()
    out = import_hf(args.model, args.output, revision=args.revision)
    config, tokenizer, contract = read_export(out)
    m = config["model"]
    print(
        f"imported {args.model} as {out} in {time.perf_counter() - start:.1f} s: "
        f"{m['N']}+{m['decoder_layers'] or m['N']} layers, d_model {m['d_model']}, activation "
        f"{m['activation']}, vocabulary {contract['vocab_size']} ({contract['type']}). "
        f"Fine-tune it with init.source={out}"
    )
    return 0


def cmd_demo_data(args) -> int:
    from aiayn.data import demo

    writer = {
        "numbers": demo.write_numbers,
        "lm": demo.write_lm,
        "classify": demo.write_classify,
    }[args.kind]
    extra = {"digits": tuple(args.digits)} if args.digits else {}
    if args.n_train:
        extra["n_train"] = args.n_train
    if extra and args.kind != "numbers":
        raise SystemExit("aiayn demo-data: --digits and --n-train are for the numbers corpus")
    writer(Path(args.out), seed=args.seed, **extra)
    print(f"{args.kind} corpus in {args.out}")
    return 0


COMMANDS = {
    "train": cmd_train,
    "tokenizer": cmd_tokenizer,
    "data": cmd_data,
    "params": cmd_params,
    "translate": cmd_translate,
    "evaluate": cmd_evaluate,
    "score": cmd_score,
    "generate": cmd_generate,
    "average": cmd_average,
    "finish": cmd_finish,
    "export": cmd_export,
    "import-hf": cmd_import_hf,
    "demo-data": cmd_demo_data,
}
