"""train.memory_probe: the epoch's largest batches are tried before the first step, and the run
is the same with the probe as without it."""

import torch

from aiayn.config import load_config
from aiayn.data import ensure_cache, make_loader
from aiayn.tokenizer import Tokenizer
from aiayn.train import memory_probe, train

from helpers import weights_at  # tests/helpers.py
from tiny import overrides


def test_the_probe_tries_the_largest_batches_and_changes_nothing(tmp_path, numbers, monkeypatch):
    tried = []
    real = memory_probe.probe

    def recording(engine, batches, *args):
        tried.extend(batches)
        return real(engine, batches, *args)

    monkeypatch.setattr(memory_probe, "probe", recording)
    common = ("model.dropout=0.1", "train.max_steps=6", "checkpoint.every_steps=6")
    runs = {}
    for setting in ("never", "always"):
        run = tmp_path / setting
        train(load_config(None, overrides(run, numbers, *common, f"train.memory_probe={setting}")))
        runs[setting] = weights_at(run, 6)
    assert runs["always"].keys() == runs["never"].keys()
    assert all(torch.equal(runs["always"][k], runs["never"][k]) for k in runs["always"])
    # The batches tried are the epoch's most padded and widest, as the loop would meet them.
    cfg = load_config(None, overrides(tmp_path / "always", numbers, *common))
    tok = Tokenizer(cfg.tokenizer_path)
    loader = make_loader(
        cfg, cfg.data.train, tok, train=True, cache=ensure_cache(cfg, "train", tok)
    )
    it, epoch = iter(loader), []
    while loader.epoch == 0:
        b = next(it)
        if loader.epoch == 0:
            epoch.append(b)

    def cost(b):
        return b.size * max(b.src.shape[1], b.tgt_in.shape[1])

    def width(b):
        return max(b.src.shape[1], b.tgt_in.shape[1])

    assert len(tried) in (1, 2)
    assert cost(tried[0]) == max(map(cost, epoch)) > 0
    assert width(tried[-1]) == max(map(width, epoch))
    assert any(b.ids.tolist() == tried[0].ids.tolist() for b in epoch)
