"""Lateness from the job's own collectives (scout/comm_probe.py), without a process group: the rank that arrives
late waits the least, and it alone is named, with its host; punctual jitter and rounds without timings name no one."""

from __future__ import annotations

import pytest

from gemscout.scout.comm_probe import job_comm_report, lateness_timings
from gemscout.scout.stragglers import CommStragglerDetector, StragglerConfig

HOSTS = {0: "a", 1: "b", 2: "c"}


def _entries(waits: dict[int, float | None]) -> dict[int, dict[str, object]]:
    return {
        r: ({"records": {}} if w is None else {"records": {}, "comm_s": w})
        for r, w in waits.items()
    }


@pytest.mark.timeout(30)
def test_lateness_is_the_longest_wait_minus_ones_own() -> None:
    timings = lateness_timings({0: 0.5, 1: 0.45, 2: 0.01})
    assert timings is not None
    assert {n: (sorted(t.members), round(t.seconds, 6)) for n, t in timings.items()} == {
        "rank-0-late": ([0], 0.0),
        "rank-1-late": ([1], 0.05),
        "rank-2-late": ([2], 0.49),
    }
    assert lateness_timings({0: 0.5, 1: None}) is None
    assert lateness_timings({}) is None


@pytest.mark.timeout(30)
def test_the_late_rank_and_its_host_are_named_after_confirmations() -> None:
    detector = CommStragglerDetector(StragglerConfig(absolute_margin_s=0.05, confirmations=2))
    assert job_comm_report(detector, 1, _entries({0: 0.40, 1: 0.41, 2: 0.002}), HOSTS) is None
    report = job_comm_report(detector, 2, _entries({0: 0.42, 1: 0.40, 2: 0.001}), HOSTS)
    assert report is not None
    assert (report.kind.value, report.scope.value, report.ranks, report.host) == (
        "straggler",
        "node",
        (2,),
        "c",
    )
    assert report.evidence["signal"] == "communication" and report.evidence["wait_s"]["2"] == 0.001
    assert report.reason.startswith("late to the job's collectives")


@pytest.mark.timeout(30)
def test_jitter_and_missing_timings_name_no_one() -> None:
    detector = CommStragglerDetector(StragglerConfig(absolute_margin_s=0.05, confirmations=1))
    assert job_comm_report(detector, 1, _entries({0: 0.010, 1: 0.030, 2: 0.002}), HOSTS) is None
    assert job_comm_report(detector, 2, _entries({0: 0.40, 1: None, 2: 0.001}), HOSTS) is None
    # Two late ranks at once: no single rank is common to the slow timings, so no one is named.
    assert job_comm_report(detector, 3, _entries({0: 0.40, 1: 0.001, 2: 0.001}), HOSTS) is None


@pytest.mark.timeout(30)
def test_lateness_is_judged_within_each_shard_group() -> None:
    """FSDP2: ranks wait only for the members of their own shard group. Group (2, 3) is uniformly slower (a slow
    replica all-reduce elsewhere) without anyone late inside it; rank 1 is late inside (0, 1). Judged over the
    whole job, rank 2 and 3 would look punctual and rank 1 would be lost in the mix; per group, rank 1 alone is."""
    waits = {0: 0.40, 1: 0.01, 2: 0.90, 3: 0.90}
    timings = lateness_timings(waits, groups=[(0, 1), (2, 3)])
    assert timings is not None
    assert {n: round(t.seconds, 6) for n, t in timings.items()} == {
        "rank-0-late": 0.0,
        "rank-1-late": 0.39,
        "rank-2-late": 0.0,
        "rank-3-late": 0.0,
    }
    detector = CommStragglerDetector(StragglerConfig(absolute_margin_s=0.05, confirmations=1))
    report = job_comm_report(
        detector,
        1,
        _entries(waits),
        {0: "a", 1: "b", 2: "c", 3: "d"},
        groups=[(0, 1), (2, 3)],
        source="FSDP2 all-gather / reduce-scatter",
    )
    assert report is not None and report.ranks == (1,) and report.host == "b"
    assert "FSDP2" in report.evidence["source"]
