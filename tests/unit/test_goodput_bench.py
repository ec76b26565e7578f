"""The goodput benchmark's arithmetic, on event logs written by hand (the multi-process run is the ``goodput`` cell
of ``qualify run healthy-path`` and ``make bench-goodput``)."""

from __future__ import annotations

import pytest

from qualification.bench import goodput
from qualification.errors import UsageError

pytestmark = pytest.mark.timeout(30)


def _events(*attempts: list[tuple[int, float]]) -> list[dict]:
    out: list[dict] = []
    for resume, steps in attempts:
        out.append({"event": "start", "resume": resume, "t": steps[0][1] - 5})
        out += [{"event": "step", "step": s, "t": t} for s, t in steps]
    return out


def test_step_times_never_span_a_restart() -> None:
    events = _events((0, [(1, 10.0), (2, 10.1), (3, 10.2)]), (2, [(3, 30.0), (4, 30.1)]))
    assert [round(x, 3) for x in goodput.step_times(events)] == [0.1, 0.1, 0.1]


def test_an_arm_is_charged_its_wall_time_beyond_the_ideal_run_per_failure() -> None:
    run = {
        "wall_s": 50.0,
        "digest": "d",
        "events": _events((0, [(1, 1.0)]), (6, [(7, 9.0)]), (14, [(15, 20.0)])),
    }
    ideal = {"wall_s": 20.0, "useful_s": 10.0, "digest": "d"}
    arm = goodput.arm_summary("gemscout", run, ideal, failures=2)
    assert arm["wasted_per_failure_s"] == 15.0 and arm["goodput"] == 0.2
    assert arm["attempts"] == 3 and arm["resume_steps"] == [6, 14] and arm["bitwise_equal_to_ideal"]
    assert not goodput.arm_summary("dcp", {**run, "digest": "other"}, ideal, failures=2)[
        "bitwise_equal_to_ideal"
    ]


def test_the_schedule_and_bad_arguments() -> None:
    assert goodput.parse(["--steps", "60", "--fail-every", "15"]).fail_steps == [15, 30, 45]
    for bad in (
        ["--steps", "3"],
        ["--fail-every", "1"],
        ["--steps", "10", "--fail-every", "10"],
        ["--state-mib", "0"],
    ):
        with pytest.raises(UsageError):
            goodput.parse(bad)
