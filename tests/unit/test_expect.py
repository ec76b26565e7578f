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
        {
            "recovered_step": 4,
            "bitwise_equal": True,
            "loss": {"le": 0.5},
            "localized_rank": {"in": [1, 2]},
            "gone": 1,
        },
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
    return Cell(
        id="t/cell",
        program="selftest",
        workload="none",
        topology="local",
        world_size=1,
        fault={"kind": "none"},
        seed=0,
        timeout_s=5.0,
        params={},
        expect=expectations,
        requires=(),
    )


def judged(
    tmp_path: Path, cell: Cell, *, exit_code: int = 0, timed_out: bool = False, result: Any = None
) -> CellOutcome:
    if result is not None:
        text = result if isinstance(result, str) else json.dumps(result)
        (tmp_path / "result.json").write_text(text)
    outcome = CellOutcome(
        cell=cell,
        verdict=Verdict.FAILED,
        reason="",
        exit_code=exit_code,
        timed_out=timed_out,
        log="log.txt",
    )
    judge(outcome, tmp_path, tmp_path)
    return outcome


def good_result(**observed: Any) -> dict[str, Any]:
    return {
        "cell_id": "t/cell",
        "status": "passed",
        "observed": observed,
        "metrics": {},
        "timeline": [{"t": 0.5, "event": "fault", "detail": "SIGKILL rank 1", "rank": 1}],
        "message": "ok",
    }


def test_pass_needs_exit_zero_valid_result_and_every_expectation(tmp_path: Path) -> None:
    outcome = judged(tmp_path, make_cell(answer=42), result=good_result(answer=42))
    assert outcome.verdict is Verdict.PASSED and outcome.result_file == "result.json"
    assert outcome.reason == "all 1 expectations met"


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"result": good_result(answer=41)}, "answer: expected 42, observed 41"),
        ({"timed_out": True, "exit_code": -9}, "timed out after 5 s"),
        (
            {"exit_code": 3, "result": good_result(answer=42)},
            "crashed: exit code 3; program said: ok",
        ),
        ({"exit_code": -9}, "crashed: killed by SIGKILL"),
        ({}, "wrote no result.json"),
        ({"result": "{not json"}, "result.json is not valid JSON"),
        (
            {"result": {**good_result(answer=42), "extra": 1}},
            "result.json fails its schema: 'extra': unknown key",
        ),
        (
            {"result": {**good_result(answer=42), "status": "ok"}},
            "result.json fails its schema: 'status'",
        ),
        (
            {"result": {**good_result(answer=42), "cell_id": "t/other"}},
            "result.json is for cell 't/other'",
        ),
        (
            {
                "result": {
                    **good_result(answer=42),
                    "status": "failed",
                    "message": "replicas differ",
                }
            },
            "program reported status 'failed'; program said: replicas differ",
        ),
    ],
)
def test_failures_say_why(tmp_path: Path, kwargs: dict[str, Any], reason: str) -> None:
    outcome = judged(tmp_path, make_cell(answer=42), **kwargs)
    assert outcome.verdict is Verdict.FAILED
    assert reason in outcome.reason, outcome.reason


def test_references_compare_one_observation_with_another_or_with_the_cells_parameters() -> None:
    want = {
        "attributed_step": {"ge": "fault.step", "le": "fault.step + params.rotation"},
        "detected_step": {"eq": "observed.expected_step"},
        "ranks": {"eq": "cell.world_size"},
    }
    scope = {"params": {"rotation": 4}, "fault": {"step": 10}, "cell": {"world_size": 3}}
    good = {"attributed_step": 14, "detected_step": 12, "expected_step": 12, "ranks": 3}
    assert expect.check(want, good, **scope) == []
    late = {**good, "attributed_step": 15, "detected_step": 13}
    assert expect.check(want, late, **scope) == [
        "attributed_step: expected >= fault.step (= 10) and <= fault.step + params.rotation (= 14), observed 15",
        "detected_step: expected == observed.expected_step (= 12), observed 13",
    ]


def test_a_reference_to_something_absent_is_unmet_never_a_pass() -> None:
    want = {
        "detected_step": {"eq": "observed.expected_step"},
        "step": {"le": "params.rotation + 1"},
    }
    assert expect.check(want, {"detected_step": None, "step": 1}) == [
        "detected_step: expected == observed.expected_step, but observed.expected_step is not reported or set for "
        "this cell",
        "step: expected <= params.rotation + 1, but params.rotation is not reported or set for this cell",
    ]
    # A sum over a non-number is unmet too (None + 1 is not a bound).
    assert expect.check({"step": {"le": "observed.x + 1"}}, {"step": 1, "x": None}) == [
        "step: expected <= observed.x + 1, but observed.x is null, not a number"
    ]
    # ... and so is eq against an observation that is null: null never equals a number.
    assert expect.check({"d": {"eq": "observed.e"}}, {"d": 4, "e": None}) == [
        "d: expected == observed.e (= null), observed 4"
    ]


def test_a_measurement_cell_is_measured_with_each_target_never_passed(tmp_path: Path) -> None:
    from qualification.campaign import Campaign, Claim
    from qualification.claims import evaluate, scope_of

    targets = [
        {"name": "gemini throughput", "met": True, "detail": "-2.0 % against a floor of -5 %"},
        {"name": "scout p95", "met": False, "detail": "+20.0 % against a ceiling of +7.5 %"},
    ]
    outcome = judged(tmp_path, make_cell(), result={**good_result(), "targets": targets})
    assert outcome.verdict is Verdict.MEASURED
    assert outcome.reason == (
        "measured: 1 of 2 targets met; missed: scout p95 (+20.0 % against a ceiling of +7.5 %)"
    )
    assert outcome.to_json()["targets"] == targets
    # A claim it backs holds only when every target was met.
    claims = Campaign(
        name="t",
        tier="cpu",
        description="d",
        validated=("overhead within thresholds",),
        not_validated=(),
        path=tmp_path,
        source=b"",
        cells=(outcome.cell,),
        claims=(Claim(text="overhead within thresholds", cells=()),),
    )
    bounds = evaluate(
        claims, [outcome], scope_of(claims, [outcome], filter_expr=None, seed_override=None)
    )
    assert bounds["validated"] == []
    assert bounds["not_validated"][0]["reason"].startswith(
        "target missed: 1 of 1 backing cells (t/cell: measured: 1"
    )


def test_campaign_verdicts_count_measured_cells_apart() -> None:
    from qualification.engine import campaign_verdict

    assert campaign_verdict({"passed": 3, "failed": 0, "skipped": 0, "measured": 1}) == "passed"
    assert campaign_verdict({"passed": 0, "failed": 0, "skipped": 0, "measured": 2}) == "measured"
    assert (
        campaign_verdict({"passed": 2, "failed": 0, "skipped": 1, "measured": 0})
        == "passed-with-skips"
    )
    assert campaign_verdict({"passed": 0, "failed": 0, "skipped": 3, "measured": 0}) == "skipped"
    assert campaign_verdict({"passed": 5, "failed": 1, "skipped": 0, "measured": 0}) == "failed"
