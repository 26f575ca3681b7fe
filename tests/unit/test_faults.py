"""The fault log and the restart policy of aiayn.distributed.run, without processes (the
launches themselves: tests/distributed/test_restarts.py)."""

import time
from types import SimpleNamespace

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousTimeoutError
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from aiayn.cli import build_parser
from aiayn.distributed import faults
from aiayn.distributed.run import (
    RESTART_JOIN_TIMEOUT_S,
    _message,
    _train_arguments,
    exit_code,
    largest_world,
    restart_join_timeout,
    shorten_join_timeout,
    training_config,
)
from aiayn.distributed.run import main as run_main
from aiayn.errors import ConfigError

from helpers import free_port  # tests/helpers.py


def test_faults_are_appended_and_a_torn_last_line_is_skipped(tmp_path):
    faults.record(tmp_path, [faults.Fault(1, -9, "restart", node="n2")])
    faults.record(tmp_path, [faults.Fault(0, 1, "stop", "PeerError: step 3", attempt=1)])
    with open(tmp_path / faults.FAULTS_FILE, "a") as fh:
        fh.write('{"rank": 0, "exitc')  # a crash in the middle of a write
    got = faults.read(tmp_path)
    assert [(f.rank, f.exitcode, f.action, f.attempt) for f in got] == [
        (1, -9, "restart", 0),
        (0, 1, "stop", 1),
    ]
    assert got[0].node == "n2" and got[0].how == "SIGKILL" and got[1].how == "exit 1"
    assert faults.read(tmp_path / "nothing") == []


@pytest.mark.parametrize(
    "codes,restart",
    [([-9], True), ([1, -15], True), ([75], False), ([75, -15], False), ([2, 1], False)],
)
def test_only_faults_are_restarted(codes, restart):
    assert faults.should_restart(codes) is restart


@pytest.mark.parametrize(
    "codes,code", [([75, 75], 75), ([75, -15], 75), ([2, 1], 2), ([1, -9], 1), ([75, 1], 1)]
)
def test_the_launcher_exits_75_only_when_the_group_was_preempted(codes, code):
    failures = {rank: SimpleNamespace(exitcode=c) for rank, c in enumerate(codes)}
    assert exit_code(failures) == code


def test_torchruns_placeholders_are_not_taken_for_a_workers_message():
    assert _message({"message": "PeerError: step 4: a collective failed\nTraceback"}) == (
        "PeerError: step 4: a collective failed"
    )
    for placeholder in ("<N/A>", "To enable traceback see: ...", "Signal 9 (SIGKILL) received"):
        assert _message(placeholder) == ""


