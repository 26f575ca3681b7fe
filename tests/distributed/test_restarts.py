"""In-job restarts under `python -m aiayn.distributed.run` (torchrun with aiayn's restart
policy), 2 real ranks on gloo: a fault on one rank (SIGKILL, an exception, out of memory, a
stalled rank) restarts the group from the latest checkpoint, the restarted processes start
within seconds of the fault (the old ones are killed at once), and the job ends by itself with
the weights and optimizer state of a run that was never interrupted; a preemption (75, asked of
a worker or of the launcher) and an error a person must fix (2) are not restarted."""

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
from processes import kill_tree  # tests/processes.py

pytestmark = pytest.mark.distributed

FAULTY = str(Path(__file__).with_name("faulty.py"))
STEPS = 20
# From a fault to the restarted processes' creation: torch's agent waited 30 s for a worker
# that SIGTERM did not end (a stalled one, one blocked in a collective); aiayn's kills at once.
RESTART_GAP_S = 10
STARTUP_LINE = re.compile(r"start-up ([\d.]+) s: ")
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


def clock(line: str) -> int:
    """A log line's stamp (ISO: YYYY-MM-DDTHH:MM:SS), in seconds of the day (local time,
    truncated)."""
    h, m, s = map(int, line.split()[0].split("T")[1].split(":"))
    return 3600 * h + 60 * m + s


def seconds_between(*lines: str) -> list[int]:
    """Whole seconds between consecutive log lines, from their stamps."""
    return [(clock(b) - clock(a)) % 86400 for a, b in itertools.pairwise(lines)]


def starts_created(run_dir: Path) -> list[float]:
    """When rank 0's process of each start was created, in seconds of the day: its start-up
    line's stamp less the start-up it reports (at most 1 s late: the stamp is truncated)."""
    lines = (run_dir / "train.log").read_text().splitlines()
    found = [(line, STARTUP_LINE.search(line)) for line in lines]
    return [clock(line) + 1 - float(m.group(1)) for line, m in found if m]


def day_seconds(t: float) -> float:
    """`time.time()` `t` in seconds of the local day, as the log's stamps count them."""
    at = time.localtime(t)
    return 3600 * at.tm_hour + 60 * at.tm_min + at.tm_sec + t % 1


def restart_gaps(run_dir: Path) -> list[float]:
    """For each injected fault (faulty.py's run_dir/injected.jsonl), the seconds from it to the
    creation of the next start's rank 0: finding the fault, stopping the old group and meeting
    again, without the start-up itself."""
    injected = [json.loads(line) for line in (run_dir / "injected.jsonl").read_text().splitlines()]
    created = starts_created(run_dir)
    gaps = [created[i + 1] - day_seconds(row["time"]) for i, row in enumerate(injected)]
    return [(gap + 43200) % 86400 - 43200 for gap in gaps]  # across midnight


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
    gaps = restart_gaps(run_dir)
    assert all(gap < RESTART_GAP_S for gap in gaps), list(zip(kinds, gaps, strict=True))
    assert_bitwise(final_state(run_dir, backend), final_state(uninterrupted(backend), backend))


def test_a_fault_on_one_node_restarts_the_group_on_both(setup, uninterrupted):
    """Two launchers ("nodes") of one process each, c10d rendezvous: rank 1's node restarts
    for the fault, rank 0's for the lost peer, and they meet again in a new store. Each node
    has its own disk for the token cache (data.cache_scope=node, the directory named by a
    variable each node sets, as $SLURM_TMPDIR is): each builds its copy, and the copies hold
    the same tokens."""
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
    disks = [root / f"two_nodes_disk{node}" for node in (0, 1)]
    node_cache = ("data.cache_scope=node", "data.cache_dir=${AIAYN_NODE_DISK}/cache")
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "aiayn.distributed.run", f"--node-rank={node}", *rendezvous]
            + faulty(config, run_dir, ["sigkill"], [step], *node_cache),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**procs.ENV, "AIAYN_NODE_DISK": str(disks[node])},
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
    # Both nodes back within seconds: rank 0's node stopped its worker at once when rank 1's
    # asked for a new round, and the restart's rendezvous met at once.
    assert restart_gaps(run_dir)[0] < RESTART_GAP_S
    copies = [
        {p.name: p.read_bytes() for p in (disk / "cache" / "train").glob("*.npy")} for disk in disks
    ]
    assert len(copies[0]) >= 5 and copies[0] == copies[1]
    assert_bitwise(final_state(run_dir, "ddp"), final_state(uninterrupted("ddp"), "ddp"))


def node_launch(nnodes: str, run_id: str, conf: str) -> tuple[torch.distributed.TCPStore, list]:
    """A rendezvous store in this process, not in a launcher that may be the one to vanish,
    and the options of a launcher of one rank that meets there (at most one restart)."""
    port = helpers.free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    return store, [
        f"--nnodes={nnodes}",
        "--nproc-per-node=1",
        "--max-restarts=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf=is_host=0,{conf}",
    ]


