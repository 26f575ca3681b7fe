"""`aiayn import-hf`: a MarianMT (OPUS-MT layout) directory becomes an aiayn model that
computes what transformers computes, with MarianTokenizer's ids under the vocabulary map.

marian_build.py makes the directories in the benchmarks' venv, as a user downloads them: two
SentencePiece models trained on the demo corpus, an OPUS vocab.json (</s> 0, <unk> 1, <pad>
last), random MarianMTModels (swish and tied, saved by save_pretrained as safetensors; relu and
untied, a pytorch_model.bin) with every bias, LayerNorm and final_logits_bias randomised. The
round trip from aiayn's own export and the refusals need no transformers."""

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench_venv import require_bench_venv, run_in_bench_venv  # tests/bench_venv.py
from export_models import write_model
from safetensors.torch import load_file

from aiayn.checkpoint.average import export_paths
from aiayn.checkpoint.inference import load_for_inference
from aiayn.errors import ExportError
from aiayn.export import export_model
from aiayn.export.hf_import import import_hf
from aiayn.infer.beam import beam_search
from aiayn.infer.decode import greedy_search

BUILDER = Path(__file__).with_name("marian_build.py")
TOL = 1e-4
VARIANTS = [
    {"name": "swish-tied", "activation": "swish", "tie": True, "weights": "safetensors"},
    {"name": "relu-untied", "activation": "relu", "tie": False, "weights": "bin"},
]
# Unknown characters (€ ½ on both sides; ß only in the source model: on the target side its
# piece is found in the joint vocabulary, as MarianTokenizer finds it), numbers, punctuation,
# a leading target-language code (split off before segmenting).
SRC_TEXTS = ["dreihundertvierzig", "Vierzig,  bitte!  ½ € ok?", "123 dreißig.", ">>en<< zwei"]
TGT_TEXTS = ["three hundred forty", "dreißig, please!", "x ½ 7?", "two and one"]
MAX_LEN_B = 5


def run_builder(mode: str, spec: dict, tmp: Path) -> dict:
    require_bench_venv("build MarianMT directories")
    spec_path, results = tmp / f"{mode}-spec.json", tmp / f"{mode}-results.json"
    spec_path.write_text(json.dumps(spec))
    run_in_bench_venv(BUILDER, mode, str(spec_path), str(results))
    return json.loads(results.read_text())


def texts_spec(**extra) -> dict:
    return {"src_texts": SRC_TEXTS, "tgt_texts": TGT_TEXTS, "max_len_b": MAX_LEN_B, **extra}


@pytest.fixture(scope="module")
def marian(corpus, tmp_path_factory):
    """{variant: (its directory, transformers' results, the imported FILE.safetensors)}."""
    root = tmp_path_factory.mktemp("marian")
    results = run_builder(
        "build", texts_spec(corpus=str(corpus), root=str(root), variants=VARIANTS), root
    )
    out = {}
    for v in VARIANTS:
        directory = root / v["name"]
        imported = import_hf(directory, root / f"{v['name']}.safetensors")
        out[v["name"]] = (directory, results[str(directory)], imported)
    return out


def to_marian(tok, ids: list[int]) -> list[int]:
    order = tok.bundle.order
    return [order[i] for i in ids]