def test_the_run_dir_comes_from_the_training_command(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("run_dir: runs/a\ndata: {train: corpus/train}\n")
    train = ["train", "--config", str(config)]
    assert training_config(["aiayn", *train]).run_dir == "runs/a"
    assert training_config(["faulty.py", "raise", "1", "3", *train, "run_dir=b"]).run_dir == "b"
    assert training_config(["other.py", "--config", str(config)]) is None
    with pytest.raises(ConfigError, match="not found"):
        training_config(["aiayn", "train", "--config", str(tmp_path / "missing.yaml")])


@pytest.mark.parametrize(
    "args",
    [["--config", "c.yaml"], ["--config", "c.yaml", "a.b=1", "c=2"], ["x=1", "--config", "c.yaml"]],
)
def test_the_launcher_reads_a_training_command_as_aiayn_train_does(args):
    ours = _train_arguments().parse_args(args)
    theirs = build_parser().parse_args(["train", *args])
    assert (ours.config, ours.overrides) == (theirs.config, theirs.overrides)


def test_the_launcher_refuses_a_negative_restart_count_in_one_line(capsys):
    argv = ["--standalone", "--nproc-per-node=1", "--max-restarts=-2", "train.py"]
    assert run_main(argv) == faults.USER_ERROR_EXIT_CODE
    err = capsys.readouterr().err
    assert "--max-restarts=-2" in err and "0 or more" in err and "Traceback" not in err


def test_the_launcher_refuses_more_ranks_than_micro_batches_in_one_line(tmp_path, capsys):
    """The batch is checked against the most ranks --nnodes and --nproc-per-node start, before
    any worker: the message once, exit 2, no traceback; an elastic range is checked at its
    largest."""
    config = tmp_path / "run.yaml"
    config.write_text("data: {train: corpus}\ntrain: {max_tokens: 600, tokens_per_step: 1200}\n")
    train = ["-m", "aiayn", "train", "--config", str(config)]
    for nodes in ("1", "1:3"):
        argv = ["--standalone", f"--nnodes={nodes}", "--nproc-per-node=2", *train]
        if nodes == "1":
            argv[2] = "--nproc-per-node=3"
        assert run_main(argv) == faults.USER_ERROR_EXIT_CODE
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith("aiayn.distributed.run: error: train.tokens_per_step (1200) is 2")
        assert "run on at most 2 ranks" in err
    assert largest_world("2", "gpu") is None and largest_world("1:4", "8") == 32


def test_a_restarts_rendezvous_gives_up_on_a_lost_node_after_restart_join_timeout():
    """torch's c10d rendezvous, for real: the first start's join_timeout is 600 s; once the
    launcher has shortened it (as it does after the first start meets), a rendezvous whose
    second node never comes fails after the shorter one."""
    params = RendezvousParameters(
        backend="c10d",
        endpoint=f"127.0.0.1:{free_port()}",
        run_id="restart-join",
        min_nodes=2,
        max_nodes=2,
        join_timeout="600",
        is_host="true",
    )
    handler = get_rendezvous_handler(params)
    try:
        shorten_join_timeout(handler, 1)
        shorten_join_timeout(handler, 30)  # never lengthened
        started = time.monotonic()
        with pytest.raises(RendezvousTimeoutError):
            handler.next_rendezvous()
        assert time.monotonic() - started < 15  # 1 s, and torch's 5 s to leave the round
    finally:
        handler.shutdown()


def test_the_restart_join_timeout_comes_from_the_rendezvous_conf():
    assert restart_join_timeout("") == RESTART_JOIN_TIMEOUT_S
    assert restart_join_timeout("join_timeout=900,restart_join_timeout=20") == 20
    for bad in ("restart_join_timeout=0", "restart_join_timeout=soon"):
        with pytest.raises(ConfigError, match="restart_join_timeout"):
            restart_join_timeout(bad)


def test_a_ranks_error_file_is_whole_or_absent_for_the_agent(tmp_path, monkeypatch):
    """The message a failed rank leaves torchrun's agent parses, with the traceback for a fault
    and the message alone for an error a person must fix; and a rank killed while it writes
    leaves no file at all: an empty one made the agent raise instead of restarting the group
    (CI: JSONDecodeError in ProcessFailure, tests/distributed/test_restarts.py)."""
    import types

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from aiayn.cli import training
    from aiayn.errors import ConfigError

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        raise ValueError("corpus gone")
    except ValueError as exc:
        training.record_for_the_launcher(exc)
    failure = ProcessFailure(0, 1, 1, str(error_file))
    assert failure.message["message"] == "ValueError: corpus gone"
    assert "Traceback" in failure.message["extraInfo"]["py_callstack"]
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]
    training.record_for_the_launcher(ConfigError("train.max_tokens: not a number"))
    failure = ProcessFailure(0, 1, 2, str(error_file))
    assert failure.message["extraInfo"]["py_callstack"] == (
        "ConfigError: train.max_tokens: not a number"
    )

    error_file.unlink()

    def killed_while_writing(data, fh):
        fh.write('{"mess')  # then SIGKILL: nothing after this runs
        raise SystemExit(-9)

    monkeypatch.setattr(training, "json", types.SimpleNamespace(dump=killed_while_writing))
    with pytest.raises(SystemExit):
        training.record_for_the_launcher(ValueError("corpus gone"))
    assert not error_file.exists()  # the agent then reports the exit code alone
    assert ProcessFailure(0, 1, -9, str(error_file)).exitcode == -9
