"""Translation speed of `aiayn translate` (PyTorch, eager) against its CTranslate2 exports.

    python benchmarks/serving.py                  # the Multi30k model on test_2016_flickr
    python benchmarks/serving.py --base           # transformer_base, random weights
    python benchmarks/serving.py --limit 64 --repeats 1 --quantizations int8   # a smoke test

The Multi30k model is the recipe's averaged checkpoint (`make multi30k` makes it,
runs/multi30k_de_en/average_last5_step_*); --checkpoint names another. Each engine translates
the 1,000 sentences of test_2016_flickr with the run's decode settings (beam 4, alpha 0.6,
max_len_b 50), --batch-size sentences at a time in length-sorted batches, on --threads threads:

    aiayn          aiayn.infer.translate.translate, as `aiayn translate` runs it (fp32)
    ct2 <type>     aiayn.export.ct2_runtime.translate_ct2, as `aiayn translate --engine
                   ctranslate2` runs it, on an export stored as <type> (float32, int16, int8)

Each contender runs in a process of its own (so its peak memory is its own), loads its model,
translates one batch to warm up, then translates the whole input once per repeat; repeats are
interleaved, each round in rotated order, and the table gives medians over repeats. Target
tokens are the SentencePiece tokens of the hypotheses (re-encoded, so every engine is counted
alike), eos not included. Memory is the process's peak resident set once its libraries are
imported (the peak is reset there), and that peak less the resident set at that point: what the
model and decoding add. BLEU is sacreBLEU 13a,
cased, against the references.

Beam search differs in one thing between the engines: aiayn divides log P by GNMT's
((5 + len) / 6)^alpha, CTranslate2 by len^alpha, so the beam rows' BLEU differ a little; the
greedy rows (beam 1) must give the same hypotheses, and the table says how many match.

--base: transformer_base (d_model 512, 6+6 layers) with random weights and the eos row of the
tied embedding zeroed, so no hypothesis ends early: every engine decodes source length + 50
tokens per sentence, and tokens/s is the engines' speed at that size (BLEU means nothing there).
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import fmt, machine, markdown_table, rotated

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "multi30k"
QUANTIZATIONS = ("float32", "int16", "int8")


def read_lines(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return fh.read().splitlines()


# ---- one contender, in its own process ----------------------------------------------------


def worker(args) -> None:
    """Load one engine, warm it on a batch, translate every line once; JSON on stdout."""
    import torch

    torch.set_num_threads(args.threads)
    from aiayn.checkpoint.inference import load_for_inference
    from aiayn.export.ct2_runtime import Ct2Model, translate_ct2
    from aiayn.infer.translate import translate

    lines = read_lines(Path(args.src))[: args.limit]
    overrides = [f"decode.beam={args.beam}", f"decode.batch_size={args.batch_size}"]
    imported = _reset_peak_rss()
    if args.worker == "aiayn":
        cfg, model, tok, _ = load_for_inference(args.model, overrides, "cpu")
        device = next(model.parameters()).device

        def run(part):
            return translate(model, tok, part, cfg.decode, device)
    else:
        ct2 = Ct2Model(args.model, overrides, "cpu", threads=args.threads)
        tok = ct2.tok

        def run(part):
            return translate_ct2(ct2, part)

    run(lines[: args.batch_size])
    start = time.perf_counter()
    hyps = run(lines)
    seconds = time.perf_counter() - start
    peak = _status_mib("VmHWM")
    tokens = sum(map(len, tok.encode(hyps)))
    print(
        json.dumps(
            dict(
                seconds=seconds, tokens=tokens, peak_mib=peak, model_mib=peak - imported, hyps=hyps
            )
        )
    )


def _reset_peak_rss() -> float:
    """Forget the peak the imports reached (Linux: 5 to clear_refs resets VmHWM, the peak
    resident set), so the peak read later is the model's and decoding's; the RSS now."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    return _status_mib("VmRSS")


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as fh:
        kib = next(int(line.split()[1]) for line in fh if line.startswith(f"{field}:"))
    return kib / 1024


# ---- the models ---------------------------------------------------------------------------


def random_base(tokenizer: Path, out: Path) -> Path:
    """transformer_base with random weights as an aiayn export, eos made improbable."""
    import torch

    from aiayn.checkpoint.average import export_module
    from aiayn.config import load_config
    from aiayn.model import build_model
    from aiayn.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer)
    cfg = load_config(
        None,
        [
            "model.preset=transformer_base",
            "model.max_len=256",
            "data.train=unused",
            "data.max_len=128",
            f"tokenizer.path={tokenizer}",
        ],
    )
    torch.manual_seed(0)
    model = build_model(cfg.model, tok.vocab_size, tok.pad_id)
    with torch.no_grad():
        # Tied: eos's logit becomes 0 while thousands of others are N(0, large): never chosen.
        model.src_embed.token.weight[tok.eos_id] = 0
    return export_module(model, cfg.to_dict(), tok, out / "base.safetensors")


