"""Translation speed of `aiayn translate` (evaluate.translate: beam or greedy search), CPU or GPU.

    python benchmarks/decode_speed.py --checkpoint runs/multi30k_de_en/averaged \\
        --input ../shared/data/multi30k/test_2016_flickr.de.gz --beam 4 1 --threads 2
    python benchmarks/decode_speed.py ... --baseline OLD_CHECKOUT/src   # old code against new

Each code tree (this checkout's src, and any --baseline src directories) runs in a worker
process of its own that loads the checkpoint once, then translates the input when asked. The
workers take turns, in an order rotated each repeat, so a busy machine's slow phases fall on
all of them alike; the table gives sentences/s and target tokens/s (hypotheses re-encoded by
the model's tokenizer, eos not counted) as the median of the repeats (min - max), the ratio
of medians to the first row of the same beam (the first baseline, if any), and whether the
hypotheses equal that row's.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def read_lines(path: str, limit: int | None) -> list[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        lines = [line.rstrip("\n") for line in fh]
    return lines[:limit]


def worker(args: argparse.Namespace) -> None:
    """Load the model with the code of args.worker, then translate the input once for each
    beam size read from stdin, answering one JSON line per request."""
    sys.path.insert(0, args.worker)
    import torch

    from aiayn.checkpoint.inference import load_for_inference
    from aiayn.infer.translate import translate

    torch.set_num_threads(args.threads)
    overrides = [f"decode.batch_size={args.batch_size}", *args.set]
    device = torch.device(args.device)
    cfg, model, tok, _ = load_for_inference(args.checkpoint, overrides, args.device)
    lines = read_lines(args.input, args.limit)

    def sync() -> None:  # the translation's last tokens come back to the host anyway; to be sure
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    warm: set[int] = set()
    for request in sys.stdin:
        beam = int(request)
        dcfg = dataclasses.replace(cfg.decode, beam=beam)
        if beam not in warm:  # the first batch once, untimed
            translate(model, tok, lines[: args.batch_size], dcfg, device)
            warm.add(beam)
        sync()
        start = time.perf_counter()
        hyps = translate(model, tok, lines, dcfg, device)
        sync()
        seconds = time.perf_counter() - start
        tokens = sum(map(len, tok.encode(hyps)))
        print(json.dumps({"seconds": seconds, "tokens": tokens, "hyps": hyps}), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="run dir, checkpoint dir or export")
    p.add_argument("--input", required=True, help="source sentences, one a line (.gz too)")
    p.add_argument("--beam", type=int, nargs="+", default=[4, 1], help="1: greedy search")
    p.add_argument("--batch-size", type=int, default=32, help="sentences per batch")
    p.add_argument("--threads", type=int, default=2, help="torch threads of every worker")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--limit", type=int, default=None, help="first N sentences only")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--baseline", action="append", default=[], help="another checkout's src to compare"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        help="config override KEY=VALUE, e.g. "
        "tokenizer.path=... for a step checkpoint, which does not carry its tokenizer",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)

    from _common import interleaved, machine, markdown_table, set_threads, summary

    set_threads(args.threads)
    srcs = {f"baseline {i + 1}": src for i, src in enumerate(args.baseline)}
    srcs["this checkout"] = str(HERE.parents[1] / "src")
    common = [
        f"--checkpoint={args.checkpoint}",
        f"--input={args.input}",
        f"--batch-size={args.batch_size}",
        f"--threads={args.threads}",
        f"--device={args.device}",
        *([f"--limit={args.limit}"] if args.limit else []),
        *(f"--set={item}" for item in args.set),
    ]
    workers = {
        name: subprocess.Popen(
            [sys.executable, str(HERE), f"--worker={src}", *common],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for name, src in srcs.items()
    }

    def ask(name: str, beam: int) -> dict:
        proc = workers[name]
        proc.stdin.write(f"{beam}\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"the worker for {name} ({srcs[name]}) failed")
        return json.loads(line)

    where = machine()
    if args.device == "cuda":
        import torch

        where = f"{torch.cuda.get_device_name()}, torch {torch.__version__}; host {where}"
    print(f"Machine: {where}")
    print(
        f"Input: {args.input}, {len(read_lines(args.input, args.limit))} sentences, batch "
        f"{args.batch_size}; checkpoint {args.checkpoint}; {args.repeats} repeats\n"
    )
    header = ["code", "beam", "sentences/s", "target tokens/s", "ratio", "same hypotheses"]
    rows = []
    n_lines = len(read_lines(args.input, args.limit))
    try:
        for beam in args.beam:
            runs = interleaved(
                {name: (lambda name=name, beam=beam: ask(name, beam)) for name in workers},
                args.repeats,
            )
            first = None
            for name, results in runs.items():
                sent = [n_lines / r["seconds"] for r in results]
                toks = [r["tokens"] / r["seconds"] for r in results]
                med, lo, hi = summary(sent)
                tmed, tlo, thi = summary(toks)
                first = first or (med, results[0]["hyps"])
                same = results[0]["hyps"] == first[1]
                rows.append(
                    [
                        f"{name} ({srcs[name]})",
                        str(beam),
                        f"{med:.1f} ({lo:.1f} - {hi:.1f})",
                        f"{tmed:,.0f} ({tlo:,.0f} - {thi:,.0f})",
                        f"{med / first[0]:.2f}",
                        "yes" if same else "NO",
                    ]
                )
    finally:
        for proc in workers.values():
            proc.stdin.close()
            proc.wait()
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
