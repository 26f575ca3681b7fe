"""A checkpoint written by an earlier commit (tests/fixtures/resume_v1, made by
tests/fixtures/make_resume_fixture.py) resumes with this code, bit for bit: the run ends where
the earlier code's uninterrupted run ended."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

FIXTURES = Path(__file__).parents[1] / "fixtures"
FIXTURE = FIXTURES / "resume_v1"
sys.path.insert(0, str(FIXTURES))
import make_resume_fixture  # noqa: E402  (tests/fixtures, how the fixture was made)

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # as the fixture was made: one thread


def step_dir(root: Path, step: int) -> Path:
    return root / "run" / "checkpoints" / f"step_{step:08d}"


def test_a_checkpoint_of_the_earlier_format_resumes_to_the_same_bits(tmp_path):
    root = tmp_path / "resume_v1"
    shutil.copytree(FIXTURE, root)
    shutil.rmtree(step_dir(root, 8))  # resume from step 4; the fixture's step 8 is the answer
    (root / "run" / "checkpoints" / "latest").write_text("step_00000004\n")
    cmd = [sys.executable, "-m", "aiayn", "train", "--config", str(root / "run.yaml")]
    cmd += make_resume_fixture.paths(root, make_resume_fixture.place_corpus(root / "corpus"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming from {step_dir(root, 4)}" in (root / "run" / "train.log").read_text()

    got, want = step_dir(root, 8), step_dir(FIXTURE, 8)
    weights, expected = load_file(got / "model.safetensors"), load_file(want / "model.safetensors")
    assert weights.keys() == expected.keys()
    assert [k for k in weights if not torch.equal(weights[k], expected[k])] == []
    state, expected_state = (
        torch.load(d / "trainer.pt", map_location="cpu", weights_only=True) for d in (got, want)
    )
    moments, expected_moments = (s["engine"]["optimizer"]["state"] for s in (state, expected_state))
    assert moments.keys() == expected_moments.keys()
    for k, slot in moments.items():
        for name, value in slot.items():
            assert torch.equal(value, expected_moments[k][name]), (k, name)
    assert state["data"]["position"] == expected_state["data"]["position"]
    # The token cache is now named by its arrays' content, not its corpus's path (data/cache.py).
    fingerprint, old = (dict(s["data"]["fingerprint"]) for s in (state, expected_state))
    assert fingerprint.pop("cache") != old.pop("cache") and fingerprint == old
    assert state["progress"]["step"] == expected_state["progress"]["step"] == 8
    assert torch.equal(state["rng"][0]["torch"], expected_state["rng"][0]["torch"])  # dropout
