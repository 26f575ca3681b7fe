"""Sampling continuations of prompts from a language model, the way it read text in training:
what `aiayn generate`, validation's samples and the CTranslate2 export's generation share."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from aiayn.tokenizer import Tokenizer


def sample_text(
    model: nn.Module,
    tok: Tokenizer,
    prompts: list[str],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
    running_text: bool = False,
) -> list[str]:
    """Sample a continuation of each prompt. running_text (data.lm_order stream): eos is a
    line break, so a prompt's lines are joined by eos, sampling runs to max_new_tokens, and
    the prompt and its continuation come back as one text with each eos a newline. Otherwise
    eos ends a document, the sample stops there, and only the continuation comes back. Every
    prompt starts after an eos, as every document or text does in training."""
    from aiayn.infer.decode import generate  # the model package is imported only to sample

    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    sample = dict(temperature=temperature, top_k=top_k, generator=gen)

    def step(context: list[list[int]], n: int, eos_id: int | None) -> list[list[int]]:
        return generate(model, context, max_new_tokens=n, eos_id=eos_id, **sample)

    return continue_texts(
        tok, prompts, step, max_new_tokens, running_text=running_text, window=model.cfg.max_len
    )


ContinueStep = Callable[[list[list[int]], int, int | None], list[list[int]]]
"""(context ids per row, n, eos_id) -> up to n new ids per row, stopping at eos_id (not
returned) unless it is None: one call of an engine's generation."""


def prompt_ids(tok: Tokenizer, prompts: list[str], running_text: bool) -> list[list[int]]:
    """Each prompt as the lm reads it in training: after an eos; in a running text, its lines
    joined by eos."""
    ids = []
    for prompt in prompts:
        row = [tok.eos_id]
        for line in tok.encode(prompt.split("\n")) if running_text else tok.encode([prompt]):
            row += line + [tok.eos_id]
        ids.append(row[:-1] if prompt else row)  # a prompt goes on from its last token
    return ids


def continue_texts(
    tok: Tokenizer,
    prompts: list[str],
    step: ContinueStep,
    max_new_tokens: int,
    *,
    running_text: bool,
    window: int,
) -> list[str]:
    """sample_text's texts with generation left to `step`, so that every engine (torch,
    CTranslate2) reads prompts and writes texts alike. window: the most positions the model
    was trained on (model.max_len), which a running text's rounds stay within."""
    ids = prompt_ids(tok, prompts, running_text)
    if not running_text:
        return tok.decode(step(ids, max_new_tokens, tok.eos_id))
    # A running text may go on past the position table: in rounds, each continuing from the
    # last half-window of what came before.
    keep = window // 2
    out = [[] for _ in ids]
    context = [row[-keep:] for row in ids]
    while len(out[0]) < max_new_tokens:
        n = min(max_new_tokens - len(out[0]), window - max(map(len, context)))
        new = step(context, n, None)
        for row, ctx, more in zip(out, context, new, strict=True):
            row += more
            ctx[:] = (ctx + more)[-keep:]
    texts = []
    for start, row in zip(ids, out, strict=True):
        lines, line = [], []
        for i in start[1:] + row:
            if i == tok.eos_id:
                lines.append(line)
                line = []
            else:
                line.append(i)
        texts.append("\n".join(tok.sp.decode(lines + [line])))
    return texts