def test_a_lost_node_is_given_up_after_the_timeout_and_the_restart_join_timeout(setup):
    """Two launchers ("nodes") of one rank each; rank 1's node vanishes (its launcher and its
    worker SIGSTOPped: sockets open, heartbeats stopped). Rank 0 times out (6 s), its launcher
    kills it and meets for a restart, which waits restart_join_timeout (3 s), not the first
    start's join_timeout (600 s), and exits 1 saying why."""
    root, config = setup
    run_dir = root / "lost_node"
    timeout_s, join_s = 6, 3
    store, rendezvous = node_launch(
        "2", "lost-node", f"join_timeout=600,restart_join_timeout={join_s}"
    )
    overrides = [f"distributed.timeout_minutes={timeout_s / 60}"]
    cmd = [sys.executable, "-m", "aiayn.distributed.run", *rendezvous]
    cmd += faulty(config, run_dir, ["sigstop-node"], [3], *overrides)
    logs = [root / f"lost_node.{n}.out" for n in range(2)]  # files: a full pipe would block
    nodes = []
    for log in logs:
        with open(log, "w") as fh:
            nodes.append(
                subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, text=True, env=procs.ENV)
            )
    try:
        survivor = first_to_exit(nodes, 300)
        gave_up = time.time()
    finally:
        for node in nodes:
            kill_tree(node)  # SIGKILL ends a stopped process too
        del store
    out = logs[nodes.index(survivor)].read_text()
    assert survivor.returncode == 1, out[-4000:]
    assert "the nodes did not all meet within the rendezvous' join_timeout" in out, out[-4000:]
    (lost,) = [json.loads(line) for line in (run_dir / "injected.jsonl").read_text().splitlines()]
    # 6 s, a few for the launcher to see it and torch's rendezvous to give up, not 600.
    print(f"given up {gave_up - lost['time']:.1f} s after the node was lost")
    assert gave_up - lost["time"] < timeout_s + join_s + 20, out[-4000:]
    (peer,) = faults(run_dir)
    assert (peer["rank"], peer["action"]) == (0, "restart"), peer
    assert "timed out" in peer["error"].lower(), peer


