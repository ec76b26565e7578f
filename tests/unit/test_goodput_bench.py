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


def test_each_failure_is_split_into_relaunch_time_and_steps_trained_again() -> None:
    # Killed during step 6 after step 5 ended at t=1.5; the relaunch resumed from step 3 and started at t=4.5
    # (its start is logged 5 s before its first step, at t=9.5).
    events = _events((0, [(s, 1.0 + 0.1 * s) for s in range(1, 6)]), (3, [(4, 9.5), (5, 9.6)]))
    arm = goodput.arm_summary(
        "dcp",
        {"wall_s": 12.0, "digest": "d", "events": events},
        {"wall_s": 2.0, "useful_s": 1.0, "digest": "d"},
        1,
    )
    assert arm["relaunch_s"] == [3.0] and arm["redone_steps"] == [2]
    assert arm["step_s"] == pytest.approx(0.1)


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


def _replica(*attempts: list[tuple[int, int, bool]], done: str | None = "d") -> dict:
    """One torchft replica's events: per attempt, its steps as (step, participants, committed)."""
    events: list[dict] = []
    for attempt, steps in enumerate(attempts):
        events.append({"event": "start", "attempt": attempt, "t": 0.0})
        events += [
            {"event": "step", "step": s, "participants": p, "committed": c, "t": 0.0}
            for s, p, c in steps
        ]
    if done is not None:
        events.append({"event": "done", "digest": done, "t": 0.0})
    return {"events": events, "digest": done}


def test_torchft_goodput_counts_the_batches_trained_not_the_steps() -> None:
    from qualification.bench import goodput_torchft

    # Replica 0 is killed in step 3 and rejoins at step 6 (healed from replica 1, which took 3-5 alone).
    survivor = _replica([(s, 2 if s < 3 or s > 5 else 1, True) for s in range(1, 9)])
    victim = _replica([(1, 2, True), (2, 2, True)], [(6, 2, True), (7, 2, True), (8, 2, True)])
    run = {"wall_s": 40.0, "replicas": [victim, survivor], "fired": 1}
    ideal = {"wall_s": 20.0, "useful_s": 16.0, "digest": "d"}
    arm = goodput_torchft.summary(run, ideal, failures=1, steps=8)
    assert arm["replica_steps_trained"] == 13 and arm["replica_steps_wanted"] == 16
    assert arm["steps_one_replica_alone"] == [3, 4, 5] and arm["resume_steps"] == [5]
    assert arm["goodput"] == round(16.0 * 13 / 16 / 40.0, 4)
    assert arm["wasted_per_failure_s"] == 20.0 and arm["failures_fired"] == 1


def test_a_torchft_failure_waits_for_a_whole_quorum_and_fires_once(tmp_path) -> None:
    from qualification.bench.goodput_torchft_rank import pending

    assert pending(tmp_path, [5, 10], 4) is None
    assert (
        pending(tmp_path, [5, 10], 7) == 5
    )  # due at 5, not fired yet: fires at the next whole step
    (tmp_path / "fired-5").touch()
    assert pending(tmp_path, [5, 10], 9) is None and pending(tmp_path, [5, 10], 12) == 10
