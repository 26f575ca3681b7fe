"""The smallest seq2seq run on the numbers corpus that still exercises the whole trainer."""

from helpers import TINY_MODEL, model_overrides  # tests/helpers.py


def overrides(run_dir, corpus, *extra: str) -> list[str]:
    return [
        f"run_dir={run_dir}",
        f"data.train={corpus}/train",
        "data.src_lang=en",
        "data.tgt_lang=de",
        "data.max_len=40",
        "data.shuffle_buffer=500",
        *model_overrides(TINY_MODEL),
        "tokenizer.vocab_size=100",
        "train.max_tokens=800",
        "schedule.warmup=10",
        *extra,
    ]