def test_an_elastic_group_that_loses_a_node_goes_on_without_it_with_the_same_batch(setup):
    """--nnodes=1:2: two launchers ("nodes") of one rank each share a step's 2 micro-batches;
    rank 1's node dies at step 8 (its launcher and its worker SIGKILLed). The survivor's worker
    fails at its next collective, and its launcher restarts the group on the node that is
    left: one rank, both micro-batches accumulated, from step 5's checkpoint with the same
    global batch (train.tokens_per_step), to the end. Steps 6 and 7, trained again, take the
    examples the two ranks took in them before. (A world size that does not divide the step:
    test_topology.py's third chain.)"""
    root, config = setup
    run_dir = root / "elastic_lost_node"
    # A lost node is declared dead after keep_alive_max_attempt missed heartbeats, and a round
    # of fewer than the most nodes closes last_call_timeout after the least have joined.
    quick = "keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=1"
    store, rendezvous = node_launch("1:2", "elastic", quick)
    batch = ["train.tokens_per_step=1200", "logging.record_ids=true"]
    cmd = [sys.executable, "-m", "aiayn.distributed.run", *rendezvous]
    cmd += faulty(config, run_dir, ["sigkill-node"], [8], *batch)
    nodes = [
        subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=procs.ENV
        )
        for _ in range(2)
    ]
    try:
        outs = [node.communicate(timeout=300)[0] for node in nodes]
    finally:
        for node in nodes:
            kill_tree(node)
        del store
    codes = sorted(node.returncode for node in nodes)
    assert codes == [-9, 0], "\n".join(o[-3000:] for o in outs)
    log = (run_dir / "train.log").read_text()
    assert "x 1 accumulated x 2 ranks per step" in log, log[-3000:]
    assert "x 2 accumulated x 1 ranks per step" in log, log[-3000:]
    assert "resumed from" in log and "training done at step 20" in log, log[-3000:]
    first, again = [], []  # what the ranks took in the first start, and after the restart
    for path in sorted((run_dir / "consumed").glob("rank_*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        steps = [x["step"] for x in rows]
        cut = next((i for i in range(1, len(rows)) if steps[i] < steps[i - 1]), len(rows))
        first, again = first + rows[:cut], again + rows[cut:]

    def ids(records: list[dict], step: int) -> list[list[int]]:
        return sorted(sorted(x["ids"]) for x in records if x["step"] == step)

    for step in (6, 7):
        assert ids(again, step) == ids(first, step) and len(ids(again, step)) == 2, step
    assert max(x["step"] for x in again) == 20


def first_to_exit(launchers: list[subprocess.Popen], timeout: float) -> subprocess.Popen:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in launchers:
            if proc.poll() is not None:
                return proc
        time.sleep(0.05)
    raise AssertionError(f"no launcher exited within {timeout} s")


def test_a_stalled_rank_fails_the_others_within_the_timeout_and_the_group_restarts(
    setup, uninterrupted
):
    """SIGSTOP: rank 1 neither dies nor answers. Rank 0 gives up after
    distributed.timeout_minutes (here 6 s, not the default minute) with an error naming the
    step; the launcher kills the stopped rank at once (SIGTERM could not end it, and torch's
    agent waited 30 s for it) and restarts the group."""
    root, config = setup
    step = random.randint(2, STEPS)
    print(f"SIGSTOP to rank 1 at step {step}")
    run_dir = root / "ddp_sigstop"
    timeout_s = 6
    cmd = launcher(1) + faulty(
        config, run_dir, ["sigstop"], [step], f"distributed.timeout_minutes={timeout_s / 60}"
    )
    code, out, _ = launch(cmd)
    assert code == 0, out[-4000:]
    rank0 = [f for f in faults(run_dir) if f["rank"] == 0]
    assert rank0 and rank0[0]["action"] == "restart", faults(run_dir)
    assert f"step {step}: a collective failed on rank 0" in rank0[0]["error"], rank0
    assert "timed out" in rank0[0]["error"].lower(), rank0
    # The stopped rank was killed, not failed: the fault log has rank 0's failure only.
    assert [f["rank"] for f in faults(run_dir)] == [0], faults(run_dir)
    assert "stopped rank(s) 1 of the group with SIGKILL at once" in out, out[-4000:]
    # Measured on rank 0's log clock, so that a loaded machine's slower starts do not count:
    # the stall lasts the timeout (6 s), and the restarted processes are created within
    # seconds of rank 0's failure.
    lines = (run_dir / "train.log").read_text().splitlines()
    failed = next(i for i, line in enumerate(lines) if f"step {step}: a collective failed" in line)
    before = max(i for i in range(failed) if " train step " in lines[i])  # a step per line
    (stalled,) = seconds_between(lines[before], lines[failed])
    assert timeout_s - 1 <= stalled < timeout_s + 10, lines[before : failed + 1]
    restarted = starts_created(run_dir)[1] - clock(lines[failed])
    assert restarted < RESTART_GAP_S, lines[failed:]
    assert restart_gaps(run_dir)[0] < timeout_s + RESTART_GAP_S
    assert_bitwise(final_state(run_dir, "ddp"), final_state(uninterrupted("ddp"), "ddp"))


@pytest.mark.parametrize(
    "kind,code,action",
    [("sigusr1", 75, "preempted"), ("sigterm-launcher", 75, "preempted"), ("user", 2, "stop")],
)
def test_a_preemption_or_an_error_to_fix_is_not_restarted(setup, kind, code, action):
    """75 (preempted: the checkpoint is saved, the scheduler requeues) and 2 (the message
    names a fix) end the job with that code although restarts are left. A SIGTERM to the
    launcher (a scheduler's) is forwarded to the workers, which save and exit 75."""
    root, config = setup
    run_dir = root / f"not_restarted_{kind}"
    got, out, _ = launch(launcher(3) + faulty(config, run_dir, [kind], [7]))
    assert got == code, out[-4000:]
    assert starts(run_dir) == 1, out[-4000:]
    assert {f["action"] for f in faults(run_dir)} == {action}, faults(run_dir)
    if kind == "user":
        # One line, from the launcher (the worker prints none), and no failure report.
        message = "error (rank 1): injected error a person must fix, at step 7"
        assert out.count("injected error a person must fix") == 1, out[-4000:]
        assert f"aiayn.distributed.run: {message}" in out, out[-4000:]
        assert "Traceback" not in out and "FAILED" not in out, out[-4000:]
    if kind == "sigusr1":
        # Signalled during step 7: step 8 starts the vote that carries it (StopVote), step 9
        # reads it, and both ranks stop after step 9 and save: rank 0, which got no signal,
        # learned it from the vote (the flag is reduced with the step's token count).
        assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000009"
        log = (run_dir / "train.log").read_text()
        assert "stop requested: saved step 9 (signal on another rank)" in log, log[-3000:]
        assert "aiayn train: preempted: checkpoint of step 9 saved" in out  # rank 1 said so
    if code == 75:
        assert "not restarted, exiting 75" in out
        assert {f["exitcode"] for f in faults(run_dir)} == {75}, faults(run_dir)
    if kind == "sigterm-launcher":
        # Forwarded to both ranks a moment after rank 1 began step 7 (rank 0 may not have
        # voted in step 7 yet): they stop together, after step 8 at the earliest, and save
        # the step they stopped after.
        assert "got SIGTERM: forwarded to the workers, which saved" in out, out[-4000:]
        saved = re.search(r"stop requested: saved step (\d+)", (run_dir / "train.log").read_text())
        assert saved and int(saved.group(1)) >= 8, out[-4000:]
        latest = (run_dir / "checkpoints" / "latest").read_text().strip()
        assert latest == f"step_{int(saved.group(1)):08d}", latest


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
