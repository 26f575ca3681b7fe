"""slurm/train.sbatch's policy after a failed job start (aiayn.distributed.node_exclusion):
which nodes to blame and exclude, when to stop requeueing. No cluster: faults.jsonl is written
by hand."""

from pathlib import Path

import pytest

from aiayn.distributed import faults, node_exclusion
from aiayn.distributed.faults import Fault

CLUSTER = ["n1", "n2", "n3"]
DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


def fault(node, restart, exitcode=-9, error="", action="stop", job="7", rank=0, t=0.0):
    return Fault(rank, exitcode, action, error, 0, node, t, job, restart)


def fail(run_dir, restart, nodes=("n1",), max_failures=3, job="7", cluster=CLUSTER, rc=1):
    nodes = list(nodes)
    return node_exclusion.after_failure(run_dir, job, restart, rc, nodes, cluster, max_failures)


def test_the_node_whose_worker_failed_is_excluded_and_the_list_grows(tmp_path):
    faults.record(tmp_path, [fault("n1", 0, error="RuntimeError: boom at step 12")])
    first = fail(tmp_path, 0)
    assert (first.action, first.exclude) == ("requeue", ["n1"])
    assert node_exclusion.read_excluded(tmp_path) == ["n1"]
    faults.record(tmp_path, [fault("n2", 1, exitcode=1, error="CUDA error: ECC at step 40")])
    second = fail(tmp_path, 1, nodes=("n2",))
    assert (second.action, second.exclude) == ("requeue", ["n1", "n2"])
    assert (tmp_path / node_exclusion.EXCLUDED_FILE).read_text() == "n1\nn2\n"
    assert "action=requeue\nexclude=n1,n2\nmessage=job 7 failed" in second.shell()


def test_a_job_that_fails_the_same_way_n_times_in_a_row_stops_with_a_message(tmp_path):
    for restart, node in enumerate(["n1", "n2", "n3"]):
        # A node's failure (a signal) three times, each on another node.
        faults.record(tmp_path, [fault(node, restart, -7, f"bus error at step {restart}")])
    assert fail(tmp_path, 0, nodes=["n1"], cluster=CLUSTER + ["n4"]).action == "requeue"
    assert fail(tmp_path, 1, nodes=["n2"], cluster=CLUSTER + ["n4"]).action == "requeue"
    third = fail(tmp_path, 2, nodes=["n3"], cluster=CLUSTER + ["n4"])
    assert third.action == "stop"
    assert "3 times in a row (MAX_JOB_FAILURES=3)" in third.message
    assert "SIGBUS: bus error at step N" in third.message and "resubmit" in third.message
    assert node_exclusion.read_excluded(tmp_path) == ["n1", "n2"]  # the stopping start adds none


def test_an_error_that_is_no_nodes_blames_none_and_stops_when_it_repeats(tmp_path):
    """A bug, a corpus, the batch out of memory: the same on any node. The first is requeued
    (it may have been passing) excluding nobody; the same error again stops the job with it."""
    for restart, node in enumerate(["n1", "n2"]):
        faults.record(tmp_path, [fault(node, restart, 1, f"OutOfMemoryError at step {restart}")])
    first = fail(tmp_path, 0, nodes=["n1"])
    assert (first.action, first.exclude) == ("requeue", [])
    assert "no node to blame" in first.message
    second = fail(tmp_path, 1, nodes=["n2"])
    assert second.action == "stop" and node_exclusion.read_excluded(tmp_path) == []
    assert "'exit N: OutOfMemoryError at step N' again, on n2" in second.message
    assert "fails the same way on any node" in second.message