def aiayn_inputs(tok, ref: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """aiayn's source (ids + eos) and decoder input (bos + target) of every text pair."""
    src = [torch.tensor([tok.encode([t])[0] + [tok.eos_id]]) for t in SRC_TEXTS]
    tgt = [torch.tensor([[tok.bos_id, *tok.encode([t], side="target")[0]]]) for t in TGT_TEXTS]
    return src, tgt


def marian_columns(tok, V: int) -> torch.Tensor:
    """aiayn's id of each Marian id (pad: aiayn's pad; its copy, bos, is the same row)."""
    cols = torch.empty(V, dtype=torch.long)
    cols[torch.tensor(tok.bundle.order[::-1])] = torch.arange(tok.vocab_size - 1, -1, -1)
    return cols


@pytest.mark.slow
def test_token_ids_are_marian_tokenizers_under_the_map(marian):
    _, ref, imported = marian["swish-tied"]
    _, _, tok, _ = load_for_inference(imported, (), "cpu")
    assert tok.type == "marian" and tok.vocab_size == len(ref["logits"][0][0]) + 1
    ours_src = [to_marian(tok, tok.encode([t])[0]) + [ref["eos"]] for t in SRC_TEXTS]
    ours_tgt = [to_marian(tok, ids) + [ref["eos"]] for ids in tok.encode(TGT_TEXTS, side="target")]
    assert ours_src == ref["src_ids"]
    assert ours_tgt == ref["tgt_ids"]
    unk = tok.bundle.specials["unk"]
    assert any(unk in row for row in ref["src_ids"])  # the unknown characters were there
    assert ref["src_ids"][3][0] == tok.bundle.vocab[">>en<<"]
    assert tok.encode(["ß"], side="target")[0] != [tok.unk_id] * len(tok.encode(["ß"])[0])


@pytest.mark.slow
def test_a_piece_only_the_source_model_knows_is_decoded_as_marian_tokenizer_does(marian):
    """The joint vocabulary lets the decoder emit a piece target.spm does not know: its word
    boundary mark (U+2581) is printed as a space, as MarianTokenizer prints it, not raw; an
    unknown is left out, as MarianTokenizer's skip_special_tokens leaves it out."""
    _, ref, imported = marian["swish-tied"]
    _, _, tok, _ = load_for_inference(imported, (), "cpu")
    ours = {m: a for a, m in enumerate(tok.bundle.order)}  # Marian's id -> aiayn's
    rows = [[ours[i] for i in row] for row in ref["decode_rows"]]
    assert len(rows) == 2, "the unit spec's models must have pieces only the source knows"
    texts = tok.decode(rows)
    assert texts == ref["decoded"]
    assert all("\u2581" not in text for text in texts)


@pytest.mark.slow
@pytest.mark.parametrize("variant", [v["name"] for v in VARIANTS])
def test_logits_and_greedy_output_are_marians(marian, variant):
    _, ref, imported = marian[variant]
    cfg, model, tok, _ = load_for_inference(imported, (), "cpu")
    assert cfg.model.activation == variant.split("-")[0]
    assert cfg.model.attention_bias and cfg.model.output_bias
    assert cfg.model.share_embeddings == ("all" if "tied" == variant.split("-")[1] else "none")
    V = len(ref["logits"][0][0])
    cols = marian_columns(tok, V)
    src, tgt = aiayn_inputs(tok, ref)
    worst = 0.0
    with torch.no_grad():
        for s, t, theirs in zip(src, tgt, ref["logits"], strict=True):
            ours = model(s, t)[0][:, cols]
            worst = max(worst, (ours - torch.tensor(theirs)).abs().max().item())
    assert worst < TOL
    for s, theirs in zip(src, ref["greedy"], strict=True):
        special = dict(bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id)
        ours = greedy_search(model, s, max_len_b=MAX_LEN_B, **special)[0]
        assert to_marian(tok, ours) == theirs
        assert len(theirs) > 0
    beams = beam_search(model, torch.cat([src[0], src[0]]), beam=4, **special)
    assert len(beams) == 2 and beams[0] == beams[1]  # beam search runs on the imported model


@pytest.mark.slow
def test_import_then_export_is_the_same_model_to_transformers(marian, tmp_path):
    dirs, refs = [], {}
    for name, (directory, ref, imported) in marian.items():
        out = export_model(imported, tmp_path / name, "hf")
        assert (out / "vocab.json").read_bytes() == (directory / "vocab.json").read_bytes()
        assert (out / "source.spm").read_bytes() == (directory / "source.spm").read_bytes()
        config = json.loads((out / "config.json").read_text())
        assert (
            config["pad_token_id"] == ref["pad"]
            and config["decoder_start_token_id"] == ref["start"]
        )
        dirs.append(str(out))
        refs[str(out)] = ref
    again = run_builder("check", texts_spec(dirs=dirs), tmp_path)
    for d, ref in refs.items():
        assert again[d]["src_ids"] == ref["src_ids"] and again[d]["tgt_ids"] == ref["tgt_ids"]
        diff = max(
            (torch.tensor(a) - torch.tensor(b)).abs().max().item()
            for a, b in zip(again[d]["logits"], ref["logits"], strict=True)
        )
        assert diff < TOL
        assert again[d]["greedy"] == ref["greedy"]


ROUND_TRIP = [
    ("seq2seq", "post", "sinusoidal"),
    ("seq2seq", "post", "learned"),
    ("seq2seq", "post", "sinusoidal", "model.share_embeddings=decoder"),
    ("seq2seq", "post", "sinusoidal", "model.share_embeddings=none", "model.decoder_layers=1"),
    ("seq2seq", "post", "sinusoidal_concat", "model.activation=swish", "model.attention_bias=true"),
    ("seq2seq", "post", "sinusoidal", "model.output_bias=true", "model.attention_bias=true"),
]


@pytest.mark.parametrize("case", ROUND_TRIP, ids=lambda c: "-".join(o.split(".")[-1] for o in c))
def test_aiayn_export_then_import_gives_the_same_tensors_and_tokenizer(tok, tmp_path, case):
    weights = write_model(tmp_path / "model", tok, *case)
    hf = export_model(weights, tmp_path / "hf", "hf")
    back = import_hf(hf, tmp_path / "back.safetensors")
    a, b = load_file(weights), load_file(back)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert export_paths(back)[2].read_bytes() == tok.path.read_bytes()
    cfg, _, _, _ = load_for_inference(back, (), "cpu")
    original, _, _, _ = load_for_inference(weights, (), "cpu")
    assert cfg.model == original.model


def marian_like(tmp_path: Path, **config) -> Path:
    """A directory with what the refusals read first: config.json and tokenizer_config.json."""
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    base = {
        "model_type": "marian",
        "d_model": 32,
        "encoder_layers": 2,
        "decoder_layers": 2,
        "encoder_ffn_dim": 64,
        "decoder_ffn_dim": 64,
        "encoder_attention_heads": 4,
        "decoder_attention_heads": 4,
        "activation_function": "swish",
        "scale_embedding": True,
        "vocab_size": 10,
        "decoder_vocab_size": 10,
    }
    tok_config = config.pop("tokenizer_config", {})
    (d / "config.json").write_text(json.dumps({**base, **config}))
    (d / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return d


@pytest.mark.parametrize(
    "change, key",
    [
        ({"tokenizer_config": {"separate_vocabs": True}}, "separate_vocabs"),
        ({"decoder_vocab_size": 12}, "decoder_vocab_size"),
        ({"normalize_before": True}, "normalize_before"),
        ({"decoder_ffn_dim": 128}, "encoder_ffn_dim 64 != decoder_ffn_dim 128"),
        ({"decoder_attention_heads": 8}, "encoder_attention_heads 4 != decoder_attention_heads 8"),
        ({"activation_function": "gelu"}, "activation_function 'gelu'"),
        ({"scale_embedding": False}, "scale_embedding"),
        ({"model_type": "bart"}, "model_type"),
    ],
)
def test_what_cannot_be_exact_is_refused_naming_its_key(tmp_path, change, key):
    with pytest.raises(ExportError, match="cannot be imported exactly") as err:
        import_hf(marian_like(tmp_path, **change), tmp_path / "x.safetensors")
    assert key in str(err.value)
    assert str(err.value).count("\n  - ") == 1  # one line: only the changed key


def test_a_missing_directory_or_file_is_named(tmp_path):
    with pytest.raises(ExportError, match="not a model directory"):
        import_hf(tmp_path / "nowhere", tmp_path / "x.safetensors")
    d = marian_like(tmp_path)
    with pytest.raises(ExportError, match="no model.safetensors or pytorch_model.bin"):
        import_hf(d, tmp_path / "x.safetensors")
    shutil.rmtree(d)
    d.mkdir()
    with pytest.raises(ExportError, match="config.json is missing"):
        import_hf(d, tmp_path / "x.safetensors")


def test_import_hf_command_prints_what_it_imported(tok, tmp_path):
    weights = write_model(tmp_path / "model", tok, "seq2seq")
    hf = export_model(weights, tmp_path / "hf", "hf")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "aiayn",
            "import-hf",
            str(hf),
            "--output",
            str(tmp_path / "i.safetensors"),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert "2+2 layers, d_model 32" in out.stdout and "init.source=" in out.stdout


def test_the_contract_and_the_cache_key_cover_both_models_and_the_vocabulary(marian, tmp_path):
    from aiayn.config import load_config
    from aiayn.data.cache import fingerprint
    from aiayn.errors import TokenizerError
    from aiayn.tokenizer import Tokenizer, check_contract
    from aiayn.tokenizer.marian import write_bundle

    _, _, imported = marian["swish-tied"]
    tok = Tokenizer(export_paths(imported)[2])
    b = tok.bundle
    cfg = load_config(None, [f"run_dir={tmp_path}", "data.train=x"])
    key = fingerprint(cfg, "train", tok)["tokenizer_sha256"]
    changed = {
        "target.spm": dataclasses.replace(b, target_spm=b.source_spm),
        "vocab.json": dataclasses.replace(b, vocab_json=b.vocab_json + b" "),
    }
    for what, other in changed.items():
        path = tmp_path / f"{what}.model"
        path.write_bytes(write_bundle(other))
        with pytest.raises(TokenizerError, match="sha256"):
            check_contract(tok.contract(), Tokenizer(path), where="the run")
        assert fingerprint(cfg, "train", Tokenizer(path))["tokenizer_sha256"] != key, what
    assert write_bundle(b) == export_paths(imported)[2].read_bytes()  # the same bytes again


def test_a_hub_name_downloads_the_files_and_records_the_commit(tok, tmp_path, monkeypatch):
    """The hub is replaced by a local snapshot (snapshots/<commit>, as huggingface_hub lays
    them out); what import-hf asks for and records is real."""
    import huggingface_hub
    from safetensors import safe_open

    weights = write_model(tmp_path / "model", tok, "seq2seq")
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "hub" / "snapshots" / commit
    export_model(weights, snapshot, "hf")
    asked = {}

    def snapshot_download(repo_id, revision=None, allow_patterns=None):
        asked.update(repo_id=repo_id, revision=revision, patterns=allow_patterns)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    out = import_hf("Helsinki-NLP/opus-mt-de-en", tmp_path / "hub.safetensors", revision="v1")
    assert asked["repo_id"] == "Helsinki-NLP/opus-mt-de-en" and asked["revision"] == "v1"
    assert {"config.json", "model.safetensors", "source.spm"} <= set(asked["patterns"])
    with safe_open(out, framework="pt") as fh:
        assert fh.metadata()["aiayn_source"] == f"hf:Helsinki-NLP/opus-mt-de-en@{commit}"
    with pytest.raises(ExportError, match="local directory, not a hub name"):
        import_hf(snapshot, tmp_path / "x.safetensors", revision="v1")
