"""Beam search of an `aiayn export --format hf` directory through transformers' generate.

    python benchmarks/hf_generate.py --model EXPORT_DIR --input test.de.gz --device cuda

The serving-side counterpart of benchmarks/decode_speed.py: the same sentences, beam and
batch size, timed the same way (a first batch untimed, then the whole input, --repeats times,
median). Needs transformers (pip install .[bench]); imports nothing from aiayn. With --compare
HYP_FILE (one hypothesis a line, e.g. `aiayn translate`'s output), prints the share of
sentences where the two agree.
"""

from __future__ import annotations

import argparse
import gzip
import statistics
import time


def read_lines(path: str, limit: int | None) -> list[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return [line.rstrip("\n") for line in fh][:limit]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--input", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument(
        "--max-new-tokens", type=int, default=None, help="default: the export's generation_config"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--compare", default=None)
    args = p.parse_args()

    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model).to(args.device).eval()
    lines = read_lines(args.input, args.limit)

    def translate(batch: list[str]) -> list[str]:
        enc = tok(batch, return_tensors="pt", padding=True).to(args.device)
        with torch.inference_mode():
            limit = {} if args.max_new_tokens is None else {"max_new_tokens": args.max_new_tokens}
            out = model.generate(**enc, num_beams=args.beam, do_sample=False, **limit)
        return tok.batch_decode(out, skip_special_tokens=True)

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    translate(lines[: args.batch_size])
    runs = []
    for _ in range(args.repeats):
        sync()
        start = time.perf_counter()
        hyps = [
            h
            for i in range(0, len(lines), args.batch_size)
            for h in translate(lines[i : i + args.batch_size])
        ]
        sync()
        runs.append(time.perf_counter() - start)
    tokens = sum(len(tok(text_target=h)["input_ids"]) - 1 for h in hyps)  # eos not counted
    seconds = statistics.median(runs)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(
        f"transformers {model.__class__.__name__} on {name}: {len(lines)} sentences, "
        f"beam {args.beam}, batch {args.batch_size}"
    )
    print("| sentences/s | target tokens/s | seconds (min - max) |")
    print("| --- | --- | --- |")
    print(
        f"| {len(lines) / seconds:.1f} | {tokens / seconds:,.0f} | {seconds:.2f} "
        f"({min(runs):.2f} - {max(runs):.2f}) |"
    )
    if args.compare:
        ref = read_lines(args.compare, args.limit)
        same = sum(a == b for a, b in zip(hyps, ref, strict=False))
        print(f"same hypothesis as {args.compare}: {same} of {len(ref)}")


if __name__ == "__main__":
    main()
