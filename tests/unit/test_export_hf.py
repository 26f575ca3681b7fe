"""`aiayn export --format hf`: transformers computes what the project computes.

The tiny models are exported here, in the training venv, and loaded by hf_check.py in the
benchmarks' venv (transformers never enters this one). Its log-softmax must equal the project's
within 1e-4 at every position and vocabulary entry, and its greedy outputs token for token.
Those tests share one export of every case and one run of the checker (about a minute), so they
are marked slow."""

import json
import sys
from pathlib import Path

import pytest
import torch
from bench_venv import require_bench_venv, run_in_bench_venv  # tests/bench_venv.py
from export_models import variant_id, write_model
from safetensors import safe_open

from aiayn.checkpoint.inference import load_for_inference
from aiayn.errors import ExportError
from aiayn.export import export_model
from aiayn.export.bart_layout import marian_permutation as _marian_permutation
from aiayn.export.reader import sinusoid_table
from aiayn.infer.decode import generate, greedy_search

CHECKER = Path(__file__).with_name("hf_check.py")
TOL = 1e-4

MARIAN = ("model.activation=swish", "model.attention_bias=true", "model.output_bias=true")
# (kind, norm, positions, *overrides) of every model the export must write exactly.
EXACT = [
    ("seq2seq", "post", "sinusoidal"),
    ("seq2seq", "post", "learned"),
    ("seq2seq", "post", "sinusoidal", "model.share_embeddings=decoder"),
    ("seq2seq", "post", "sinusoidal", "model.share_embeddings=none", "model.decoder_layers=1"),
    ("lm", "post", "sinusoidal"),
    ("lm", "post", "learned"),
    ("lm", "pre", "sinusoidal"),
    ("lm", "pre", "learned", "model.share_embeddings=none"),
    # Marian's options (an imported OPUS-MT model's): swish, biases in attention and on the
    # output (final_logits_bias), the sines-then-cosines table (no permutation needed)
    ("seq2seq", "post", "sinusoidal_concat", *MARIAN),
    ("seq2seq", "post", "sinusoidal", *MARIAN, "model.share_embeddings=none"),
    ("lm", "post", "sinusoidal_concat", "model.activation=swish", "model.attention_bias=true"),
]


def case_id(case) -> str:
    return "-".join([*case[:3], *(o.split(".")[-1] for o in case[3:])])


# Text off the tokenizer's corpus: capitals, punctuation, runs of spaces, a character NFKC
# rewrites (½), one it has never seen (€, unk).
ODD = "Vierzig,  bitte!  ½ € ok?"


def texts(corpus: Path, lm_corpus: Path, kind: str) -> list[str]:
    if kind == "seq2seq":
        return corpus.joinpath("test.de").read_text().splitlines()[:4] + [ODD]
    # Prompts of a few words: the greedy continuation then has room before max_len.
    lines = lm_corpus.joinpath("test.txt").read_text().splitlines()
    return [" ".join(line.split()[:n]) for line, n in zip(lines, (3, 5, 8), strict=False)] + [ODD]


@torch.no_grad()
def reference(weights: Path, kind: str, lines: list[str], targets: list[str]) -> dict:
    """The project's view of the case: ids, log-softmax of every target row, greedy outputs."""
    cfg, model, tok, _ = load_for_inference(weights, (), "cpu")
    ids = tok.encode(lines)
    if kind == "seq2seq":
        src = [row + [tok.eos_id] for row in ids]
        tgt = [[tok.bos_id] + row for row in tok.encode(targets)]
        src_t, tgt_t = pad(src, tok.pad_id), pad(tgt, tok.pad_id)
        logits = model(src_t, tgt_t)
        # max_len_b past the position table: every limit is max_len - 1, HF's max_length.
        special = dict(bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id)
        greedy = greedy_search(model, src_t, max_len_b=1000, **special)
        expected_ids = src
    else:
        src = None
        tgt = [[tok.eos_id] + row for row in tok.encode(targets)]
        logits = model(pad(tgt, tok.pad_id))
        prompts = [[tok.eos_id] + row for row in ids]
        greedy = [
            generate(
                model,
                [p],
                max_new_tokens=cfg.model.max_len - len(p),
                temperature=0.0,
                eos_id=tok.eos_id,
            )[0]
            for p in prompts
        ]
        expected_ids = prompts
    lp = torch.log_softmax(logits, dim=-1)
    return {
        "ids": expected_ids,
        "src": src,
        "tgt": tgt,
        "logprobs": [lp[i, : len(row)] for i, row in enumerate(tgt)],
        "greedy": greedy,
        # transformers drops unk when skipping special tokens, SentencePiece writes " ⁇ ".
        "decode_ids": [row for row in ids if tok.unk_id not in row],
        "decoded": tok.decode([row for row in ids if tok.unk_id not in row]),
    }


