"""aiayn/infer/translate_file.py: chunk cuts at line starts, every line translated once and in
order, a resumed translation skips the chunks written, and parts of another translation are
refused; n-best lists numbered across the file.
(Two ranks under torchrun: tests/distributed/test_translate_ranks.py.)"""

from functools import partial

import pytest

from aiayn.errors import DataError
from aiayn.infer.translate import n_best_lines, renumbered
from aiayn.infer.translate_file import chunk_starts, translate_file

LINES = [f"line {i} " + "x" * (i % 17) for i in range(500)] + ["", "  ", "ünïcødé"]


def upper(calls):
    def translate(lines, chunk=0):
        calls.append(len(lines))
        return [line.upper() for line in lines]

    return translate


def test_cuts_fall_at_line_starts_and_cover_the_file(tmp_path):
    path = tmp_path / "in.txt"
    path.write_text("".join(line + "\n" for line in LINES))
    data = path.read_bytes()
    starts = chunk_starts(path, 1000)
    assert starts[0] == 0 and starts[-1] == len(data) and starts == sorted(set(starts))
    assert all(data[s - 1 : s] == b"\n" for s in starts[1:-1])
    assert 5 < len(starts) < 20


@pytest.mark.parametrize("world", [1, 3])
def test_every_line_once_in_order_at_any_world_size(tmp_path, world):
    source, out = tmp_path / "in.txt", tmp_path / "out.txt"
    source.write_text("".join(line + "\n" for line in LINES))
    calls = []

    def other_ranks():  # run, in turn, where rank 0 first waits for them (after the plan)
        for rank in range(1, world):
            translate_file(upper(calls), source, out, {"m": 1}, rank, world, chunk_bytes=1000)

    barriers = iter([other_ranks, lambda: None, lambda: None])
    translate_file(
        upper(calls), source, out, {"m": 1}, 0, world, lambda: next(barriers)(), chunk_bytes=1000
    )
    assert out.read_text().split("\n")[:-1] == [line.upper() for line in LINES]
    assert sum(calls) == len(LINES) and not out.with_name("out.txt.parts").exists()


def test_a_resumed_translation_skips_what_was_written_and_refuses_other_parts(tmp_path):
    source, out = tmp_path / "in.txt", tmp_path / "out.txt"
    source.write_text("".join(line + "\n" for line in LINES))
    parts = out.with_name("out.txt.parts")
    calls = []

    def dies_after_two(lines, chunk):
        if len(calls) == 2:
            raise KeyboardInterrupt  # a kill after two chunks
        return upper(calls)(lines)

    with pytest.raises(KeyboardInterrupt):
        translate_file(dies_after_two, source, out, {"m": 1}, chunk_bytes=1000)
    assert len(list(parts.glob("0*.txt"))) == 2 and not out.exists()
    again = []
    translate_file(upper(again), source, out, {"m": 1}, chunk_bytes=1000)
    assert out.read_text().split("\n")[:-1] == [line.upper() for line in LINES]
    assert sum(again) == len(LINES) - sum(calls)  # the two chunks were not translated again
    # Parts made with another checkpoint or settings are not mixed in.
    with pytest.raises(KeyboardInterrupt):
        translate_file(dies_after_two, source, out, {"m": 1}, chunk_bytes=1000)
    with pytest.raises(DataError, match=r"holds parts of another translation"):
        translate_file(upper([]), source, out, {"m": 2}, chunk_bytes=1000)


def n_best(line: str) -> list[tuple[str, float]]:
    """1 to 3 hypotheses, so that a chunk's line count does not tell its sentences."""
    return [(f"{line.upper()} ||| {k}", -float(k)) for k in range(1 + len(line) % 3)]


@pytest.mark.parametrize("as_json", [False, True])
def test_n_best_lists_are_numbered_across_the_file_and_a_resume_keeps_sentences_whole(
    tmp_path, as_json
):
    source, out = tmp_path / "in.txt", tmp_path / "out.txt"
    source.write_text("".join(line + "\n" for line in LINES))
    parts = out.with_name("out.txt.parts")

    def lists(calls, dies_after=None):
        def translate(lines, chunk):  # as aiayn translate writes a chunk: numbered from 0
            if len(calls) == dies_after:
                raise KeyboardInterrupt  # a kill
            calls.append(len(lines))
            return n_best_lines([n_best(line) for line in lines], as_json=as_json)

        return translate

    renumber = partial(renumbered, as_json=as_json)
    run = partial(translate_file, source=source, output=out, settings={"m": 1}, chunk_bytes=1000)
    first = []
    with pytest.raises(KeyboardInterrupt):
        run(lists(first, dies_after=2), renumber=renumber)
    written = [p.read_text(encoding="utf-8").split("\n")[:-1] for p in sorted(parts.glob("0*"))]
    assert [renumber(lines, 0)[1] for lines in written] == first  # whole sentences a part
    again = []
    run(lists(again), renumber=renumber)
    expected = n_best_lines([n_best(line) for line in LINES], as_json=as_json)
    assert out.read_text(encoding="utf-8").split("\n")[:-1] == expected
    assert sum(first) + sum(again) == len(LINES) and len(again) > 1


def test_a_missing_input_is_named(tmp_path, capsys):
    from aiayn.cli import main

    missing = tmp_path / "nowhere.txt"
    args = ["translate", "--checkpoint", str(tmp_path), "--input", str(missing), "--output", "x"]
    assert main(args) != 0
    assert f"--input {missing}: no such file" in capsys.readouterr().err
