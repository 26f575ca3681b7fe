"""In-job restarts under `python -m aiayn.distributed.run` (torchrun with aiayn's restart
policy), 2 real ranks on gloo: a fault on one rank (SIGKILL, an exception, out of memory, a
stalled rank) restarts the group from the latest checkpoint and the job ends by itself with
the weights and optimizer state of a run that was never interrupted; a preemption (75) and an
error a person must fix (2) are not restarted."""

import itertools
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from aiayn.checkpoint import read_trainer_state

import helpers  # tests/helpers.py
import procs  # tests/distributed/procs.py, beside this file

pytestmark = pytest.mark.distributed

FAULTY = str(Path(__file__).with_name("faulty.py"))
STEPS = 20
# Dropout on: the restart must restore every rank's RNG stream. A checkpoint every 5 steps.
OPTIONS = ("model.dropout=0.1", "checkpoint.every_steps=5", "train.eval_every=10")
BACKENDS = {
    "ddp": (),
    "zero2": ("distributed.backend=deepspeed", "distributed.zero_stage=2"),
}


def launcher(max_restarts: int, *options: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "aiayn.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        f"--max-restarts={max_restarts}",
        *options,
    ]


def faulty(
    config: Path, run_dir: Path, kinds: list[str], steps: list[int], *overrides: str
) -> list[str]:
    """On the group's i-th start, rank 1 meets kinds[i] as it begins steps[i]."""
    train = procs.aiayn(config, run_dir, *OPTIONS, *overrides)[2:]  # without "-m aiayn"
    return [FAULTY, ",".join(kinds), "1", ",".join(map(str, steps)), *train]


def launch(cmd: list[str], timeout: int = 300) -> tuple[int, str, float]:
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=procs.ENV)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - started


def faults(run_dir: Path) -> list[dict]:
    path = run_dir / "faults.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def starts(run_dir: Path) -> int:
    """How many times the group started training (rank 0's log line of each start)."""
    text = (run_dir / "train.log").read_text()
    return text.count("| new run") + text.count("| resumed from")


def final_state(run_dir: Path, backend: str) -> dict[str, torch.Tensor]:
    """The final weights, and for ddp the Adam moments too (ZeRO keeps them in its shards,
    whose bits its own resume tests compare)."""
    state = dict(helpers.weights_at(run_dir, STEPS))
    if backend == "ddp":
        ckpt = run_dir / "checkpoints" / f"step_{STEPS:08d}"
        engine = read_trainer_state(ckpt)["engine"]
        for key, slot in engine["optimizer"]["state"].items():
            state |= {f"adam/{key}/{name}": v for name, v in slot.items() if v.dim()}
    return state


def seconds_between(*lines: str) -> list[int]:
    """Whole seconds between consecutive log lines, from their HH:MM:SS stamps."""
    clock = []
    for line in lines:
        h, m, s = map(int, line[:8].split(":"))
        clock.append(3600 * h + 60 * m + s)
    return [(b - a) % 86400 for a, b in itertools.pairwise(clock)]


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} of {len(a)} tensors differ: {differ[:4]}"


@pytest.fixture(scope="module")
def uninterrupted(setup):
    """backend -> the run_dir of the same 2-rank run with no fault, made on first use."""
    root, config = setup
    made = {}

    def get(backend: str) -> Path:
        if backend not in made:
            run_dir = root / f"uninterrupted_{backend}"
            overrides = (*OPTIONS, *BACKENDS[backend])
            procs.run(helpers.torchrun(2) + procs.aiayn(config, run_dir, *overrides))
            made[backend] = run_dir
        return made[backend]

    return get


@pytest.mark.parametrize(
    "backend,kinds", [("ddp", ("sigkill", "raise", "oom")), ("zero2", ("sigkill", "raise"))]
)
def test_faults_on_one_rank_restart_the_group_which_ends_bitwise(
    setup, uninterrupted, backend, kinds
):
    """One fault per start, in a random order at random steps (before, at and after
    checkpoints alike): each restarts the group from the checkpoint the previous start left,
    and the job ends with the weights of a run that was never interrupted."""
    root, config = setup
    kinds = random.sample(kinds, len(kinds))
    steps = sorted(random.sample(range(2, STEPS + 1), len(kinds)))  # each start reaches its own
    print(f"on rank 1: {list(zip(kinds, steps, strict=True))}")
    run_dir = root / f"{backend}_faults"
    cmd = launcher(len(kinds)) + faulty(config, run_dir, kinds, steps, *BACKENDS[backend])
    code, out, _ = launch(cmd)
    assert code == 0, out[-4000:]
    found = faults(run_dir)
    failed = [f for f in found if f["rank"] == 1]
    assert [(f["attempt"], f["action"]) for f in failed] == [
        (attempt, "restart") for attempt in range(len(kinds))
    ], found
    for fault, kind, step in zip(failed, kinds, steps, strict=True):
        assert fault["exitcode"] == {"sigkill": -9, "raise": 1, "oom": 1}[kind], found
        if kind != "sigkill":  # the worker's own message reaches the fault log
            assert f"at step {step}" in fault["error"], found
    assert starts(run_dir) == len(kinds) + 1
    assert_bitwise(final_state(run_dir, backend), final_state(uninterrupted(backend), backend))