def pad(rows: list[list[int]], pad_id: int) -> torch.Tensor:
    out = torch.full((len(rows), max(map(len, rows))), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row)
    return out


@pytest.fixture(scope="module")
def checked(tok, corpus, lm_corpus, tmp_path_factory):
    """Every EXACT case exported, its reference computed, and hf_check.py's results."""
    require_bench_venv("run the HF check")
    root = tmp_path_factory.mktemp("hf")
    cases, refs = [], {}
    for case in EXACT:
        kind, *_ = case
        weights = write_model(root / case_id(case), tok, *case)
        out = root / f"{case_id(case)}-hf"
        export_model(weights, out, "hf")
        lines = texts(corpus, lm_corpus, kind)
        targets = (
            corpus.joinpath("test.en").read_text().splitlines()[:5]
            if kind == "seq2seq"
            else lm_corpus.joinpath("test.txt").read_text().splitlines()[3:6]
        )
        if kind == "lm":  # rows of at most max_len (64) tokens, eos first
            targets = [" ".join(t.split()[:20]) for t in targets]
        ref = reference(weights, kind, lines, targets)
        refs[case_id(case)] = ref
        cases.append(
            {
                "dir": str(out),
                "kind": kind,
                "texts": lines,
                "decode_ids": ref["decode_ids"],
                "src": ref["src"],
                "tgt": ref["tgt"],
                "keep_positions": kind == "seq2seq" and "learned" in case,
            }
        )
    cases_path, results_path = root / "cases.json", root / "results.json"
    cases_path.write_text(json.dumps(cases))
    run_in_bench_venv(CHECKER, str(cases_path), str(results_path))
    results = json.loads(results_path.read_text())
    return {
        case_id(c): (refs[case_id(c)], results[d["dir"]]) for c, d in zip(EXACT, cases, strict=True)
    }


