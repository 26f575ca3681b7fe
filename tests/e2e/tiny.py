"""The smallest seq2seq run on the numbers corpus that still exercises the whole trainer."""


def overrides(run_dir, corpus, *extra: str) -> list[str]:
    return [
        f"run_dir={run_dir}",
        f"data.train={corpus}/train",
        "data.src_lang=en",
        "data.tgt_lang=de",
        "data.max_len=40",
        "data.shuffle_buffer=500",
        "model.N=1",
        "model.d_model=32",
        "model.d_ff=64",
        "model.h=2",
        "model.max_len=64",
        "tokenizer.vocab_size=100",
        "train.max_tokens=800",
        "schedule.warmup=10",
        *extra,
    ]
