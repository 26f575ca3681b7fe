"""Real processes for the distributed tests: a shared corpus and config, launchers, weights.
(Free ports, torchrun, a run's weights and scalars: tests/helpers.py.)"""

import os
import re
import subprocess
import sys
from pathlib import Path

from aiayn.config import load_config
from aiayn.corpora import demo
from aiayn.data import ensure_cache, sample_sentences
from aiayn.tokenizer import Tokenizer, train_tokenizer

from helpers import SMALL_MODEL, free_port, model_yaml  # tests/helpers.py

STEPS = 20
EXAMPLES = 3000  # training pairs of the numbers corpus

# torchrun gives each of several local processes one thread; a matmul split over another
# number of threads sums in another order. Every run here gets one, so runs compare exactly.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def make_setup(root: Path) -> tuple[Path, Path]:
    """A corpus, a tokenizer and the token cache, made once (so that no two runs race to write
    them), and a config file.

    Every run reads that one token cache (the build, by one rank and by two, and killed:
    test_prepare.py), and is given a peak instead of measuring one (MFU:
    tests/unit/test_flops.py): each saves a rank 0.6 s of start-up, in some 60 launches."""
    corpus = demo.write_numbers(root / "numbers", n_train=EXAMPLES, n_valid=100, n_test=50)
    config = root / "run.yaml"
    config.write_text(
        f"""
model: {model_yaml(SMALL_MODEL, dropout=0.0)}
tokenizer: {{path: {root}/spm.model, vocab_size: 120}}
data: {{train: {corpus}/train, valid: {corpus}/valid, src_lang: en, tgt_lang: de, max_len: 40,
        shuffle_buffer: 1000, cache_dir: {root}/data_cache}}
train: {{max_steps: {STEPS}, max_tokens: 600, eval_every: 10, eval_bleu: 0, clip_norm: 1.0}}
schedule: {{warmup: 100, factor: 1.0}}  # gentle: float rounding is not amplified
logging: {{every_steps: 1, peak_tflops: 1}}
checkpoint: {{every_steps: 10}}
"""
    )
    cfg = load_config(config)
    train_tokenizer(
        cfg.tokenizer, sample_sentences(cfg.data, "seq2seq", 5000, 1), cfg.tokenizer_path
    )
    ensure_cache(cfg, "train", Tokenizer(cfg.tokenizer_path))
    return root, config


def accelerate_launch(*options: str, nproc: int = 2) -> list[str]:
    """`accelerate launch OPTIONS` for `nproc` processes on this machine."""
    exe = str(Path(sys.executable).parent / "accelerate")
    machine = ["--num_processes", str(nproc), "--num_machines", "1"]
    return [exe, "launch", *options, *machine, "--main_process_port", str(free_port())]


LAUNCH = Path(__file__).resolve().parents[2] / "launch"


def launch_wrapper(script: str, *args: str, env: dict | None = None, timeout: int = 600) -> str:
    """launch/SCRIPT ARGS, a wrapper users start runs with, this venv's python and torchrun first
    on PATH, run to its end: the command it printed first ("+ ..."), checked to be printed."""
    bin_dir = Path(sys.executable).parent
    path = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    cmd = [str(LAUNCH / script), *args]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**ENV, **path, **(env or {})}
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    printed = proc.stderr.splitlines()[0]
    assert printed.startswith("+ "), printed
    return printed


def run(cmd: list[str], timeout: int = 600) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def aiayn(config: Path, run_dir: Path, *overrides: str) -> list[str]:
    return ["-m", "aiayn", "train", "--config", str(config), f"run_dir={run_dir}", *overrides]


TRAIN_RUNS = str(Path(__file__).with_name("train_runs.py"))


def one_launch(runs: list[list[str]]) -> list[str]:
    """Several runs' arguments for one launch, "--" between them (train_runs.runs_of splits
    them again)."""
    return [arg for i, run in enumerate(runs) for arg in ["--"] * bool(i) + run]


def train_runs(config: Path, runs: dict[Path, tuple[str, ...]]) -> list[str]:
    """The arguments of one launch of several `aiayn train` runs (train_runs.py), run_dir ->
    its overrides, in order: after the launcher (python or torchrun)."""
    return [TRAIN_RUNS, str(config), *one_launch([[str(d), *o] for d, o in runs.items()])]


def assert_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= atol, f"largest parameter difference {worst:.3g} > {atol}"


IO_LINE = re.compile(
    r"checkpoint I/O (at the restart|at the save of step \d+): rank 0 ([\d,]+) stats, "
    r"([\d,]+) opens, ([\d,]+) listings, ([\d,]+) gathered bytes; the busiest other rank "
    r"([\d,]+), ([\d,]+), ([\d,]+), ([\d,]+)"
)


def checkpoint_io(log: str) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """A run's "checkpoint I/O" lines (aiayn/runtime/io_counts.py), in order: (what, rank 0's
    stats, opens, listings and gathered bytes, and the busiest other rank's)."""
    out = []
    for what, *numbers in IO_LINE.findall(log):
        values = tuple(int(n.replace(",", "")) for n in numbers)
        out.append((what, values[:4], values[4:]))
    return out
