"""What many tests share: free ports, the torchrun launcher, what a run leaves (its checkpoints'
weights, its TensorBoard scalars) and the settings of the small models they train.

Importable from every test folder (pytest puts tests/ on sys.path: tests/conftest.py is
there); a script a test starts as a process puts tests/ on its sys.path itself."""

import json
import os
import random
import socket
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

# --- ports and launchers ---------------------------------------------------------------------


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range: the ports a connect() or a bind to port
    0 are given."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _port_block() -> range:
    """This process's ports to hand out: below the ephemeral range, where no other process's
    outgoing connection or port-0 server can take one between the pick and the test server's
    bind (the race that bind-to-0-and-close has), and below the rendezvous ports
    slurm/train.sbatch derives from a job's id (20000 and up), a block of its own for each
    xdist worker."""
    ports = range(10_000, min(20_000, _ephemeral_low()))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    size = len(ports) // max(workers, 1)
    index = int(worker) if worker.isdigit() and int(worker) < workers else 0
    return ports[index * size : (index + 1) * size]


_PORTS = _port_block()
_next_port = random.Random(os.getpid()).randrange(max(len(_PORTS), 1))
"""Handed out in turn from a start of this process's own, so that a test's next launch and a
child process of the same worker pick other ports than the ones just picked."""


def free_ports(n: int) -> list[int]:
    """n different ports free on 127.0.0.1 now, from this process's block (`_port_block`).
    Where the kernel leaves no room below its ephemeral range, ports it gives for port 0, all
    bound at once so that they differ (another process may then take one first)."""
    global _next_port
    picked: list[int] = []
    for _ in range(len(_PORTS) if n else 0):
        port = _PORTS[_next_port % len(_PORTS)]
        _next_port += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use, or in TIME_WAIT: the next one
        picked.append(port)
        if len(picked) == n:
            return picked
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def torchrun(nproc: int = 2) -> list[str]:
    """torchrun for `nproc` processes on this machine, on a free port (so that tests side by
    side do not meet), run by this interpreter rather than a `torchrun` found on PATH."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
    ]


# --- what a run leaves -----------------------------------------------------------------------


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    """The directory of the run's checkpoint of `step`."""
    return run_dir / "checkpoints" / f"step_{step:08d}"


def weights_at(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The model weights the run saved at `step`."""
    return load_file(checkpoint_dir(run_dir, step) / "model.safetensors")


def events(run_dir: Path):
    """The run's TensorBoard events, every one of them: EventAccumulator keeps by default a
    random sample of 10,000 scalars and 10 tensors (text summaries) of each tag."""
    # Imported here: scripts that run as ranks import this module for the model settings alone.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def metrics_file_matches_events(run_dir: Path) -> dict[str, dict[int, float]]:
    """Assert that run_dir/metrics.jsonl holds each (tag, step) once and exactly TensorBoard's
    scalars: the same tags, steps in the same order, values equal once rounded to TensorBoard's
    float32. Returns tag -> step -> value from the file."""
    import numpy as np

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged: dict[str, dict[int, float]] = {}
    for row in rows:
        step = row.pop("step")
        assert isinstance(row.pop("time"), float)
        for tag, value in row.items():
            assert step not in logged.setdefault(tag, {}), f"{tag} at step {step} twice"
            logged[tag][step] = value
    acc = events(run_dir)
    assert sorted(logged) == sorted(acc.Tags()["scalars"])
    for tag, by_step in logged.items():
        board = [(e.step, e.value) for e in acc.Scalars(tag)]
        mine = [(step, float(np.float32(v))) for step, v in by_step.items()]
        assert mine == board, tag
    return logged


def scalars(run_dir: Path, tag: str) -> dict[int, float]:
    """Step -> value of one TensorBoard scalar the run logged, in the order logged."""
    return {e.step: e.value for e in events(run_dir).Scalars(tag)}


def consumed(run_dir: Path) -> dict[int, list[int]]:
    """Step -> the sample ids all ranks trained on in it, from logging.record_ids."""
    by_step: dict[int, list[int]] = {}
    for path in sorted((run_dir / "consumed").glob("rank_*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            by_step.setdefault(row["step"], []).extend(row["ids"])
    return by_step


# --- corpora ----------------------------------------------------------------------------------

HUB_SPLITS = {"train": "train", "valid": "validation", "test": "test"}
"""The numbers corpus's file prefixes -> the Hub's split names (wmt/wmt14's)."""


def hub_dataset(root: Path, corpus: Path, config: str = "de-en", train_files: int = 1) -> Path:
    """The numbers corpus (`corpus`/{train,valid,test}.{en,de}) as a local folder in the
    layout of the Hub's wmt/wmt14: `de-en/train-00000-of-00001.parquet` and so on, a column
    `translation` of {"de", "en"} structs, and the README's `configs:` front matter, without
    which `datasets.load_dataset(root, "de-en")` knows only a config named "default". The
    training split is cut into `train_files` data files in order, as the Hub cuts large ones."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / config).mkdir(parents=True)
    listed = []
    for prefix, split in HUB_SPLITS.items():
        en = (corpus / f"{prefix}.en").read_text(encoding="utf-8").splitlines()
        de = (corpus / f"{prefix}.de").read_text(encoding="utf-8").splitlines()
        pairs = [{"de": d, "en": e} for e, d in zip(en, de, strict=True)]
        n = train_files if split == "train" else 1
        size = -(-len(pairs) // n)
        for i in range(n):
            pq.write_table(
                pa.table({"translation": pairs[i * size : (i + 1) * size]}),
                root / config / f"{split}-{i:05d}-of-{n:05d}.parquet",
            )
        listed.append(f"  - split: {split}\n    path: {config}/{split}-*\n")
    front = f"configs:\n- config_name: {config}\n  data_files:\n{''.join(listed)}"
    (root / "README.md").write_text(f"---\n{front}---\n", encoding="utf-8")
    return root


# --- the small models the tests train --------------------------------------------------------

TINY_MODEL = {"N": 1, "d_model": 32, "d_ff": 64, "h": 2, "max_len": 64}
"""The smallest model the runs train (not model.preset=tiny, which is 4 times as wide): one
layer each side, two heads of 16."""

SMALL_MODEL = {**TINY_MODEL, "d_model": 64, "d_ff": 128, "h": 4}
"""Twice as wide, 4 heads: the model of the runs whose loss must fall within some dozens of
steps (e2e/test_train.py, Tiny Shakespeare) and of the distributed tests' shared run."""

TWO_LAYER_MODEL = {**TINY_MODEL, "N": 2, "h": 4}
"""Two layers each side, 4 heads of 8: the models that the unit tests of the model, the loss,
decoding and export build."""


def _settings(model: dict, **changes) -> dict:
    """`model` with `changes`; a change to None drops the setting (the config's default)."""
    merged = {**model, **changes}
    return {k: v for k, v in merged.items() if v is not None}


def model_overrides(model: dict, **changes) -> list[str]:
    """`model` with `changes` (None drops a setting) as model.KEY=VALUE overrides."""
    return [f"model.{k}={v}" for k, v in _settings(model, **changes).items()]


def model_yaml(model: dict, **changes) -> str:
    """`model` with `changes` (None drops a setting) as a YAML flow mapping, for a config
    file's `model:` key."""
    return "{" + ", ".join(f"{k}: {v}" for k, v in _settings(model, **changes).items()) + "}"
