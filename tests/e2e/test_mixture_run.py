"""What a person training on a mixture (data.sources) sees: the tokenizer the run trains holds
the tags, each source's dev set is scored on its own (valid_<name>/...), TensorBoard shows each
source's examples, passes and token share, and the plain dev set is read untagged."""

from pathlib import Path

import pytest

from aiayn.config import load_config
from aiayn.corpora import demo
from aiayn.data import make_loader
from aiayn.errors import DataError
from aiayn.tokenizer import Tokenizer
from aiayn.train import train

from helpers import TINY_MODEL, events, model_yaml  # tests/helpers.py

TAG = "<bt>"


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mixture")
    return {
        "news": demo.write_numbers(root / "news", 300, 20, 10, seed=1),
        "bt": demo.write_numbers(root / "bt", 100, 20, 10, seed=2),
    }


def config(run_dir: Path, corpora: dict[str, Path], *extra: str, bt_weight: int = 1):
    news, bt = corpora["news"], corpora["bt"]
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.write_text(
        f"""
run_dir: {run_dir}
model: {model_yaml(TINY_MODEL)}
tokenizer: {{vocab_size: 100}}
data:
  sources:
    - {{name: news, path: {news}/train, weight: 3, valid: {news}/valid}}
    - {{name: bt, path: {bt}/train, weight: {bt_weight}, tag: "{TAG}", valid: {bt}/valid}}
  valid: {news}/valid
  src_lang: en
  tgt_lang: de
  max_len: 40
  shuffle_buffer: 200
train: {{max_steps: 8, max_tokens: 400, eval_every: 4, eval_bleu: 6}}
decode: {{beam: 1, max_len_b: 5}}
schedule: {{warmup: 10}}
logging: {{every_steps: 4, peak_tflops: 0.1}}
checkpoint: {{every_steps: 4}}
"""
    )
    return load_config(path, list(extra))


def test_a_mixture_run_scores_each_sources_dev_set_and_shows_each_source(tmp_path, corpora):
    run_dir = tmp_path / "run"
    cfg = config(run_dir, corpora)
    train(cfg)
    acc = events(run_dir)
    tags = set(acc.Tags()["scalars"])
    for name in ("news", "bt"):
        assert {f"valid_{name}/{m}" for m in ("loss", "bleu", "chrf")} <= tags
        assert {f"data/{name}/{m}" for m in ("examples", "passes", "token_share")} <= tags
        assert [e.step for e in acc.Scalars(f"valid_{name}/loss")] == [4, 8]
    assert "valid/loss" in tags  # data.valid: the one best_metric ranks by
    # 400 examples an epoch (sum): news 300, bt 100; by step 8 the counts follow the weights.
    news = acc.Scalars("data/news/examples")[-1].value
    bt = acc.Scalars("data/bt/examples")[-1].value
    assert news + bt > 0 and abs(news / (news + bt) - 0.75) < 0.06
    log = (run_dir / "train.log").read_text()
    assert (
        "source bt: weight 1, share 25.0%, 100 examples, 100 per epoch (1 passes), tag <bt>" in log
    )
    assert (run_dir / "data" / "valid_bt.jsonl").is_file()  # the run's own copy of each dev set
    assert (run_dir / "valid_bt" / "step_00000008.hyp").is_file()
    # The run's tokenizer holds the tag as one piece; the plain dev set is read untagged.
    tok = Tokenizer(cfg.tokenizer_path)
    tag = tok.sp.piece_to_id(TAG)
    assert tag != tok.unk_id
    valid = make_loader(cfg, cfg.data.valid, tok, train=False)
    assert valid.rows.mixture is None  # not a mixture: no tags
    assert all((b.src[:, 0] != tag).all() and b.sources is None for b in valid)


def test_a_changed_weight_is_refused_at_resume_naming_it(tmp_path, corpora):
    run_dir = tmp_path / "run"
    train(config(run_dir, corpora, "train.max_steps=4", "train.eval_every=0"))
    changed = config(run_dir, corpora, "train.max_steps=6", "train.eval_every=0", bt_weight=2)
    with pytest.raises(DataError, match="source bt: weight checkpoint 1.0, now 2.0"):
        train(changed)


def test_a_given_tokenizer_without_the_tag_is_refused_before_any_cache_is_built(tmp_path, corpora):
    first = config(tmp_path / "first", corpora, "train.max_steps=1", "train.eval_every=0")
    first.data.sources[1].tag = None  # its tokenizer is trained without <bt>
    train(first)
    cfg = config(tmp_path / "run", corpora, f"tokenizer.path={first.tokenizer_path}")
    with pytest.raises(DataError, match=r"tag '<bt>' is not a piece .* tokenizer.user_symbols"):
        train(cfg)
    assert not (tmp_path / "run" / "data_cache").exists()
