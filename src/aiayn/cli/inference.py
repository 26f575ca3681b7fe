"""translate, evaluate, score, generate: a trained model at work, and its output scored."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from aiayn.cli.common import add_checkpoint, add_json, add_output, command, print_result
from aiayn.config.decode import BLEU_TOKENIZERS


def add_parsers(sub) -> None:
    """translate, evaluate, score, generate."""
    p = command(
        sub,
        "translate",
        "translate lines from stdin or a file",
        "Translate one sentence a line. From a pipe or a terminal each line is written (and\n"
        "flushed) as soon as it is translated, lines that arrive together decoded together.\n"
        "With --input and --output: in chunks, resumable, shared among the ranks under torchrun,\n"
        "n-best lists included (docs/cli.md).",
        [
            "echo 'forty-two thousand one' | aiayn translate runs/demo",
            "aiayn translate --checkpoint runs/demo --input de.txt --output en.txt decode.beam=1",
            "aiayn translate exports/demo-ct2 --engine ctranslate2 --n-best 4 --input de.txt",
        ],
    )
    add_checkpoint(p, "decode.beam=1 decode.max_len_b=80", many=True)
    _add_n_best(p)
    add_json(p, "--n-best lists, a line per sentence")
    p.add_argument("--input", help="source file (default: stdin)")
    add_output(p, "hypotheses file (default: stdout)")
    p.add_argument(
        "--chunk-kb", type=int, default=1024, help="with --input and --output: chunk size"
    )

    p = command(
        sub,
        "evaluate",
        "BLEU / perplexity / accuracy of a checkpoint",
        "Score a checkpoint on a split of its own config's data: BLEU, chrF and TER with their\n"
        "signatures (translation), loss and perplexity (language model), or accuracy\n"
        "(classifier). Hypotheses and references go to run_dir/eval/.",
        [
            "aiayn evaluate runs/demo",
            "aiayn evaluate --checkpoint runs/demo --split valid --json decode.beam=1",
            "aiayn evaluate runs/tinyshakespeare --device cpu train.eval_stride=128",
        ],
    )
    add_checkpoint(p, "decode.beam=1 train.eval_stride=128", many=True)
    _add_n_best(p)
    p.add_argument(
        "--split", default="test", choices=["train", "valid", "test"], help="which split"
    )
    add_json(p)

    p = command(
        sub,
        "score",
        "score a hypotheses file against a references file (any system's output)",
        "Score any system's hypotheses against references, line by line: sacreBLEU's BLEU\n"
        "(cased and lowercased), chrF and TER with their signatures; --compound-split adds the\n"
        "paper's tokenized BLEU.",
        [
            "aiayn score --hyp en.hyp --ref en.ref",
            "aiayn score --hyp de.hyp --ref de.ref --compound-split --lang de --json",
        ],
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
    add_json(p)

    p = command(
        sub,
        "generate",
        "sample from a language model",
        "Sample text from a language model's checkpoint, one output per --prompt.",
        [
            "aiayn generate runs/demo_lm --prompt 'forty-one forty-two'",
            "aiayn generate --checkpoint runs/tinyshakespeare --prompt 'ROMEO:' --top-k 10",
            "aiayn generate runs/demo_lm --temperature 0 data.lm_order=stream",
        ],
    )
    add_checkpoint(p, "data.lm_order=stream tokenizer.path=other.model")
    p.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="prompt text (repeatable; \\n is a line break; default: one empty prompt)",
    )
    p.add_argument("--max-new-tokens", type=int, default=50, help="tokens sampled per prompt")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (0: greedy)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k likeliest only")
    p.add_argument("--seed", type=int, default=0, help="the sampler's seed")


def _add_n_best(p) -> None:
    p.add_argument(
        "--n-best",
        type=int,
        default=None,
        metavar="K",
        help="the K best hypotheses of each sentence with their scores, `INDEX ||| TEXT ||| "
        "SCORE` a line (decode.n_best=K; K <= decode.beam); translate writes them where it "
        "writes translations (stdout or --output), evaluate scores the first and writes the "
        "lists beside the hypotheses (.nbest)",
    )


def _models(args) -> list[str]:
    """--checkpoint's values (globs expanded), each checked against --engine; --n-best made the
    override it stands for. An ensemble is for --engine torch."""
    from aiayn.errors import ConfigError
    from aiayn.export.ct2_runtime import check_engine
    from aiayn.infer.ensemble import checkpoint_paths

    checkpoints = checkpoint_paths(args.checkpoint)
    for checkpoint in checkpoints:
        check_engine(checkpoint, args.engine)
    if len(checkpoints) > 1 and args.engine != "torch":
        raise ConfigError(
            f"CHECKPOINT names {len(checkpoints)} models: an ensemble runs with --engine torch "
            "(give its checkpoints, not their CTranslate2 exports)"
        )
    if args.n_best is not None:
        args.overrides = [*args.overrides, f"decode.n_best={args.n_best}"]
    return checkpoints


def cmd_translate(args) -> int:
    from aiayn.export.ct2_runtime import translate_ct2
    from aiayn.infer.ensemble import load_ensemble
    from aiayn.infer.stream import translate_stream
    from aiayn.infer.translate import n_best_lines, translate, translate_n_best

    checkpoints = _models(args)
    n_best = args.n_best is not None or args.json
    if args.input and not Path(args.input).is_file():
        from aiayn.errors import DataError

        raise DataError(f"--input {args.input}: no such file")
    if args.input and args.output and args.engine == "torch":
        return _translate_file(args, checkpoints, n_best)
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        from aiayn.errors import ConfigError

        raise ConfigError(
            "translate on several ranks shares a file: give --input and --output "
            "(and --engine torch)"
        )
    if args.engine == "ctranslate2":
        from aiayn.export.ct2_runtime import Ct2Model

        model = Ct2Model(checkpoints[0], args.overrides, args.device, args.threads)
        batch = model.cfg.decode.batch_size

        def hypotheses(lines: list[str], first: int):
            return translate_ct2(model, lines, n_best=n_best)
    else:
        cfg, model, tok, _ = load_ensemble(checkpoints, args.overrides, args.device)
        device, batch = next(model.parameters()).device, cfg.decode.batch_size
        run = translate_n_best if n_best else translate

        def hypotheses(lines: list[str], first: int):
            return run(model, tok, lines, cfg.decode, device, first=first)

    done = 0  # the stream's lines before this batch: its sentences' indices and seeds

    def translate_lines(lines: list[str]) -> list[str]:
        nonlocal done
        hyps = hypotheses(lines, done)
        if n_best:  # a sentence's lines together, so that the stream writes them together
            text = n_best_lines(hyps, done, as_json=args.json)
            hyps = text if args.json else _by_sentence(text, len(lines))
        done += len(lines)
        return hyps

    # Up to 16 batches read ahead where lines are waiting (a file, a full pipe), sorted by
    # length among themselves; a line typed alone is translated at once.
    with contextlib.ExitStack() as files:
        source = files.enter_context(open(args.input, "rb")) if args.input else sys.stdin.buffer
        out = sys.stdout
        if args.output:
            out = files.enter_context(open(args.output, "w", encoding="utf-8"))
        translate_stream(source, out, translate_lines, 16 * batch)
    return 0


def _by_sentence(lines: list[str], n: int) -> list[str]:
    """n-best text lines (`INDEX ||| ...`) joined into one string per sentence."""
    out: list[list[str]] = [[] for _ in range(n)]
    first = int(lines[0].split(" ||| ", 1)[0]) if lines else 0
    for line in lines:
        out[int(line.split(" ||| ", 1)[0]) - first].append(line)
    return ["\n".join(group) for group in out]


def _translate_file(args, checkpoints: list[str], n_best: bool) -> int:
    """--input to --output in chunks, on every rank of the launcher's group (one process
    without one), resumable (aiayn/infer/translate_file.py). n-best lists are written as on
    stdout (`INDEX ||| TEXT ||| SCORE` lines, or a JSON line per input line with --json), each
    chunk's numbered from 0 and renumbered across the file as the parts are joined."""
    from functools import partial

    from aiayn.checkpoint.locate import locate
    from aiayn.distributed.env import setup, teardown
    from aiayn.infer.ensemble import load_ensemble
    from aiayn.infer.translate import n_best_lines, renumbered, translate, translate_n_best
    from aiayn.infer.translate_file import translate_file
    from aiayn.train.monitor import setup_logging
    from aiayn.train.report import log_checksums

    env = setup(args.device)
    setup_logging(None, env.rank)
    try:
        # Rank 0 finds and verifies the checkpoints, and every rank loads what it found: W
        # ranks hashing them would read them W times from shared storage.
        located = env.decide(lambda: [locate(c) for c in checkpoints])
        cfg, model, tok, found = load_ensemble(located, args.overrides, env.device)
        log_checksums(env)
        settings = {
            "checkpoint": [str(c.resolve()) for c in found]
            if len(found) > 1
            else str(found[0].resolve()),
            "overrides": list(args.overrides),
        }
        if n_best:  # parts of the other form are refused, not mixed in
            settings["n_best"] = "json" if args.json else "text"

        def chunk(lines: list[str], j: int) -> list[str]:
            if not n_best:
                return translate(model, tok, lines, cfg.decode, env.device, j)
            hyps = translate_n_best(model, tok, lines, cfg.decode, env.device, j)
            return n_best_lines(hyps, as_json=args.json)  # numbered from 0: see renumber

        translate_file(
            chunk,
            Path(args.input),
            Path(args.output),
            settings,
            env.rank,
            env.world_size,
            env.barrier,
            chunk_bytes=args.chunk_kb * 1024,
            gather=env.gather_to_main,  # O(W) on rank 0 only
            renumber=partial(renumbered, as_json=args.json) if n_best else None,
        )
    finally:
        teardown()
    return 0


def cmd_evaluate(args) -> int:
    from aiayn.eval.evaluate import evaluate, evaluate_ct2

    checkpoints = _models(args)
    if args.engine == "ctranslate2":
        result = evaluate_ct2(
            checkpoints[0], args.split, args.overrides, device=args.device, threads=args.threads
        )
    else:
        result = evaluate(checkpoints, args.split, args.overrides, args.device)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"checkpoint {result['checkpoint']}  split {args.split}")
    for src, ref, hyp in result.pop("samples", []):
        print(f"  src: {src}\n  ref: {ref}\n  hyp: {hyp}\n")
    print_result({k: v for k, v in result.items() if k not in ("checkpoint", "split")}, 18)
    return 0


def cmd_score(args) -> int:
    from aiayn.eval.scores import file_scores

    result = file_scores(
        args.hyp, args.ref, args.tokenize, args.lang if args.compound_split else None
    )
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"hypotheses {args.hyp}  references {args.ref}")
    print_result(result, 29)
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


COMMANDS = {
    "translate": cmd_translate,
    "evaluate": cmd_evaluate,
    "score": cmd_score,
    "generate": cmd_generate,
}
