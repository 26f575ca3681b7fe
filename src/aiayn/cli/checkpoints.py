"""average, finish, export, import-hf: checkpoints made into others."""

from __future__ import annotations

import json

from aiayn.cli.common import add_either, add_json, add_output, command


def add_parsers(sub) -> None:
    """average, finish, export, import-hf."""
    p = command(
        sub,
        "average",
        "average checkpoints into a new one (§6.1)",
        "Average the weights of several checkpoints into a new checkpoint directory, as the\n"
        "paper does with its last 5 (base) or 20 (big) checkpoints (§6.1).",
        [
            "aiayn average runs/demo --last 5 --output runs/demo/avg5",
            "aiayn average runs/demo/checkpoints/step_800 runs/demo/checkpoints/step_900 "
            "--output runs/demo/avg2",
        ],
    )
    add_either(p, "checkpoint", "CHECKPOINT", "run dirs and/or checkpoint step dirs", many=True)
    p.add_argument("--last", type=int, help="the newest K of them (default: all)")
    add_output(p, "the new checkpoint directory", required=True)

    p = command(
        sub,
        "finish",
        "average a run's last (or best) K checkpoints into RUN/averaged and score it",
        "Average the run's newest (or best by checkpoint.best_metric) K checkpoints into\n"
        "RUN/averaged, score it on the dev and test sets, and write RUN/averaged/summary.json\n"
        "(train.finish: K does this at the end of a run).",
        [
            "aiayn finish runs/demo --last 5",
            "aiayn finish --checkpoint runs/wmt14_en_de_base --best 5",
        ],
    )
    add_either(p, "checkpoint", "RUN", "the run directory")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--last", type=int, help="the newest K checkpoints")
    which.add_argument("--best", type=int, help="the K best by checkpoint.best_metric")
    add_json(p, "the default: what scripts read")

    p = command(
        sub,
        "export",
        "the model for inference: safetensors, CTranslate2 or Hugging Face",
        "Write a checkpoint for inference: one safetensors file with its config and tokenizer\n"
        "beside it, a CTranslate2 model directory, or a transformers directory.",
        [
            "aiayn export runs/demo --output exports/demo.safetensors",
            "aiayn export runs/demo --format ctranslate2 --output exports/demo-ct2 "
            "--quantization int8",
            "aiayn export --checkpoint runs/demo/averaged --format hf --output exports/demo-hf",
        ],
    )
    add_either(p, "checkpoint", "CHECKPOINT", "run_dir (its latest valid checkpoint) or a step dir")
    p.add_argument(
        "--format",
        default="safetensors",
        choices=["safetensors", "ctranslate2", "hf"],
        help="safetensors: FILE.safetensors for aiayn itself; ctranslate2: a CTranslate2 model "
        "directory; hf: a transformers directory (MarianMT or OPT)",
    )
    add_output(p, "FILE.safetensors, or a new directory", required=True)
    p.add_argument(
        "--dtype", default="fp32", choices=["fp32", "bf16"], help="safetensors and hf: weights"
    )
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
        help="ctranslate2 only: weights stored in this type (default: float32)",
    )

    p = command(
        sub,
        "import-hf",
        "a Hugging Face MarianMT (OPUS-MT) model as an aiayn model, to fine-tune or serve",
        "Convert a MarianMT (OPUS-MT) model, exactly, into an aiayn export: for init.source,\n"
        "translate, evaluate and the exports (docs/fine_tuning.md).",
        [
            "aiayn import-hf Helsinki-NLP/opus-mt-de-en --output exports/opus-de-en.safetensors",
            "aiayn import-hf --model path/to/marian --output exports/marian.safetensors",
        ],
    )
    add_either(
        p,
        "model",
        "MODEL",
        "a MarianMT directory, or a hub name such as Helsinki-NLP/opus-mt-de-en",
    )
    add_output(p, "FILE.safetensors (as aiayn export writes)", required=True)
    p.add_argument("--revision", help="hub names only: the commit, tag or branch to download")


def cmd_average(args) -> int:
    from aiayn.checkpoint.average import average
    from aiayn.train.monitor import setup_logging

    setup_logging(None)
    out = average(args.checkpoint, args.output, args.last)
    print(f"averaged checkpoint in {out}")
    return 0


def cmd_finish(args) -> int:
    from aiayn.eval.finish import finish
    from aiayn.train.monitor import setup_logging

    setup_logging(None)
    summary = finish(args.checkpoint, args.last or args.best, "last" if args.last else "best")
    print(json.dumps(summary, indent=1))
    return 0


def cmd_export(args) -> int:
    from aiayn.checkpoint.average import export_paths
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

    from aiayn.checkpoint.average import read_export
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


COMMANDS = {
    "average": cmd_average,
    "finish": cmd_finish,
    "export": cmd_export,
    "import-hf": cmd_import_hf,
}
