"""Straggler statistics: both margins, R consecutive rounds, a per-rank baseline, the replay's own noise, the
run-queue clock, and slow-group intersection."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import time
from typing import Any

import pytest

from gemscout.errors import ConfigError
from gemscout.reports import FaultKind, FaultReport, Scope
from gemscout.scout.stragglers import (
    CommStragglerDetector,
    ComputeStragglerDetector,
    GroupTiming,
    StragglerConfig,
    SustainedStragglerDetector,
    compute_reports,
    job_clock,
    run_queue_seconds,
    waited_since,
)

MS = 1e-3


def healthy(n: int, seconds: float = 10 * MS) -> dict[int, float]:
    return dict.fromkeys(range(n), seconds)


def with_slow(n: int, slow: dict[int, float], seconds: float = 10 * MS) -> dict[int, float]:
    return {**healthy(n, seconds), **slow}


# ----------------------------------------------------------------------------------------------------- configuration


def test_config_defaults() -> None:
    config = StragglerConfig()
    assert config.relative_margin == 1.1
    assert config.absolute_margin_s == 0.002
    assert config.confirmations == 2
    assert (
        config.compute_confirmations == 4
    )  # two gave false reports on a loaded machine (scout-straggler loaded-1000)
    assert config.noise_factor == 6.0 and config.noise_window == 32
    assert config.sustained_window == 64 and config.sustained_margin == 1.15
    assert config.sustained_span_s == 30.0
    assert 1 <= config.baseline_min_samples <= config.baseline_window


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("relative_margin", 1.0),
        ("relative_margin", 0.5),
        ("relative_margin", math.nan),
        ("relative_margin", math.inf),
        ("relative_margin", True),
        ("relative_margin", "1.1"),
        ("absolute_margin_s", -0.001),
        ("absolute_margin_s", math.nan),
        ("absolute_margin_s", None),
        ("confirmations", 0),
        ("confirmations", 1.5),
        ("confirmations", True),
        ("compute_confirmations", 0),
        ("baseline_window", 0),
        ("baseline_min_samples", 0),
        ("baseline_min_samples", 17),
        ("baseline_margin", 1.0),
        ("baseline_margin", -2.0),
        ("noise_factor", -1.0),
        ("noise_factor", math.nan),
        ("noise_window", 1),
        ("noise_window", 2.5),
        ("sustained_window", -1),
        ("sustained_window", 1.5),
        ("sustained_margin", 1.0),
        ("sustained_margin", math.nan),
        ("sustained_span_s", -1.0),
        ("sustained_span_s", math.inf),
    ],
)
def test_bad_config_values_raise_config_error_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=f"StragglerConfig.{field}") as caught:
        StragglerConfig(**{field: value})
    assert isinstance(caught.value, ValueError)


def test_config_is_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        StragglerConfig(1.2)  # type: ignore[misc]
    config = StragglerConfig(relative_margin=1.2, absolute_margin_s=0, confirmations=1)
    with pytest.raises(AttributeError):
        config.confirmations = 3  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------------- compute: peers


@pytest.mark.parametrize("confirmations", [1, 2, 3])
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_a_slow_rank_past_both_margins_is_reported_after_r_rounds(
    confirmations: int, n: int
) -> None:
    detector = ComputeStragglerDetector(StragglerConfig(compute_confirmations=confirmations))
    slow_rank = n - 1
    reports = [
        detector.observe(step, with_slow(n, {slow_rank: 25 * MS})) for step in range(confirmations)
    ]
    assert reports[:-1] == [None] * (confirmations - 1)
    report = reports[-1]
    assert report is not None
    assert (report.kind, report.scope, report.ranks) == (
        FaultKind.STRAGGLER,
        Scope.RANK,
        (slow_rank,),
    )
    assert report.confirmations == confirmations
    assert report.step == confirmations - 1
    assert report.evidence["signal"] == "compute"
    assert report.evidence["times_s"][str(slow_rank)] == 25 * MS
    assert "peer_median" in report.evidence["criteria"][str(slow_rank)]
    assert FaultReport.from_json(report.to_json()) == report


def test_confirmed_straggler_keeps_reporting_with_a_growing_count() -> None:
    detector = ComputeStragglerDetector(StragglerConfig(compute_confirmations=2))
    counts = []
    for step in range(5):
        report = detector.observe(step, with_slow(4, {1: 30 * MS}))
        counts.append(None if report is None else report.confirmations)
    assert counts == [None, 2, 3, 4, 5]


def test_past_relative_but_under_absolute_margin_is_not_slow() -> None:
    # 1.5x the median, but only 0.5 ms above it: jitter on a short replay, not a straggler.
    detector = ComputeStragglerDetector()
    for step in range(20):
        assert detector.observe(step, with_slow(4, {3: 1.5 * MS}, seconds=1 * MS)) is None
    assert detector.consecutive(3) == 0


def test_past_absolute_but_under_relative_margin_is_not_slow() -> None:
    # 5 ms above the median, but only 1.05x a 100 ms replay.
    detector = ComputeStragglerDetector()
    for step in range(20):
        assert detector.observe(step, with_slow(4, {3: 105 * MS}, seconds=100 * MS)) is None


def test_intermittent_slowness_is_never_confirmed() -> None:
    detector = ComputeStragglerDetector(StragglerConfig(compute_confirmations=2))
    assert detector.observe(0, with_slow(4, {2: 30 * MS})) is None
    assert detector.consecutive(2) == 1
    assert detector.observe(1, healthy(4)) is None
    assert detector.consecutive(2) == 0  # a healthy round resets the count
    assert detector.observe(2, with_slow(4, {2: 30 * MS})) is None
    for step in range(3, 30):  # and keeps alternating
        times = with_slow(4, {2: 30 * MS}) if step % 2 == 0 else healthy(4)
        assert detector.observe(step, times) is None


def test_missing_from_a_round_breaks_the_chain() -> None:
    detector = ComputeStragglerDetector(StragglerConfig(compute_confirmations=2))
    assert detector.observe(0, with_slow(4, {3: 30 * MS})) is None
    assert detector.observe(1, healthy(3)) is None  # rank 3 did not report this round
    assert detector.observe(2, with_slow(4, {3: 30 * MS})) is None
    assert detector.observe(3, with_slow(4, {3: 30 * MS})) is not None


def test_two_stragglers_are_both_named() -> None:
    detector = ComputeStragglerDetector(StragglerConfig(compute_confirmations=2))
    detector.observe(0, with_slow(6, {1: 30 * MS, 4: 40 * MS}))
    report = detector.observe(1, with_slow(6, {1: 30 * MS, 4: 40 * MS}))
    assert report is not None and report.ranks == (1, 4)
    assert report.host is None


def test_a_single_peer_has_nothing_to_compare_with() -> None:
    detector = ComputeStragglerDetector(StragglerConfig(compute_confirmations=1))
    assert detector.observe(0, {0: 1.0}) is None
    assert detector.observe(1, {}) is None


def test_host_is_recorded_when_known() -> None:
    detector = ComputeStragglerDetector(StragglerConfig(compute_confirmations=1))
    hosts = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}
    report = detector.observe(0, with_slow(4, {2: 30 * MS}), rank_to_host=hosts)
    assert report is not None
    assert (report.scope, report.ranks, report.host) == (Scope.RANK, (2,), "node-b")


# ------------------------------------------------------------------------------------------------- compute: baseline


def test_a_rank_much_slower_than_its_own_baseline_counts_while_peers_are_steady() -> None:
    # Rank 0 is usually the fastest (6 ms vs 10 ms). At 10.9 ms it is still under 1.1x the peer median, so only its
    # own history shows that something changed.
    detector = ComputeStragglerDetector(
        StragglerConfig(baseline_min_samples=4, compute_confirmations=2)
    )
    usual = {0: 6 * MS, 1: 10 * MS, 2: 10 * MS, 3: 10 * MS}
    for step in range(4):
        assert detector.observe(step, usual) is None
    assert detector.baseline(0) == pytest.approx(6 * MS)
    changed = {**usual, 0: 10.9 * MS}
    assert detector.observe(4, changed) is None
    report = detector.observe(5, changed)
    assert report is not None
    assert report.ranks == (0,)
    assert report.evidence["criteria"]["0"] == ("own_baseline",)
    assert report.evidence["baseline_s"]["0"] == pytest.approx(6 * MS)
    # Slow rounds do not teach the baseline: it still remembers the healthy 6 ms.
    assert detector.baseline(0) == pytest.approx(6 * MS)


def test_no_baseline_evidence_when_the_peers_slowed_down_too() -> None:
    detector = ComputeStragglerDetector(StragglerConfig(baseline_min_samples=3))
    for step in range(3):
        detector.observe(step, {0: 6 * MS, 1: 10 * MS, 2: 10 * MS, 3: 10 * MS})
    # Everyone doubled: the work changed (e.g. a bigger batch), not one rank.
    for step in range(3, 10):
        assert detector.observe(step, {0: 12 * MS, 1: 20 * MS, 2: 20 * MS, 3: 20 * MS}) is None
    # And the baselines follow the new normal.
    assert detector.baseline(1) == pytest.approx(20 * MS)


def test_no_baseline_evidence_before_min_samples() -> None:
    detector = ComputeStragglerDetector(StragglerConfig(baseline_min_samples=4))
    usual = {0: 6 * MS, 1: 10 * MS, 2: 10 * MS}
    for step in range(3):
        detector.observe(step, usual)
    assert detector.baseline(0) is None
    changed = {**usual, 0: 10.5 * MS}  # under the peer margins; only a baseline could flag it
    assert detector.observe(3, changed) is None
    assert (
        detector.consecutive(0) == 0
    )  # three samples are not a baseline yet: the round counts as healthy
    assert detector.baseline(0) is not None  # ...and was its fourth sample
    assert detector.observe(4, changed) is None
    assert detector.consecutive(0) == 1  # from now on the baseline is evidence


def test_reset_forgets_counts_and_baselines() -> None:
    detector = ComputeStragglerDetector()
    for step in range(5):
        detector.observe(step, healthy(3))
    detector.observe(5, with_slow(3, {1: 30 * MS}))
    detector.reset()
    assert detector.consecutive(1) == 0 and detector.baseline(0) is None
    assert (
        detector.observe(0, with_slow(3, {1: 30 * MS})) is None
    )  # steps may start over after reset


@pytest.mark.parametrize(
    ("step", "times", "message"),
    [
        (-1, healthy(2), "step"),
        (0, {0: -1.0, 1: 1.0}, r"times_by_rank\[0\]"),
        (0, {0: math.nan, 1: 1.0}, r"times_by_rank\[0\]"),
        (0, {0: math.inf, 1: 1.0}, r"times_by_rank\[0\]"),
        (0, {0: True, 1: 1.0}, r"times_by_rank\[0\]"),
        (0, {-2: 1.0, 1: 1.0}, "ranks"),
    ],
)
def test_compute_rejects_bad_rounds(step: int, times: dict[int, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ComputeStragglerDetector().observe(step, times)


def test_steps_must_increase() -> None:
    detector = ComputeStragglerDetector()
    detector.observe(5, with_slow(3, {0: 30 * MS}))
    with pytest.raises(ValueError, match="increase"):
        detector.observe(5, with_slow(3, {0: 30 * MS}))  # the same round twice would count double
    assert detector.consecutive(0) == 1


# ------------------------------------------------------------------------------------------------------ communication

CHAIN = {"g01": frozenset({0, 1}), "g12": frozenset({1, 2}), "g23": frozenset({2, 3})}
HOSTS = {0: "node-a", 1: "node-b", 2: "node-c", 3: "node-d"}


def chain_round(
    slow_rank: int | None, slow_s: float = 30 * MS, fast_s: float = 10 * MS
) -> dict[str, GroupTiming]:
    return {
        name: GroupTiming(members, slow_s if slow_rank in members else fast_s)
        for name, members in CHAIN.items()
    }


def test_rank_common_to_the_slow_groups_and_its_host_are_named() -> None:
    comm = CommStragglerDetector(StragglerConfig(confirmations=2))
    compute = ComputeStragglerDetector(StragglerConfig(compute_confirmations=2))
    assert comm.observe(0, chain_round(1), HOSTS) is None
    assert compute.observe(0, healthy(4)) is None
    report = comm.observe(1, chain_round(1), HOSTS)
    assert report is not None
    assert (report.kind, report.scope, report.ranks, report.host) == (
        FaultKind.STRAGGLER,
        Scope.NODE,
        (1,),
        "node-b",
    )
    assert report.confirmations == 2
    assert report.evidence["signal"] == "communication"
    assert report.evidence["slow_groups"] == ("g01", "g12")
    assert report.evidence["fast_groups"] == ("g23",)
    assert FaultReport.from_json(report.to_json()) == report
    # Comm timings are no compute evidence: the compute detector saw healthy replays and reports nothing.
    assert compute.observe(1, healthy(4)) is None
    assert compute.consecutive(1) == 0


@pytest.mark.parametrize("slow_rank", [0, 1, 2, 3])
def test_every_rank_of_the_chain_can_be_localized(slow_rank: int) -> None:
    comm = CommStragglerDetector(StragglerConfig(confirmations=1))
    report = comm.observe(0, chain_round(slow_rank), HOSTS)
    assert report is not None
    assert report.ranks == (slow_rank,)
    assert report.host == HOSTS[slow_rank]


def test_comm_needs_r_consecutive_rounds() -> None:
    comm = CommStragglerDetector(StragglerConfig(confirmations=2))
    assert comm.observe(0, chain_round(1), HOSTS) is None
    assert comm.observe(1, chain_round(None), HOSTS) is None
    assert comm.consecutive(1) == 0
    assert comm.observe(2, chain_round(1), HOSTS) is None
    assert (
        comm.observe(3, chain_round(2), HOSTS) is None
    )  # a different suspect does not continue rank 1's chain
    assert comm.observe(4, chain_round(2), HOSTS) is not None


def test_comm_margins_apply() -> None:
    comm = CommStragglerDetector(StragglerConfig(confirmations=1))
    # 1.5x the fastest group but only 0.5 ms above it: under the absolute margin.
    assert comm.observe(0, chain_round(1, slow_s=1.5 * MS, fast_s=1 * MS), HOSTS) is None
    # 5 ms above but only 1.05x: under the relative margin.
    assert comm.observe(1, chain_round(1, slow_s=105 * MS, fast_s=100 * MS), HOSTS) is None


def test_slow_groups_without_a_common_rank_name_no_one() -> None:
    comm = CommStragglerDetector(StragglerConfig(confirmations=1))
    timings = {"g01": GroupTiming(CHAIN["g01"], 30 * MS), "g12": GroupTiming(CHAIN["g12"], 10 * MS)}
    timings["g23"] = GroupTiming(
        CHAIN["g23"], 30 * MS
    )  # ranks 0 and 3 both slow: disjoint slow groups
    assert comm.observe(0, timings, HOSTS) is None


def test_suspects_on_one_host_are_a_node_and_on_several_hosts_are_ranks() -> None:
    timings = {
        "g01": GroupTiming(frozenset({0, 1}), 30 * MS),
        "g23": GroupTiming(frozenset({2, 3}), 10 * MS),
    }
    same_host = CommStragglerDetector(StragglerConfig(confirmations=1)).observe(
        0, timings, {0: "n1", 1: "n1"}
    )
    assert same_host is not None
    assert (same_host.scope, same_host.ranks, same_host.host) == (Scope.NODE, (0, 1), "n1")
    two_hosts = CommStragglerDetector(StragglerConfig(confirmations=1)).observe(
        0, timings, {0: "n1", 1: "n2"}
    )
    assert two_hosts is not None
    assert (two_hosts.scope, two_hosts.ranks, two_hosts.host) == (Scope.RANK, (0, 1), None)
    assert two_hosts.evidence["hosts"] == {"0": "n1", "1": "n2"}
    unknown = CommStragglerDetector(StragglerConfig(confirmations=1)).observe(0, chain_round(1))
    assert unknown is not None
    assert (unknown.scope, unknown.ranks, unknown.host) == (Scope.RANK, (1,), None)


def test_comm_with_uniform_or_single_group_reports_nothing() -> None:
    comm = CommStragglerDetector(StragglerConfig(confirmations=1))
    assert comm.observe(0, chain_round(None), HOSTS) is None
    assert comm.observe(1, {"only": GroupTiming(frozenset({0, 1}), 1.0)}, HOSTS) is None


def test_group_timing_validation() -> None:
    assert GroupTiming({1, 0}, 0.5).members == frozenset({0, 1})  # type: ignore[arg-type]
    for members, seconds, message in [
        (frozenset(), 1.0, "members"),
        (frozenset({-1}), 1.0, "members"),
        (5, 1.0, "members"),
        (frozenset({0}), -1.0, "seconds"),
        (frozenset({0}), math.nan, "seconds"),
    ]:
        with pytest.raises(ValueError, match=message):
            GroupTiming(members, seconds)  # type: ignore[arg-type]


def test_comm_rejects_bad_rounds() -> None:
    comm = CommStragglerDetector()
    with pytest.raises(ValueError, match="at least one group"):
        comm.observe(0, {}, HOSTS)
    with pytest.raises(ValueError, match="GroupTiming"):
        comm.observe(0, {"g": (frozenset({0}), 1.0)}, HOSTS)  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="rank_to_host"):
        comm.observe(0, chain_round(1), {1: ""})
    comm.observe(3, chain_round(1), HOSTS)
    with pytest.raises(ValueError, match="increase"):
        comm.observe(2, chain_round(1), HOSTS)


# ------------------------------------------------------------------------------------- compute: noise and load


def _loaded_rounds(
    rounds: int, *, seed: int, n: int = 4, replay_s: float = 20 * MS, jitter: float = 0.12
) -> list[dict[int, float]]:
    """Healthy rounds as a loaded shared machine produces them: ``jitter`` (log-normal sigma; 10-20 % measured)
    on every rank, and now and then (5 % of rank-rounds, independently) a rank taking 2-10x as long, as the measured
    run's tails did (scout-straggler's loaded-1000 cell runs such a load)."""
    rng = random.Random(seed)
    out = []
    for _ in range(rounds):
        times = {}
        for rank in range(n):
            t = replay_s * rng.lognormvariate(0.0, jitter)
            if rng.random() < 0.05:
                t *= rng.uniform(2.0, 10.0)
            times[rank] = t
        out.append(times)
    return out


def test_heavy_tailed_healthy_rounds_give_no_report_at_the_defaults() -> None:
    rounds = _loaded_rounds(2000, seed=7)
    defaults = ComputeStragglerDetector()
    assert [s for s, times in enumerate(rounds) if defaults.observe(s, times) is not None] == []
    # The same rounds under the old defaults (two confirmations): reports, so this test can fail.
    old = ComputeStragglerDetector(StragglerConfig(compute_confirmations=2, noise_factor=0.0))
    assert sum(old.observe(s, times) is not None for s, times in enumerate(rounds)) > 0


def test_a_20_percent_straggler_is_named_within_the_confirmation_rounds_after_noisy_history() -> (
    None
):
    """On a quieter replay (2 % jitter, the tails as loaded) a 20 % delay is ~10 sigma: named at round R. (At the
    loaded machine's 10-20 % jitter a 20 % delay is within 2 sigma of healthy, and is not told from it.)"""
    config = StragglerConfig()
    detector = ComputeStragglerDetector(config)
    history = _loaded_rounds(200, seed=11, jitter=0.02)
    for step, times in enumerate(history):
        assert detector.observe(step, times) is None
    quiet = _loaded_rounds(config.compute_confirmations, seed=12, jitter=0.02)
    reports = []
    for offset, times in enumerate(quiet):
        slowed = {
            **times,
            2: times[2] + 0.2 * 20 * MS,
        }  # 20 % of the replay, a real straggler from now on
        reports.append(detector.observe(len(history) + offset, slowed))
    assert reports[:-1] == [None] * (config.compute_confirmations - 1)
    assert reports[-1] is not None and reports[-1].ranks == (2,), reports
    assert reports[-1].evidence["effective_absolute_margin_s"] >= config.absolute_margin_s


def test_the_absolute_margin_grows_with_the_replays_measured_noise() -> None:
    detector = ComputeStragglerDetector(StragglerConfig(compute_confirmations=1))
    assert detector.noise() is None and detector.absolute_margin() == 0.002  # nothing measured yet
    rng = random.Random(3)
    for step in range(40):  # +-1 ms of spread on a 20 ms replay
        detector.observe(step, {r: 20 * MS + rng.uniform(-1, 1) * MS for r in range(4)})
    noise = detector.noise()
    assert noise is not None and 0.3 * MS < noise < 1.5 * MS
    assert detector.absolute_margin() == pytest.approx(6.0 * noise)
    # 4 ms over the median on a replay whose healthy spread is ~1 ms: below 6 sigma, not slow.
    assert (
        detector.observe(
            40, {0: 20 * MS, 1: 20 * MS, 2: 20 * MS, 3: 20 * MS + 0.9 * detector.absolute_margin()}
        )
        is None
    )
    assert detector.consecutive(3) == 0
    # Slow rounds do not widen the margin they are judged by: they are left out of the noise.
    for step in range(41, 60):
        jittered = {r: 20 * MS + rng.uniform(-1, 1) * MS for r in range(3)}
        assert detector.observe(step, {**jittered, 3: 80 * MS}) is not None
    assert detector.noise() == pytest.approx(noise, rel=0.5)


def test_noise_factor_zero_keeps_the_fixed_margin() -> None:
    detector = ComputeStragglerDetector(StragglerConfig(noise_factor=0.0, compute_confirmations=1))
    for step in range(10):
        detector.observe(step, {r: (10 + 5 * (r % 2)) * MS for r in range(4)})
    assert detector.absolute_margin() == 0.002


# ------------------------------------------------------------------------------------------------ compute: sustained


def _shared_host_cycles(
    cycles: int, *, seed: int, ranks: int = 4, slow: int | None = None, slow_from: int = 0
) -> list[dict[str, dict[int, float]]]:
    """SCOUT cycles (four recipes of 2-8 ms each) as a loaded shared host produces them: 15 % log-normal jitter per
    replay, 5 % of replays 2-10x as long, and each rank's speed drifting (an AR(1) offset, 6 % spread, lag-one
    correlation 0.85: a rank that shares a core with other load stays slower for ~10 cycles). Fitted to 1,000 loaded
    cycles on four ranks, whose window medians reached 1.32x over 16 cycles and 1.10x over 64. ``slow``: that rank's
    replays take 20 % of the replay longer from cycle ``slow_from`` on."""
    rng = random.Random(seed)
    phi, spread = 0.85, 0.06
    drift = [0.0] * ranks
    out = []
    for cycle in range(cycles):
        drift = [phi * d + rng.gauss(0.0, spread * math.sqrt(1 - phi * phi)) for d in drift]
        recipes = {}
        for k in range(4):
            base = (1 + k) * 2 * MS
            times = {}
            for rank in range(ranks):
                t = base * math.exp(drift[rank]) * rng.lognormvariate(0.0, 0.15)
                if rng.random() < 0.05:
                    t *= rng.uniform(2.0, 10.0)
                if rank == slow and cycle >= slow_from:
                    t += 0.2 * base
                times[rank] = t
            recipes[f"recipe-{k}"] = times
        out.append(recipes)
    return out


class _Clock:
    """A fake clock the tests advance: one SCOUT cycle a second unless told otherwise."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _observe_all(
    detector: SustainedStragglerDetector,
    clock: _Clock,
    cycles: list[dict[str, dict[int, float]]],
    seconds: float = 1.0,
    first_step: int = 0,
) -> list[FaultReport | None]:
    out = []
    for step, cycle in enumerate(cycles, start=first_step):
        clock.t += seconds
        out.append(detector.observe(step, cycle))
    return out


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_a_rank_slowed_for_a_while_by_shared_load_is_not_a_sustained_straggler(seed: int) -> None:
    cycles = _shared_host_cycles(1000, seed=seed)
    clock = _Clock()
    defaults = _observe_all(SustainedStragglerDetector(clock=clock), clock, cycles)
    assert [s for s, r in enumerate(defaults) if r is not None] == []
    # The same cycles judged over a quarter of the window: healthy ranks reported, so this test can fail.
    clock = _Clock()
    short = SustainedStragglerDetector(StragglerConfig(sustained_window=16), clock=clock)
    assert sum(r is not None for r in _observe_all(short, clock, cycles)) > 0


def test_fast_cycles_are_judged_over_the_span_not_the_count() -> None:
    """A healthy rank slower for a few seconds (a shared core) is slow for 64 fast cycles in a row: not a straggler
    until the window also covers sustained_span_s."""
    busy = [{"r": {0: 12 * MS, 1: 10 * MS, 2: 10 * MS}}] * 100  # rank 0 1.2x for 100 cycles...
    clock = _Clock()
    detector = SustainedStragglerDetector(clock=clock)
    assert (
        _observe_all(detector, clock, busy, seconds=0.05) == [None] * 100
    )  # ...over 5 s: not named
    assert detector.ratio(0) is None  # the window waits for 30 s
    steady = _observe_all(detector, clock, busy * 6, seconds=0.05, first_step=100)  # 35 s in all
    assert steady[-1] is not None and steady[-1].ranks == (0,)
    assert steady[-1].evidence["span_s"] == 30.0
    spanless = SustainedStragglerDetector(
        StragglerConfig(sustained_span_s=0), clock=(c := _Clock())
    )
    assert (
        _observe_all(spanless, c, busy, seconds=0.05)[63] is not None
    )  # by count alone: named at 64


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_steady_20_percent_straggler_is_named_within_the_window(seed: int) -> None:
    config = StragglerConfig()
    clock = _Clock()
    detector = SustainedStragglerDetector(config, clock=clock)
    cycles = _shared_host_cycles(1000 + 64, seed=100 + seed, slow=2, slow_from=1000)
    named = [(s, r) for s, r in enumerate(_observe_all(detector, clock, cycles)) if r is not None]
    assert named, "a 20 % straggler was never named"
    first, report = named[0]
    assert 1000 <= first < 1000 + config.sustained_window, (
        first
    )  # before the window has turned over
    assert all(r.ranks == (2,) for _, r in named), named
    assert report.kind is FaultKind.STRAGGLER and report.scope is Scope.RANK
    assert report.evidence["signal"] == "compute" and report.evidence["criterion"] == "sustained"
    assert report.evidence["median_ratio_to_peers"]["2"] > config.sustained_margin


def test_sustained_with_two_ranks_names_the_slow_one_only() -> None:
    clock = _Clock()
    detector = SustainedStragglerDetector(
        StragglerConfig(sustained_window=8, sustained_span_s=0), clock=clock
    )
    reports = _observe_all(detector, clock, [{"r": {0: 10 * MS, 1: 13 * MS}}] * 8)
    assert reports[:-1] == [None] * 7  # the window fills first
    assert reports[-1] is not None and reports[-1].ranks == (1,)
    assert detector.ratio(0) == pytest.approx(10 / 13) and detector.ratio(1) == pytest.approx(1.3)


def test_one_sample_per_cycle_is_the_median_over_its_recipes() -> None:
    clock = _Clock()
    detector = SustainedStragglerDetector(
        StragglerConfig(sustained_window=4, sustained_span_s=0), clock=clock
    )
    # Rank 1 is 3x slower on one recipe of three: its cycle median is 1x, so it is never steadily slow.
    cycle = {"a": {0: MS, 1: 3 * MS}, "b": {0: MS, 1: MS}, "c": {0: MS, 1: MS}}
    assert _observe_all(detector, clock, [cycle] * 8) == [None] * 8
    assert detector.ratio(1) == pytest.approx(1.0)


def test_sustained_window_zero_turns_the_check_off_and_reset_forgets() -> None:
    clock = _Clock()
    off = SustainedStragglerDetector(StragglerConfig(sustained_window=0), clock=clock)
    assert _observe_all(off, clock, [{"r": {0: 10 * MS, 1: 50 * MS}}] * 50) == [None] * 50
    on = SustainedStragglerDetector(
        StragglerConfig(sustained_window=4, sustained_span_s=0), clock=clock
    )
    _observe_all(on, clock, [{"r": {0: 10 * MS, 1: 50 * MS, 2: 10 * MS}}] * 4)
    assert on.ratio(1) == pytest.approx(5.0)
    on.reset()
    assert on.ratio(1) is None
    assert on.observe(0, {"r": {0: 10 * MS, 1: 50 * MS, 2: 10 * MS}}) is None  # steps start afresh


def test_ranks_with_different_clocks_name_the_straggler_at_the_same_cycle() -> None:
    """Every rank judges the same gathered times; with the job's shared clock passed in, each rank's detector decides
    at the same cycle whatever its own clock says (the loaded-1000 cell once saw three ranks break out of training
    while the fourth went on into the next all-reduce)."""
    cycles = _shared_host_cycles(1000 + 200, seed=7, slow=2, slow_from=1000)
    # Four ranks' detectors whose own clocks cannot be read (NaN raises): only the shared clock decides.
    detectors = [SustainedStragglerDetector(clock=lambda: math.nan) for _ in range(4)]
    first_named = []
    for detector in detectors:
        named = None
        for step, cycle in enumerate(cycles):
            report = detector.observe(
                step, cycle, when=0.25 * step
            )  # the lowest rank's gathered clock
            if report is not None and named is None:
                named = (step, report.ranks)
        first_named.append(named)
    assert first_named[0] is not None and first_named[0][1] == (2,), first_named
    assert first_named == [first_named[0]] * 4
    # The same cycles judged on each rank's own skewed clock (time.monotonic per process) do disagree: this test can
    # fail when the shared clock is not used.
    skewed = []
    for rate in (0.25, 0.2501, 0.2497, 0.2504):
        clock = _Clock()
        detector = SustainedStragglerDetector(clock=clock)
        named = None
        for step, cycle in enumerate(cycles):
            clock.t = rate * step + (0.01 if step % 3 == 0 else 0.0)
            if (report := detector.observe(step, cycle)) is not None and named is None:
                named = step
        skewed.append(named)
    assert len(set(skewed)) > 1, skewed


def test_a_clock_that_goes_back_starts_the_windows_afresh() -> None:
    detector = SustainedStragglerDetector(StragglerConfig(sustained_window=4, sustained_span_s=0))
    for step in range(4):
        detector.observe(step, {"r": {0: 10 * MS, 1: 50 * MS, 2: 10 * MS}}, when=100.0 + step)
    assert detector.ratio(1) == pytest.approx(5.0)
    detector.observe(
        4, {"r": {0: 10 * MS, 1: 10 * MS, 2: 10 * MS}}, when=3.0
    )  # another rank's clock now
    assert detector.ratio(1) is None
    with pytest.raises(ValueError, match="finite time"):
        detector.observe(5, {"r": healthy(3)}, when=math.inf)


def test_job_clock_is_the_lowest_ranks() -> None:
    assert job_clock({3: {"clock": 9.0}, 1: {"clock": 4.5}, 2: {}}) == 4.5
    assert job_clock({1: {}, 2: {"clock": 7.0}}) == 7.0
    assert job_clock({0: {}, 1: {}}) is None


def test_sustained_rejects_bad_rounds() -> None:
    detector = SustainedStragglerDetector()
    detector.observe(3, {"r": healthy(4)})
    with pytest.raises(ValueError, match="increase"):
        detector.observe(3, {"r": healthy(4)})
    with pytest.raises(ValueError, match="finite number of seconds"):
        detector.observe(4, {"r": {0: math.nan, 1: MS}})
    with pytest.raises(ValueError, match="non-negative ints"):
        detector.observe(5, {"r": {-1: MS, 1: MS}})


def test_a_rank_named_by_the_per_round_detector_is_not_named_twice_in_one_cycle() -> None:
    class Ok:
        preconditions_ok = True

    config = StragglerConfig(compute_confirmations=1, sustained_window=4, sustained_span_s=0)
    detectors: dict[str, ComputeStragglerDetector] = {}
    sustained = SustainedStragglerDetector(config)
    slow = {0: 10 * MS, 1: 10 * MS, 2: 10 * MS, 3: 40 * MS}
    for step in range(4):
        reports = compute_reports(
            detectors, config, step, {"r": Ok()}, {"r": slow}, 4, sustained=sustained
        )
        assert [r.ranks for r in reports] == [(3,)], reports  # the per-round report alone
    assert sustained.ratio(3) == pytest.approx(4.0)  # ...though the window names rank 3 too
    # A mild steady slowness no single round flags: the sustained report alone.
    mild = {0: 10 * MS, 1: 10 * MS, 2: 10 * MS, 3: 11.8 * MS}  # 1.18x, 1.8 ms: under 2 ms
    sustained.reset()
    for step in range(4, 8):
        reports = compute_reports(
            detectors, config, step, {"r": Ok()}, {"r": mild}, 4, sustained=sustained
        )
    assert [(r.ranks, r.evidence["criterion"]) for r in reports] == [((3,), "sustained")]


def test_run_queue_wait_is_measured_only_when_the_thread_is_kept_off_a_cpu() -> None:
    if run_queue_seconds() is None:
        pytest.skip("no /proc/thread-self/schedstat on this kernel")
    assert waited_since(None) == 0.0
    start = run_queue_seconds()
    time.sleep(0.2)  # sleeping is not waiting for a CPU
    assert waited_since(start) < 0.05
    if not hasattr(os, "sched_setaffinity"):
        return
    cpu = sorted(os.sched_getaffinity(0))[0]
    before = os.sched_getaffinity(0)
    hog = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"]
    )
    try:
        os.sched_setaffinity(0, {cpu})  # this thread shares one CPU with a busy loop
        time.sleep(0.2)  # let the hog start spinning
        start = run_queue_seconds()
        end = time.monotonic() + 0.4
        while time.monotonic() < end:
            pass
        assert waited_since(start) > 0.05
    finally:
        os.sched_setaffinity(0, before)
        hog.kill()
        hog.wait(5)