def max_diff(ours: list[torch.Tensor], theirs: list) -> float:
    return max(float((a - torch.tensor(b)).abs().max()) for a, b in zip(ours, theirs, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("case", EXACT, ids=case_id)
def test_transformers_scores_as_the_project_does(checked, case):
    ref, hf = checked[case_id(case)]
    assert hf["class"] == ("MarianMTModel" if case[0] == "seq2seq" else "OPTForCausalLM")
    assert [len(r) for r in hf["logprobs"]] == [len(r) for r in ref["tgt"]]
    diff = max_diff(ref["logprobs"], hf["logprobs"])
    print(f"{case_id(case)}: max |d log-prob| {diff:.2e}")
    assert diff < TOL
    # A model saved again by transformers (fine-tuned, say) still is the same model.
    assert max_diff(ref["logprobs"], hf["resaved_logprobs"]) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("case", EXACT, ids=case_id)
def test_transformers_greedy_output_is_the_projects(checked, case):
    ref, hf = checked[case_id(case)]
    assert hf["greedy"] == ref["greedy"]
    assert all(len(row) > 5 for row in ref["greedy"])  # decoding went somewhere to compare


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["seq2seq", "lm"])
def test_transformers_tokenizer_gives_the_projects_ids(checked, kind):
    """A translation source ends in eos (evaluate.translate); an lm text starts after one
    (lm_eval.sample); decoding gives the project's text back."""
    ref, hf = checked[case_id(next(c for c in EXACT if c[0] == kind))]
    assert hf["tokenizer_ids"] == ref["ids"]
    assert len(hf["decoded"]) == len(ref["decode_ids"]) >= 3
    assert hf["decoded"] == ref["decoded"]


def test_permutation_maps_the_project_sinusoid_onto_marians():
    """Marian's table (modeling_marian.py: sin of every frequency, then cos), computed here as
    transformers does, is the project's with the d_model axis permuted."""
    d, rows = 10, 7
    pos = torch.arange(rows, dtype=torch.float64)[:, None]
    freq = 10000 ** (-2 * torch.arange(d // 2, dtype=torch.float64) / d)
    marian = torch.cat([torch.sin(pos * freq), torch.cos(pos * freq)], dim=1)
    ours = sinusoid_table(d, rows)
    assert torch.allclose(ours[:, _marian_permutation(d)].double(), marian, atol=1e-6)
    assert not torch.allclose(ours.double(), marian, atol=1e-2)


@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_pre_ln_translation_is_refused_naming_ctranslate2(tok, tmp_path, positions):
    weights = write_model(tmp_path / "m", tok, "seq2seq", "pre", positions)
    out = tmp_path / "hf"
    with pytest.raises(ExportError, match=r"pre-LN.*--format ctranslate2"):
        export_model(weights, out, "hf")
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temporary directory left either


@pytest.mark.parametrize(
    "variant", [("seq2seq", "post", "sinusoidal"), ("lm", "pre", "learned")], ids=variant_id
)
def test_directory_holds_what_from_pretrained_reads(tok, tmp_path, variant):
    weights = write_model(tmp_path / "m", tok, *variant)
    out = export_model(weights, tmp_path / "hf", "hf", dtype="bf16")
    seq2seq = variant[0] == "seq2seq"
    tokenizer_files = ["source.spm", "target.spm", "vocab.json"] if seq2seq else ["tokenizer.model"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json"]
        + tokenizer_files
    )
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    tokenizer = json.loads((out / "tokenizer_config.json").read_text())
    assert config["dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        assert {fh.get_tensor(k).dtype for k in fh.keys()} == {torch.bfloat16}
        names = set(fh.keys())
    if seq2seq:
        assert (config["model_type"], config["architectures"]) == ("marian", ["MarianMTModel"])
        assert generation["decoder_start_token_id"] == tok.bos_id == 2
        assert tokenizer["tokenizer_class"] == "MarianTokenizer"
        vocab = json.loads((out / "vocab.json").read_text())
        assert [vocab[tok.sp.id_to_piece(i)] for i in range(tok.vocab_size)] == list(
            range(tok.vocab_size)
        )
        assert "model.shared.weight" in names
    else:
        assert (config["model_type"], config["architectures"]) == ("opt", ["OPTForCausalLM"])
        assert config["do_layer_norm_before"] is True and config["tie_word_embeddings"] is False
        assert generation["bos_token_id"] == tok.eos_id  # the lm's start token
        assert {"lm_head.weight", "model.decoder.final_layer_norm.weight"} <= names
    assert generation["eos_token_id"] == 3 and generation["pad_token_id"] == 0
    assert generation["max_length"] == 64 and generation["forced_eos_token_id"] is None
    assert sys.modules.get("transformers") is None  # written without it


def test_learned_translation_positions_warn_that_save_pretrained_drops_them(tok, tmp_path, caplog):
    weights = write_model(tmp_path / "m", tok, "seq2seq", "post", "learned")
    export_model(weights, tmp_path / "hf", "hf")
    assert "_keys_to_ignore_on_save = None" in caplog.text
    caplog.clear()
    weights = write_model(tmp_path / "s", tok, "seq2seq", "post", "sinusoidal")
    export_model(weights, tmp_path / "hf-s", "hf")
    assert "save_pretrained" not in caplog.text
