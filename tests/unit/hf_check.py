"""Run `aiayn export --format hf` directories through transformers, for test_export_hf.py.

Runs in the benchmarks' venv (transformers never enters the training venv), so it imports
nothing from aiayn: it loads each directory with from_pretrained, as a user would, and reports
what the model and tokenizer compute. test_export_hf.py compares that with the project.

    python hf_check.py CASES.json RESULTS.json

CASES.json: a list of {"dir", "kind" (seq2seq or lm), "texts", "decode_ids", "src" (seq2seq:
source ids with eos), "tgt" (decoder inputs: bos + target for seq2seq; eos + text for lm),
"keep_positions" (re-save with the position table, see below)}.
RESULTS.json: {dir: {"class", "tokenizer_class", "tokenizer_ids", "decoded", "logprobs" (each
tgt row's log-softmax, (len, V)), "greedy" (ids after the start token or prompt, cut at eos),
"resaved_logprobs"}}. Exit status 3 if transformers is missing.
"""

import json
import sys
import tempfile

try:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer
except ImportError as exc:
    print(f"hf_check.py: {exc}", file=sys.stderr)
    sys.exit(3)


def padded(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(rows), max(map(len, rows))), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        mask[i, : len(row)] = 1
    return ids, mask


def cut(row: list[int], eos_id: int) -> list[int]:
    return row[: row.index(eos_id)] if eos_id in row else row


@torch.no_grad()
def logprobs(model, case: dict, pad_id: int) -> list:
    tgt, tgt_mask = padded(case["tgt"], pad_id)
    if case["kind"] == "seq2seq":
        src, src_mask = padded(case["src"], pad_id)
        logits = model(
            input_ids=src,
            attention_mask=src_mask,
            decoder_input_ids=tgt,
            decoder_attention_mask=tgt_mask,
        ).logits
    else:
        logits = model(input_ids=tgt, attention_mask=tgt_mask).logits
    lp = torch.log_softmax(logits.float(), dim=-1)
    return [lp[i, : len(row)].tolist() for i, row in enumerate(case["tgt"])]


@torch.no_grad()
def greedy(model, tok, case: dict) -> list[list[int]]:
    """What a user gets from the tokenizer and generate() with the exported generation config
    (greedy; the length limit is its max_length)."""
    eos = model.generation_config.eos_token_id
    if case["kind"] == "seq2seq":
        enc = tok(case["texts"], padding=True, return_tensors="pt")
        out = model.generate(**enc, num_beams=1, do_sample=False)
        return [cut(row[1:], eos) for row in out.tolist()]
    rows = []
    for text in case["texts"]:  # one at a time: a batch would need left padding
        enc = tok([text], return_tensors="pt")
        out = model.generate(**enc, num_beams=1, do_sample=False)
        rows.append(cut(out[0, enc.input_ids.size(1) :].tolist(), eos))
    return rows


def check(case: dict) -> dict:
    auto = AutoModelForSeq2SeqLM if case["kind"] == "seq2seq" else AutoModelForCausalLM
    model = auto.from_pretrained(case["dir"]).eval()
    tok = AutoTokenizer.from_pretrained(case["dir"])
    pad_id = model.config.pad_token_id
    result = {
        "class": type(model).__name__,
        "tokenizer_class": type(tok).__name__,
        "tokenizer_ids": tok(case["texts"]).input_ids,
        "decoded": tok.batch_decode(case["decode_ids"], skip_special_tokens=True),
        "logprobs": logprobs(model, case, pad_id),
        "greedy": greedy(model, tok, case),
    }
    with tempfile.TemporaryDirectory() as tmp:
        if case["keep_positions"]:
            # MarianMTModel leaves its position tables out of save_pretrained (they are its
            # fixed sinusoids); a learned table must be kept explicitly.
            model._keys_to_ignore_on_save = None
        model.save_pretrained(tmp)
        resaved = auto.from_pretrained(tmp).eval()
        result["resaved_logprobs"] = logprobs(resaved, case, pad_id)
    return result


def main() -> None:
    cases_path, results_path = sys.argv[1:3]
    with open(cases_path) as fh:
        cases = json.load(fh)
    results = {case["dir"]: check(case) for case in cases}
    with open(results_path, "w") as fh:
        json.dump(results, fh)


if __name__ == "__main__":
    main()
