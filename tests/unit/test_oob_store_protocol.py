"""The parent's reading of the store process's lines and exit (:mod:`gemscout.watch.store_protocol`)."""

from __future__ import annotations

import signal

from gemscout.watch.store_protocol import ChildLine, death_cause, parse_line


def test_each_kind_of_line_is_read() -> None:
    assert parse_line("ready") == ChildLine(kind="ready", text="ready")
    assert parse_line('swept 3 ["a/1", "b"]') == ChildLine(
        kind="swept", text='swept 3 ["a/1", "b"]', count=3, sample=("a/1", "b")
    )
    assert parse_line("pressure 268435456").kind == "pressure"
    assert parse_line("stuck: full").kind == "other"
    assert parse_line("ready now").kind == "other"  # only the bare word says it serves
    assert len(parse_line("x" * 1000).text) == 300


def test_a_swept_line_cut_short_keeps_what_is_whole() -> None:
    assert parse_line('swept 7 ["a", "b').count == 7
    assert parse_line('swept 7 ["a", "b').sample is None
    assert parse_line("swept 1").count == 1
    assert parse_line("swept").count is None


def test_the_cause_names_the_end_the_cap_and_the_last_lines() -> None:
    tail = ["swept 3 []", "pressure 1", "sweep-failed MemoryError: x"]
    killed = death_cause(41, -signal.SIGKILL, tail=tail, pressure=True, cap_bytes=256 << 20)
    assert killed == (
        "store process 41 was killed by SIGKILL, having reached 90 % of its 256 MiB cap (a flood?); "
        "its last output: sweep-failed MemoryError: x"
    )
    stuck = death_cause(41, 75, tail=[], pressure=False, cap_bytes=256 << 20)
    assert stuck == (
        "store process 41 exited: it was full to its memory cap and could not be swept (a flood that never paused)"
    )
    assert (
        death_cause(41, 1, tail=[], pressure=False, cap_bytes=16 << 20)
        == "store process 41 exited with 1"
    )


def test_a_swept_line_whose_sample_is_not_a_list_keeps_its_count() -> None:
    # Not what the child writes; before the parser was its own part, this raised in the reader thread.
    for line in ("swept 3 5", 'swept 3 {"a": 1}', 'swept 3 "name"'):
        read = parse_line(line)
        assert read.kind == "swept" and read.count == 3 and read.sample is None, line
