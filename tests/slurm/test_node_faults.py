"""slurm/train.sbatch after a fault: restarted in place while MAX_RESTARTS last; after that the
job is requeued avoiding the node that failed. Either way the run ends with the weights of a run
that was never interrupted."""

import json
import re

import pytest
from jobs import (  # tests/slurm/jobs.py
    DEMO,
    ROOT,
    SBATCH,
    assert_same_weights,
    demo_overrides,
    describe,
    job_env,
    kill_rank,
    sbatch_args,
    wait_for_step,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


# A checkpoint every 10 steps: the restarted group resumes from step 10 or 20, not from scratch.
SAVE_OFTEN = "checkpoint.every_steps=10"


def resumed_at(run_dir) -> list[int]:
    text = (run_dir / "train.log").read_text()
    return [int(s) for s in re.findall(r"resumed from \S+ \(step (\d+)\)", text)]


def faults_logged(run_dir):
    return [json.loads(line) for line in (run_dir / "faults.jsonl").read_text().splitlines()]


def test_a_fault_is_restarted_in_place_without_a_requeue(slurm, corpus, straight, tmp_path):
    run_dir = tmp_path / "run"
    out = tmp_path / "run.slurm.out"
    env = {**job_env(), "MAX_RESTARTS": "1"}
    job_id = slurm.sbatch([*sbatch_args(corpus, run_dir, out), SAVE_OFTEN], env=env)
    wait_for_step(slurm, job_id, out, run_dir, 20)
    node = kill_rank(job_id, 0)
    job = slurm.wait(job_id, timeout=300)
    info = describe(job, out, run_dir)
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", info
    text = out.read_text()
    assert job["Restarts"] == "0" and "restart 1 (SLURM_RESTART_COUNT)" not in text, info
    assert "restarting the group from the latest checkpoint" in text, info
    rows = faults_logged(run_dir)
    killed = [r for r in rows if r["exitcode"] == -9]
    assert [(r["rank"], r["node"], r["action"]) for r in killed] == [(0, node, "restart")], rows
    assert not (run_dir / "excluded_nodes").exists()
    assert resumed_at(run_dir) in ([10], [20]), info
    assert_same_weights(run_dir, straight[0])


def test_a_node_that_failed_is_excluded_and_the_requeued_job_finishes_on_another(
    slurm, corpus, straight, tmp_path
):
    """One node x 2 processes (the same 2 ranks as the reference run, on one node); the
    worker of rank 0 is killed with no in-job restarts left."""
    run_dir = tmp_path / "run"
    out = tmp_path / "run.slurm.out"
    args = ["-N1", "--cpus-per-task=2", f"--chdir={ROOT}", f"--output={out}",
            str(SBATCH), str(DEMO), *demo_overrides(corpus, run_dir), SAVE_OFTEN]  # fmt: skip
    env = {**job_env(), "MAX_RESTARTS": "0", "NPROC_PER_NODE": "2"}
    job_id = slurm.sbatch(args, env=env)
    wait_for_step(slurm, job_id, out, run_dir, 20)
    node = kill_rank(job_id, 0)
    other = ({"n1", "n2"} - {node}).pop()
    job = slurm.wait(job_id, timeout=300)
    info = describe(job, out, run_dir)
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", info
    assert job["Restarts"] == "1" and job["ExcNodeList"] == node, info
    assert job["NodeList"] == other, info
    text = out.read_text()
    assert f"requeueing job {job_id} excluding [{node}]" in text, info
    assert f"restart 1 (SLURM_RESTART_COUNT): 1 node(s) [{other}]" in text, info
    rows = faults_logged(run_dir)
    killed = [r for r in rows if r["exitcode"] == -9]
    assert [(r["node"], r["action"], r["slurm_restart"]) for r in killed] == [(node, "stop", 0)]
    assert (run_dir / "excluded_nodes").read_text() == f"{node}\n"
    assert resumed_at(run_dir) in ([10], [20]), info
    assert_same_weights(run_dir, straight[0])


def test_a_job_that_would_exclude_too_many_nodes_stops_and_says_why(slurm, corpus, tmp_path):
    """2 nodes of 2: excluding the failed one would leave 1 for a job of 2."""
    run_dir = tmp_path / "run"
    out = tmp_path / "run.slurm.out"
    job_id = slurm.sbatch(sbatch_args(corpus, run_dir, out), env={**job_env(), "MAX_RESTARTS": "0"})
    wait_for_step(slurm, job_id, out, run_dir, 5)
    node = kill_rank(job_id, 0)
    job = slurm.wait(job_id, timeout=120)
    info = describe(job, out, run_dir)
    assert job["JobState"] == "FAILED" and job["Restarts"] == "0", info
    text = out.read_text()
    assert f"stopping: job {job_id} failed with 'SIGKILL'; excluding {node} would leave 1" in text
    assert "not requeued" in text and not (run_dir / "excluded_nodes").exists(), info


def test_a_job_that_starts_on_an_excluded_node_requeues_itself_avoiding_it(slurm, corpus, tmp_path):
    """A resubmitted run whose excluded_nodes names n1, where Slurm puts a 1-node job first."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "excluded_nodes").write_text("n1\n")
    out = tmp_path / "run.slurm.out"
    args = ["-N1", f"--chdir={ROOT}", f"--output={out}", str(SBATCH), str(DEMO),
            *demo_overrides(corpus, run_dir), "train.max_steps=5"]  # fmt: skip
    job_id = slurm.sbatch(args, env=job_env())
    job = slurm.wait(job_id, timeout=120)
    info = describe(job, out, run_dir)
    assert job["JobState"] == "COMPLETED" and job["NodeList"] == "n2", info
    assert job["Restarts"] == "1" and job["ExcNodeList"] == "n1", info
    assert "landed on n1, which" in out.read_text(), info