def ct2_export(source: Path, out: Path, quantization: str) -> Path:
    from aiayn.export.ct2 import export_ctranslate2

    return export_ctranslate2(source, out / f"ct2-{quantization}", quantization=quantization)


# ---- the table ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default=None, help="default: the recipe's averaged model")
    parser.add_argument("--src", default=str(DATA / "test_2016_flickr.de.gz"))
    parser.add_argument("--ref", default=str(DATA / "test_2016_flickr.en.gz"))
    parser.add_argument("--base", action="store_true", help="transformer_base, random weights")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--limit", type=int, default=None, help="the first N sentences only")
    parser.add_argument("--quantizations", default=",".join(QUANTIZATIONS))
    parser.add_argument("--no-greedy", action="store_true", help="leave out the beam-1 rows")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0

    if args.checkpoint is None:
        averaged = sorted((ROOT / "runs/multi30k_de_en").glob("average_last*"))
        args.checkpoint = str(averaged[-1] if averaged else ROOT / "runs/multi30k_de_en")
    source = Path(args.checkpoint)
    if not args.base and not source.exists():  # --base needs no trained model
        sys.exit(f"{source} not found: train it with `make multi30k`, or pass --checkpoint")
    for path in (args.src,) + (() if args.base else (args.ref,)):
        if not Path(path).is_file():
            sys.exit(f"{path} not found: the Multi30k files are in ../shared/data/multi30k")
    with tempfile.TemporaryDirectory(prefix="aiayn-serving-") as tmp:
        tmp = Path(tmp)
        if args.base:
            from aiayn.config import load_config

            tokenizer = load_config(ROOT / "configs/multi30k_de_en.yaml").tokenizer_path
            if not (ROOT / tokenizer).is_file():
                sys.exit(
                    f"--base uses the Multi30k recipe's vocabulary, {tokenizer}: make it with "
                    "`aiayn tokenizer train --config configs/multi30k_de_en.yaml`"
                )
            source = random_base(ROOT / tokenizer, tmp)
        models = {"aiayn": source}
        for q in args.quantizations.split(","):
            models[f"ct2 {q}"] = ct2_export(source, tmp, q)
        beams = [args.beam] + ([] if args.no_greedy or args.beam == 1 else [1])
        contenders = [(name, beam) for beam in beams for name in models]
        results: dict[tuple[str, int], list[dict]] = {c: [] for c in contenders}
        for r in range(args.repeats):
            for name, beam in rotated(contenders, r):
                results[(name, beam)].append(run_worker(args, name, models[name], beam))
        print(report(args, results))
    return 0


def run_worker(args, name: str, model: Path, beam: int) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        name.split()[0],
        "--model",
        str(model),
        "--src",
        args.src,
        "--beam",
        str(beam),
        "--batch-size",
        str(args.batch_size),
        "--threads",
        str(args.threads),
    ] + (["--limit", str(args.limit)] if args.limit else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        sys.exit(f"{name} (beam {beam}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(args, results: dict[tuple[str, int], list[dict]]) -> str:
    import statistics

    from aiayn.eval.scores import translation_scores

    refs = None if args.base else read_lines(Path(args.ref))[: args.limit]
    n = len(read_lines(Path(args.src))[: args.limit])
    speed = {
        c: statistics.median(r["tokens"] / r["seconds"] for r in runs)
        for c, runs in results.items()
    }
    rows = []
    for (name, beam), runs in results.items():
        med_s = statistics.median(r["seconds"] for r in runs)
        hyps = runs[0]["hyps"]
        same = sum(a == b for a, b in zip(hyps, results[("aiayn", beam)][0]["hyps"], strict=True))
        bleu = "-" if refs is None else f"{translation_scores(hyps, refs)['bleu']:.2f}"
        rows.append(
            [
                name,
                str(beam),
                fmt(n / med_s, 1),
                fmt(speed[(name, beam)]),
                f"{speed[(name, beam)] / speed[('aiayn', beam)]:.2f}x",
                fmt(max(r["peak_mib"] for r in runs)),
                fmt(max(r["model_mib"] for r in runs)),
                bleu,
                f"{same}/{n}",
            ]
        )
    header = [
        "engine",
        "beam",
        "sentences/s",
        "target tokens/s",
        "vs aiayn",
        "peak RSS MiB",
        "model+decode MiB",
        "BLEU",
        "same as aiayn",
    ]
    what = "transformer_base, random weights" if args.base else args.checkpoint
    lines = [
        f"### {what}: {n} sentences, batch {args.batch_size}, {args.threads} threads, "
        f"{args.repeats} repeats interleaved (medians)",
        "",
        f"{machine()}",
        "",
        markdown_table(header, rows),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