@pytest.mark.parametrize(
    ("exitcode", "error", "nodes"),
    [
        (-9, "", True),  # SIGKILL: the kernel's OOM killer, a node going down
        (-11, "", True),  # SIGSEGV
        (1, "RuntimeError: CUDA error: uncorrectable ECC error encountered", True),
        (1, "torch.distributed.DistBackendError: NCCL error in: ...", True),
        (1, "RuntimeError: injected fault at step 4", False),  # a bug would be everywhere
        (1, "ValueError: no oxide in the becca table", False),  # Xid and ECC as words only
        (1, "DataError: corpus file not found: /data/train.de", False),
        (1, "ConnectionError: Couldn't reach 'wmt/wmt14' on the Hub", False),
        (1, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", False),
    ],
)
def test_a_node_is_blamed_for_signals_and_device_errors_only(exitcode, error, nodes):
    assert node_exclusion.node_fault(fault("n1", 0, exitcode, error)) is nodes
    assert node_exclusion.culprits([fault("n1", 0, exitcode, error)], ["n1"]) == (
        ["n1"] if nodes else []
    )


def test_failures_of_another_kind_or_a_preempted_start_between_break_the_row(tmp_path):
    faults.record(tmp_path, [fault("n1", 0, error="boom")])
    faults.record(tmp_path, [fault("n2", 1, exitcode=-11)])  # SIGSEGV: another way
    faults.record(tmp_path, [fault("n3", 3, error="boom")])  # start 2 was preempted
    assert fail(tmp_path, 0, max_failures=2).action == "requeue"
    assert fail(tmp_path, 1, nodes=["n2"], max_failures=2).action == "requeue"
    assert fail(tmp_path, 3, nodes=["n3"], max_failures=2, cluster=CLUSTER + ["n4"]).action == (
        "requeue"
    )


def test_never_every_node_the_job_stops_when_too_few_would_be_left(tmp_path):
    faults.record(tmp_path, [fault("n1", 0), fault("n2", 0, rank=1)])
    decision = fail(tmp_path, 0, nodes=["n1", "n2"])  # a 2-node job on a 3-node partition
    assert decision.action == "stop"
    assert "would leave 1 of the partition's 3 nodes for a job of 2" in decision.message
    assert node_exclusion.read_excluded(tmp_path) == []


def test_a_rank_that_lost_its_peer_is_not_blamed_the_node_that_failed_is(tmp_path):
    peer = "PeerError: step 21: a collective failed on rank 1 (gloo: Connection closed by peer)"
    faults.record(tmp_path, [fault("n2", 0, 1, peer, rank=1, t=1.0), fault("n1", 0, t=2.0)])
    assert fail(tmp_path, 0, nodes=["n1", "n2"]).exclude == ["n1"]


def test_when_every_rank_lost_a_peer_the_silent_node_is_blamed(tmp_path):
    """A stalled rank (or a node whose launcher died with it) logs nothing."""
    peer = "PeerError: step 21: a collective failed on rank 1 (timed out)"
    faults.record(tmp_path, [fault("n2", 0, 1, peer, rank=1)])
    assert fail(tmp_path, 0, nodes=["n1", "n2"]).exclude == ["n1"]
    assert node_exclusion.culprits([], ["n1", "n2"]) == []  # nothing logged: nobody to blame


def test_only_this_jobs_start_is_read(tmp_path):
    faults.record(tmp_path, [fault("n3", 0, job="6"), fault("n1", 1), fault("n2", 0)])
    assert fail(tmp_path, 0, nodes=["n2"]).exclude == ["n2"]


@pytest.mark.parametrize(
    ("on", "job_excluded", "cluster", "action"),
    [
        (["n2"], [], CLUSTER, "run"),  # not on an excluded node
        (["n1"], [], CLUSTER, "requeue"),  # landed on one: requeue avoiding it
        (["n1"], ["n1"], CLUSTER, "run"),  # Slurm was told and put it there: would loop
        (["n1"], [], ["n1"], "run"),  # the only node: better run than never
    ],
)
def test_a_job_that_starts_on_an_excluded_node_requeues_itself(
    tmp_path, on, job_excluded, cluster, action
):
    (tmp_path / node_exclusion.EXCLUDED_FILE).write_text("n1\n")
    decision = node_exclusion.at_start(tmp_path, on, job_excluded, cluster)
    assert decision.action == action and decision.exclude == ["n1"]


def test_the_command_line_resolves_the_run_dir_from_the_config(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ["after-failure", "--job=7", "--restart=0", "--exit-code=1", "--nodes=n1",
            "--cluster-nodes=n1,n2", "--config", str(DEMO), f"run_dir={run_dir}"]  # fmt: skip
    faults.record(run_dir, [fault("n1", 0)])
    assert node_exclusion.main(argv) == 0
    assert capsys.readouterr().out.startswith("action=requeue\nexclude=n1\nmessage=job 7 ")
    assert node_exclusion.read_excluded(run_dir) == ["n1"]
    assert node_exclusion.main(["at-start", *argv[4:6], "--config", "nope.yaml"]) == 2


@pytest.mark.parametrize(
    "text, collective",
    [
        ("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234", True),
        ("Application timeout caused pair closure", True),  # an all-reduce waited for later
        ("CUDA out of memory. Tried to allocate 2.00 GiB", False),
        ("shape '[4, 8]' is invalid for input of size 30", False),
    ],
)
def test_a_collective_that_failed_is_told_from_other_runtime_errors(text, collective):
    """A collective that failed becomes a PeerError (a peer died or stalled, which a restart
    fixes), whatever gloo's words for it; another RuntimeError is this rank's own."""
    from aiayn.train.peers import is_collective_failure

    assert is_collective_failure(RuntimeError(text)) is collective
