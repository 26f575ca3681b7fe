"""`aiayn translate --input --output` under torchrun: two ranks share the file's chunks and
write what one process writes, line for line (aiayn/infer/translate_file.py), sampled and
noised translations included: each sentence's random numbers come from its place in the file,
not from its rank (aiayn/infer/sampling.py); rank 0 alone verifies the checkpoint."""

import json
import re
import sys

import pytest

from helpers import torchrun  # tests/helpers.py
from procs import run

pytestmark = pytest.mark.distributed


def test_two_ranks_translate_a_file_as_one_process_does(setup, ddp_run, tmp_path):
    root, _ = setup
    source = tmp_path / "mono.en"
    source.write_text((root / "numbers" / "valid.en").read_text() * 4)  # 400 lines
    args = ["translate", "--checkpoint", str(ddp_run), "--input", str(source), "--chunk-kb", "1"]
    # Back-translation's settings: samples from the 10 most probable tokens, then noise.
    sampled = ["decode.sampling.enabled=true", "decode.sampling.top_k=10", "decode.noise.swap=3"]
    one, two = tmp_path / "one.de", tmp_path / "two.de"
    run([sys.executable, "-m", "aiayn", *args, "--output", str(one), *sampled])
    out = run(torchrun(2) + ["-m", "aiayn", *args, "--output", str(two), *sampled])
    assert two.read_text() == one.read_text()
    # it did sample: a line and its copies 100 lines on (another key) differ somewhere
    hyps = one.read_text().splitlines()
    assert sum(hyps[i] != hyps[i + 100] for i in range(300)) > 30
    assert one.read_text().count("\n") == 400
    shares = {int(r): int(n) for r, n in re.findall(r"rank (\d): (\d+) lines in", out)}
    assert sorted(shares) == [0, 1] and sum(shares.values()) == 400
    assert all(120 < n < 280 for n in shares.values()), shares
    assert not (tmp_path / "two.de.parts").exists()
    # One rank verified the checkpoint for both (and hashed the tokenizer to find it).
    hashed = re.search(r"checksums at start: ([\d,]+) bytes hashed by (\d) of 2 rank", out)
    files = json.loads((ddp_run / "checkpoints" / "step_00000020" / "manifest.json").read_text())
    assert hashed is not None and hashed.group(2) == "1", out[-2000:]
    assert int(hashed.group(1).replace(",", "")) >= sum(f["bytes"] for f in files["files"].values())
