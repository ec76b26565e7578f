"""Cell verdicts: expectation matching and the engine's judgement of a finished driver."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from qualification import expect
from qualification.campaign import Cell
from qualification.outcome import CellOutcome, Verdict, judge

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("want", "got", "ok"),
    [
        (4, 4, True),
        (4, 4.0, True),
        (4, 3, False),
        (True, True, True),
        (True, 1, False),  # Python says True == 1; a bitwise_equal expectation must not
        (1, True, False),
        ("ddp", "ddp", True),
        ("4", 4, False),
        ([1, 2], [1, 2], True),
        ([1, 2], [2, 1], False),
        ({"le": 0.5}, 0.5, True),
        ({"le": 0.5}, 0.7, False),
        ({"ge": 1, "le": 3}, 2, True),
        ({"ge": 1, "le": 3}, 4, False),
        ({"ge": 1}, "2", False),
        ({"ge": 1}, True, False),
        ({"in": [1, 2]}, 2, True),
        ({"in": [1, 2]}, 3, False),
        ({"in": [True]}, 1, False),
    ],
)
def test_holds(want: Any, got: Any, ok: bool) -> None:
    assert expect.holds(want, got) is ok


def test_check_names_key_expected_and_observed() -> None:
    mismatches = expect.check(
        {"recovered_step": 4, "bitwise_equal": True, "loss": {"le": 0.5}, "localized_rank": {"in": [1, 2]}, "gone": 1},
        {"recovered_step": 3, "bitwise_equal": True, "loss": 0.7, "localized_rank": 0},
    )
    assert mismatches == [
        "recovered_step: expected 4, observed 3",
        "loss: expected <= 0.5, observed 0.7",
        "localized_rank: expected one of [1, 2], observed 0",
        "gone: expected 1, but the program did not report it",
    ]
    assert expect.check({"a": True}, {"a": True}) == []


def make_cell(**expectations: Any) -> Cell:
    return Cell(id="t/cell", program="selftest", workload="none", topology="local", world_size=1,
                fault={"kind": "none"}, seed=0, timeout_s=5.0, params={}, expect=expectations, requires=())


def judged(tmp_path: Path, cell: Cell, *, exit_code: int = 0, timed_out: bool = False,
           result: Any = None) -> CellOutcome:
    if result is not None:
        text = result if isinstance(result, str) else json.dumps(result)
        (tmp_path / "result.json").write_text(text)
    outcome = CellOutcome(cell=cell, verdict=Verdict.FAILED, reason="", exit_code=exit_code, timed_out=timed_out,
                          log="log.txt")
    judge(outcome, tmp_path, tmp_path)
    return outcome


def good_result(**observed: Any) -> dict[str, Any]:
    return {"cell_id": "t/cell", "status": "passed", "observed": observed, "metrics": {},
            "timeline": [{"t": 0.5, "event": "fault", "detail": "SIGKILL rank 1", "rank": 1}], "message": "ok"}


def test_pass_needs_exit_zero_valid_result_and_every_expectation(tmp_path: Path) -> None:
    outcome = judged(tmp_path, make_cell(answer=42), result=good_result(answer=42))
    assert outcome.verdict is Verdict.PASSED and outcome.result_file == "result.json"
    assert outcome.reason == "all 1 expectations met"


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"result": good_result(answer=41)}, "answer: expected 42, observed 41"),
        ({"timed_out": True, "exit_code": -9}, "timed out after 5 s"),
        ({"exit_code": 3, "result": good_result(answer=42)}, "crashed: exit code 3; program said: ok"),
        ({"exit_code": -9}, "crashed: killed by SIGKILL"),
        ({}, "wrote no result.json"),
        ({"result": "{not json"}, "result.json is not valid JSON"),
        ({"result": {**good_result(answer=42), "extra": 1}}, "result.json fails its schema: 'extra': unknown key"),
        ({"result": {**good_result(answer=42), "status": "ok"}}, "result.json fails its schema: 'status'"),
        ({"result": {**good_result(answer=42), "cell_id": "t/other"}}, "result.json is for cell 't/other'"),
        ({"result": {**good_result(answer=42), "status": "failed", "message": "replicas differ"}},
         "program reported status 'failed'; program said: replicas differ"),
    ],
)
def test_failures_say_why(tmp_path: Path, kwargs: dict[str, Any], reason: str) -> None:
    outcome = judged(tmp_path, make_cell(answer=42), **kwargs)
    assert outcome.verdict is Verdict.FAILED
    assert reason in outcome.reason, outcome.reason
