"""average, finish, export, import-hf: checkpoints made into others."""

from __future__ import annotations

import json


def add_parsers(sub) -> None:
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


COMMANDS = {
    "average": cmd_average,
    "finish": cmd_finish,
    "export": cmd_export,
    "import-hf": cmd_import_hf,
}
