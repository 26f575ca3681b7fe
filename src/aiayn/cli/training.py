"""`aiayn train` and what prepares for it: tokenizer, data, params, demo-data."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

from aiayn.cli.common import add_config, add_json, add_output, command, group


def add_parsers(sub) -> None:
    """train, and what prepares for it: tokenizer, data, params, a demo corpus."""
    p = command(
        sub,
        "train",
        "train a model (resumes from run_dir's latest checkpoint)",
        "Train the model a run config describes. Training resumes from the run directory's\n"
        "latest checkpoint when there is one; the resolved config is saved with every run.",
        [
            "aiayn train --config configs/demo.yaml",
            "aiayn train --config configs/demo.yaml train.max_steps=200 run_dir=runs/try",
            "aiayn train --config configs/multi30k_de_en.yaml model.dropout=0.3",
        ],
    )
    add_config(p, "train.max_steps=200 model.dropout=0 run_dir=runs/try")

    tok_sub = group(sub, "tokenizer", "SentencePiece tokenizer", "tokenizer_command")
    p = command(
        tok_sub,
        "train",
        "train the joint tokenizer from the training stream",
        "Train the run's joint SentencePiece model (tokenizer.path) from a sample of the\n"
        "training stream; `aiayn train` does this itself when the file is missing.",
        [
            "aiayn tokenizer train --config configs/demo.yaml",
            "aiayn tokenizer train --config configs/demo.yaml --force tokenizer.vocab_size=800",
        ],
    )
    add_config(p, "tokenizer.vocab_size=8000 tokenizer.sample_sentences=100000")
    p.add_argument("--force", action="store_true", help="replace an existing tokenizer")
    add_json(p, "the default: what scripts read")

    data_sub = group(
        sub, "data", "a recipe's corpus; the token cache of the training split", "data_command"
    )
    p = command(
        data_sub,
        "prepare",
        "tokenise the training split into data.cache_dir (all ranks under torchrun)",
        "Tokenise the training split into the token cache (data.cache_dir), once, before\n"
        "training; under torchrun the ranks share the work.",
        [
            "aiayn data prepare --config configs/demo.yaml",
            "aiayn data prepare --config configs/demo.yaml --force data.cache_dir=cache/demo",
        ],
    )
    add_config(p, "data.cache_dir=cache/demo data.max_len=128")
    p.add_argument("--force", action="store_true", help="rebuild an existing cache")
    add_json(p, "the default: what scripts read")
    p = command(
        data_sub,
        "download",
        "a recipe's public corpus, checked against its recorded sha256",
        "Fetch a recipe's public corpus into data/corpora/NAME, each file checked against its\n"
        "recorded sha256 before it takes its name. Without NAME: list the corpora.",
        [
            "aiayn data download --list",
            "aiayn data download multi30k",
            "aiayn data download tinyshakespeare --output data/shakespeare",
        ],
    )
    p.add_argument("name", nargs="?", help="multi30k, tinyshakespeare or wikitext-2 (none: --list)")
    p.add_argument("--list", action="store_true", help="list the corpora, their sources, licences")
    add_output(p, "the corpus's folder (default: data/corpora/NAME)")
    p.add_argument("--force", action="store_true", help="download files that are already right")
    p.add_argument(
        "--mirror", help="base URL holding NAME/<upstream file> (default: $AIAYN_DATA_MIRROR)"
    )

    p = command(
        sub,
        "params",
        "print the model's parameter count",
        "Count the parameters of the model a config describes, without allocating it.",
        [
            "aiayn params --config configs/wmt14_en_de_base.yaml --vocab-size 37000",
            "aiayn params --config configs/demo.yaml --json model.N=2",
        ],
    )
    add_config(p, "model.preset=transformer_big model.N=8")
    p.add_argument("--vocab-size", type=int, help="vocabulary size (default: the tokenizer's)")
    add_json(p)

    p = command(
        sub,
        "demo-data",
        "write a generated demo corpus",
        "Write a small generated corpus: numbers (number words, English and German: a\n"
        "translation task), lm (text for a language model) or classify (labelled sentences).",
        [
            "aiayn demo-data numbers --output data/demo/numbers",
            "aiayn demo-data lm --output data/demo/lm --seed 2",
            "aiayn demo-data numbers --output data/demo/short --digits 4 --n-train 5000",
        ],
    )
    p.add_argument("kind", choices=["numbers", "lm", "classify"], help="which corpus")
    add_output(p, "the corpus's directory", required=True)
    p.add_argument("--seed", type=int, default=1, help="the generator's seed")
    p.add_argument(
        "--digits",
        type=int,
        nargs="+",
        choices=[4, 5, 6],
        help="numbers: the lengths of the numbers above 999 (default: 4 5 6)",
    )
    p.add_argument("--n-train", type=int, help="numbers: training pairs (default: 40,000)")


def cmd_train(args) -> int:
    from aiayn.config import keys_set, load_config
    from aiayn.distributed.faults import LAUNCHER_ENV
    from aiayn.distributed.launcher import accelerate_overrides
    from aiayn.distributed.preemption import REQUEUE_EXIT_CODE, Preempted
    from aiayn.errors import AiaynError
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
            record_for_the_launcher(exc)
            if isinstance(exc, AiaynError) and os.environ.get(LAUNCHER_ENV):
                return exc.exit_code  # aiayn.distributed.run prints it, once for all ranks
        raise
    return 0


def record_for_the_launcher(exc: Exception) -> None:
    """torchrun's agent reads this rank's message from TORCHELASTIC_ERROR_FILE: the launcher's
    summary and the run's faults.jsonl then say why it failed, not only its exit code. Written
    whole or not at all: a rank that fails because another did is often SIGKILLed by the agent
    while it writes, and the agent, finding the file empty, raises instead of restarting the
    group (torch's ProcessFailure parses it unguarded; pytorch/pytorch#56739 would have made
    that non-fatal and was closed). So it is written beside it and renamed into place."""
    from aiayn.errors import AiaynError

    final = os.environ["TORCHELASTIC_ERROR_FILE"]
    part = f"{final}.{os.getpid()}.part"
    # torch's error-file format (ErrorHandler.record_exception's), with the traceback where the
    # exception has one to show: an error a person must fix is its message alone.
    what = f"{type(exc).__name__}: {exc}"
    callstack = what if isinstance(exc, AiaynError) else traceback.format_exc()
    info = {"py_callstack": callstack, "timestamp": str(int(time.time()))}
    with open(part, "w") as fh:
        json.dump({"message": {"message": what, "extraInfo": info}}, fh)
    os.replace(part, final)


def cmd_tokenizer(args) -> int:
    from aiayn.config import load_config
    from aiayn.data.hub_copy import materialise
    from aiayn.data.hub_revision import pin_hub_revision
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
    # A Hub split: pinned as the run will read it, and copied once, so that `aiayn data
    # prepare` (and the run) read the same revision from the copy, not the Hub again.
    cfg = pin_hub_revision(cfg)
    materialise(cfg)
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
    from aiayn.corpora.download import download, listing

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
    if args.json:
        m = cfg.model
        shape = dict(kind=m.kind, N=m.N, d_model=m.d_model, d_ff=m.d_ff, h=m.h, vocab=vocab)
        print(json.dumps({**shape, "parameters": n}, indent=1))
        return 0
    print(
        f"{cfg.model.kind} N={cfg.model.N} d_model={cfg.model.d_model} d_ff={cfg.model.d_ff} "
        f"h={cfg.model.h} vocab={vocab} share_embeddings={cfg.model.share_embeddings}"
    )
    print(f"parameters: {n:,} ({n / 1e6:.1f}M)")
    return 0


def cmd_demo_data(args) -> int:
    from aiayn.corpora import demo

    writer = {
        "numbers": demo.write_numbers,
        "lm": demo.write_lm,
        "classify": demo.write_classify,
    }[args.kind]
    extra = {"digits": tuple(args.digits)} if args.digits else {}
    if args.n_train:
        extra["n_train"] = args.n_train
    if extra and args.kind != "numbers":
        from aiayn.errors import ConfigError

        raise ConfigError(
            f"--digits and --n-train are for the numbers corpus, not {args.kind}: drop them"
        )
    writer(Path(args.output), seed=args.seed, **extra)
    print(f"{args.kind} corpus in {args.output}")
    return 0


COMMANDS = {
    "train": cmd_train,
    "tokenizer": cmd_tokenizer,
    "data": cmd_data,
    "params": cmd_params,
    "demo-data": cmd_demo_data,
}