def test_a_fault_on_one_node_restarts_the_group_on_both(setup, uninterrupted):
    """Two launchers ("nodes") of one process each, c10d rendezvous: rank 1's node restarts
    for the fault, rank 0's for the lost peer, and they meet again in a new store."""
    root, config = setup
    step = random.randint(2, STEPS)
    print(f"sigkill on rank 1 (node 1) at step {step}")
    run_dir = root / "two_nodes_sigkill"
    rendezvous = [
        "--nnodes=2",
        "--nproc-per-node=1",
        "--max-restarts=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{helpers.free_port()}",
        "--rdzv-id=two-nodes",
    ]
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "aiayn.distributed.run", f"--node-rank={node}", *rendezvous]
            + faulty(config, run_dir, ["sigkill"], [step]),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=procs.ENV,
        )
        for node in (0, 1)
    ]
    try:
        outs = [node.communicate(timeout=300)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert starts(run_dir) == 2
    # Rank 0's node logs a fault too when its worker failed before the new rendezvous
    # round stopped it: either way is right.
    killed = [(f["rank"], f["exitcode"], f["action"]) for f in faults(run_dir) if f["rank"] == 1]
    assert killed == [(1, -9, "restart")], faults(run_dir)
    assert_bitwise(final_state(run_dir, "ddp"), final_state(uninterrupted("ddp"), "ddp"))


def test_a_stalled_rank_fails_the_others_within_the_timeout_and_the_group_restarts(
    setup, uninterrupted
):
    """SIGSTOP: rank 1 neither dies nor answers. Rank 0 gives up after
    distributed.timeout_minutes (here 6 s, not the default 10 minutes) with an error naming
    the step; the launcher kills the stopped rank and restarts the group."""
    root, config = setup
    step = random.randint(2, STEPS)
    print(f"SIGSTOP to rank 1 at step {step}")
    run_dir = root / "ddp_sigstop"
    timeout_s = 6
    cmd = launcher(1, "--shutdown-timeout=2") + faulty(
        config, run_dir, ["sigstop"], [step], f"distributed.timeout_minutes={timeout_s / 60}"
    )
    code, out, _ = launch(cmd)
    assert code == 0, out[-4000:]
    rank0 = [f for f in faults(run_dir) if f["rank"] == 0]
    assert rank0 and rank0[0]["action"] == "restart", faults(run_dir)
    assert f"step {step}: a collective failed on rank 0" in rank0[0]["error"], rank0
    assert "timed out" in rank0[0]["error"].lower(), rank0
    # Measured on rank 0's log clock, so that a loaded machine's slower starts do not count:
    # the stall lasts the timeout (6 s, not the default 10 minutes), and the restart follows
    # after the stopped rank's grace (--shutdown-timeout, 2 s) and a start of a few seconds,
    # not after torch's own 30 s grace for a failed group, which the launcher replaces.
    lines = (run_dir / "train.log").read_text().splitlines()
    failed = next(i for i, line in enumerate(lines) if f"step {step}: a collective failed" in line)
    before = max(i for i in range(failed) if " train step " in lines[i])  # a step per line
    started = next(
        i for i in range(failed, len(lines)) if re.search(r"model, [\d,]+ param", lines[i])
    )
    stalled, restarted = seconds_between(lines[before], lines[failed], lines[started])
    assert timeout_s - 1 <= stalled < timeout_s + 10, lines[before : failed + 1]
    assert restarted < 20, lines[failed : started + 1]
    assert_bitwise(final_state(run_dir, "ddp"), final_state(uninterrupted("ddp"), "ddp"))


@pytest.mark.parametrize("kind,code,action", [("sigusr1", 75, "preempted"), ("user", 2, "stop")])
def test_a_preemption_or_an_error_to_fix_is_not_restarted(setup, kind, code, action):
    """75 (preempted: the checkpoint is saved, the scheduler requeues) and 2 (the message
    names a fix) end the job with that code although restarts are left."""
    root, config = setup
    run_dir = root / f"not_restarted_{kind}"
    got, out, _ = launch(launcher(3) + faulty(config, run_dir, [kind], [7]))
    assert got == code, out[-4000:]
    assert starts(run_dir) == 1, out[-4000:]
    assert {f["action"] for f in faults(run_dir)} == {action}, faults(run_dir)
    if kind == "sigusr1":
        # Signalled during step 7: step 8 starts the vote that carries it (StopVote), step 9
        # reads it, and both ranks stop after step 9 and save.
        assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000009"
        assert "not restarted, exiting 75" in out


def test_a_fault_log_that_cannot_be_written_is_reported_and_the_group_still_restarts(setup):
    """faults.jsonl cannot be opened (here a directory stands in its place, as a full or
    read-only run_dir would refuse it): the launcher says so and applies its policy anyway."""
    root, config = setup
    run_dir = root / "unwritable_faults"
    (run_dir / "faults.jsonl").mkdir(parents=True)
    code, out, _ = launch(launcher(1) + faulty(config, run_dir, ["raise"], [3]))
    assert code == 0, out[-4000:]
    assert f"could not write {run_dir / 'faults.jsonl'}" in out, out[-4000:]
    assert "restarting the group from the latest checkpoint" in out
    assert starts(run_dir) == 2
