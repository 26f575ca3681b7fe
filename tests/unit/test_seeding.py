"""RNG states in a checkpoint: a CUDA rank restores the generator it drew from, whatever number
of GPUs the resumed process sees (torch.cuda faked: fake_cuda.py)."""

import io
import logging

import torch

from aiayn.runtime.seeding import load_rng_state, rng_state

from fake_cuda import FakeCuda


def through_a_file(state: dict) -> dict:
    """As a checkpoint stores it: torch.save, then torch.load(weights_only=True)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_rank_3_of_8_gpus_resumes_its_generator_where_it_sees_one_gpu(monkeypatch):
    saving = FakeCuda(monkeypatch, count=8)
    saving.set_device(3)  # torchrun's LOCAL_RANK 3 on an 8-GPU node
    advanced = torch.arange(16, dtype=torch.uint8)
    saving.set_rng_state(advanced, 3)  # the one generator this rank drew dropout from
    state = through_a_file(rng_state())

    resuming = FakeCuda(monkeypatch, count=1)  # srun --gpus-per-task=1: its GPU is cuda:0
    load_rng_state(state)
    assert torch.equal(resuming.rng[0], advanced)


def test_a_checkpoint_with_every_gpus_state_restores_this_ranks_entry(monkeypatch, caplog):
    """Checkpoints written before this change hold torch.cuda.get_rng_state_all()."""
    old = {**rng_state(), "cuda": [torch.full((16,), 10 + i, dtype=torch.uint8) for i in range(4)]}
    cuda = FakeCuda(monkeypatch, count=4)
    cuda.set_device(2)
    load_rng_state(through_a_file(old))
    assert torch.equal(cuda.rng[2], old["cuda"][2])
    assert torch.equal(cuda.rng[0], torch.zeros(16, dtype=torch.uint8))  # others untouched

    # A device the old checkpoint has no entry for keeps the seed's state, and says so.
    cuda = FakeCuda(monkeypatch, count=8)
    cuda.set_device(5)
    with caplog.at_level(logging.WARNING, logger="aiayn"):
        load_rng_state(through_a_file(old))
    assert torch.equal(cuda.rng[5], torch.full((16,), 5, dtype=torch.uint8))
    assert "CUDA RNG states for 4 devices, none for cuda:5" in caplog.text
