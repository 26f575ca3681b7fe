"""Fine-tune a public OPUS-MT model on Multi30k, end to end, and its table.

    python launch/opus_mt.py [--model Helsinki-NLP/opus-mt-de-en] [--config FILE] [key=value ...]

--model: a hub name (downloaded by `aiayn import-hf`; needs the internet) or a MarianMT
directory. Stages, each the `aiayn` command a user would type (printed before it runs):
  0. corpus     ../shared/data/multi30k where it is there, else `aiayn data download multi30k`
                into data/corpora/multi30k, given to the stages below as overrides
  1. import     `aiayn import-hf MODEL --output RUN.safetensors`: the weights, both
                SentencePiece models and the vocabulary, exactly (docs/fine_tuning.md#opus-mt)
  2. before     `aiayn evaluate` of the imported model on test_2016_flickr (beam 4)
  3. fine-tune  `aiayn train --config configs/opus_mt_de_en_multi30k.yaml init.source=...`:
                Multi30k train at a constant small rate; the shape and tokenizer are the model's
  4. finish     `aiayn finish RUN --last K`: the last K checkpoints averaged and scored
It prints the model's parameters, the import time, the BLEU before and after and each stage's
wall time. An interrupted run resumes where it stopped (the import is kept; `aiayn train`
resumes run_dir). key=value overrides go to the fine-tune (e.g. train.max_steps=1000).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from aiayn.config import load_config

from stages import ROOT, Stages, corpus_overrides, main_guard, run  # launch/stages.py


def parameters(weights: Path) -> int:
    """The model's parameters, a tied matrix once (as `aiayn params` counts)."""
    from aiayn.checkpoint.inference import load_for_inference

    _, model, _, _ = load_for_inference(weights, (), "cpu")
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="Helsinki-NLP/opus-mt-de-en")
    parser.add_argument("--config", default="configs/opus_mt_de_en_multi30k.yaml")
    parser.add_argument("--average", type=int, help="K (default: the config's keep_last)")
    parser.add_argument("overrides", nargs="*", help="key=value, given to the fine-tune")
    args = parser.parse_args(argv)

    cfg = load_config(ROOT / args.config, args.overrides)  # validated before any stage runs
    stage = Stages()
    with stage("corpus"):
        overrides = [*corpus_overrides("multi30k", cfg), *args.overrides]
    cfg = load_config(ROOT / args.config, overrides)  # reading the corpus found
    run_dir = ROOT / cfg.run_dir
    imported = ROOT / cfg.init.source
    common = ["--config", args.config, f"init.source={cfg.init.source}", *overrides]
    test = [f"data.test={cfg.data.test}", f"data.src_lang={cfg.data.src_lang}"]
    test += [f"data.tgt_lang={cfg.data.tgt_lang}", f"decode.beam={cfg.decode.beam}"]
    k = args.average or cfg.checkpoint.keep_last
    with stage("import"):
        if imported.is_file():
            print(f"{imported} exists: kept")
        else:
            run(["import-hf", args.model, "--output", str(imported)])
    with stage("before"):
        out = run(
            ["evaluate", "--checkpoint", str(imported), "--split", "test", "--json", *test], True
        )
        before = json.loads(out)
    with stage("fine-tune"):
        run(["train", *common])
    with stage("finish"):
        after = json.loads(run(["finish", str(run_dir), "--last", str(k)], True))["scores"]["test"]
    stage.done()

    print(f"\n{args.model} fine-tuned on Multi30k de->en ({args.config}, {run_dir})\n")
    print(f"parameters: {parameters(imported):,}; import: {stage.times['import']:.1f} s")
    print("\n| stage | wall time |\n| --- | ---: |")
    for name, seconds in stage.times.items():
        print(f"| {name} | {seconds / 60:.1f} min |")
    print(
        f"\n| test_2016_flickr (beam {cfg.decode.beam}) | BLEU lowercased | BLEU cased | chrF |"
        "\n| --- | ---: | ---: | ---: |"
    )
    for name, r in (("imported", before), (f"fine-tuned, average of last {k}", after)):
        print(f"| {name} | {r['bleu_lc']:.2f} | {r['bleu']:.2f} | {r['chrf']:.2f} |")
    print(f"\ncased: {after['bleu_signature']}")
    return 0


if __name__ == "__main__":
    main_guard("opus_mt", main)
