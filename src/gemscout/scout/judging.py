"""Step 3 of the SCOUT cycle, after the last collective: what the gathered records become.

Every rank holds the same gathered records (:meth:`~gemscout.scout.domain.PeerDomain.gather_records`), so every rank,
running these functions on them, reaches the same verdicts and the same reports: each recipe judged over the peer
groups that replayed it and the groups' verdicts combined (:func:`judge_records`), the recipes SCOUT cannot replay
named as such (:func:`name_unreplayable`), then the SDC and straggler reports (:func:`cycle_reports`). No process
group here; the straggler detectors passed in keep their state across cycles (their owner resets them on a rewind).
:class:`~gemscout.scout.engine.Scout` runs the collectives before and records the rotation after.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from gemscout.reports import FaultReport
from gemscout.scout.capture import Captured
from gemscout.scout.comm_probe import JobCollectiveTimer, job_comm_report
from gemscout.scout.consensus import C3Result, Verdict
from gemscout.scout.cycle import combine_groups, judge_gathered
from gemscout.scout.domain import PeerDomain
from gemscout.scout.fsdp_comms import FsdpCollectiveTimer
from gemscout.scout.recipes import Recipe
from gemscout.scout.stragglers import (
    CommStragglerDetector,
    ComputeStragglerDetector,
    StragglerConfig,
    SustainedStragglerDetector,
    compute_reports,
    job_clock,
)

__all__ = ["cycle_reports", "judge_records", "name_unreplayable"]

log = logging.getLogger("gemscout")


def judge_records(
    domain: PeerDomain, step: int, due: Sequence[Recipe], by_rank: Mapping[int, Mapping[str, Any]]
) -> tuple[dict[str, C3Result], dict[str, dict[int, float]]]:
    """The verdict of every recipe the cycle judges (``domain.judged_names``; with pipeline stages, every stage's),
    each over the peer groups that replayed it (``domain.holding``) and combined across them, and the replay seconds
    per recipe per rank. Pure: equal on every rank given the same ``by_rank``."""
    results = {}
    times: dict[str, dict[int, float]] = {}
    for name in domain.judged_names(due, by_rank):
        judged = []
        times[name] = {}
        for group in domain.holding(name, by_rank):
            result, group_times = judge_gathered(name, step, group, [by_rank[r] for r in group])
            judged.append((group, result))
            times[name].update(group_times)
        results[name] = combine_groups(name, step, judged)
    return results, times


def name_unreplayable(
    step: int,
    received: Mapping[str, Captured],
    results: dict[str, C3Result],
    unreplayable: dict[str, str],
    *,
    announce: bool,
) -> None:
    """A recipe whose inputs SCOUT cannot reproduce (the source's capture says which and why) is INCONCLUSIVE
    with that reason alone, not the per-rank replay errors it caused: rewrites ``results`` in place and records the
    newest reason in ``unreplayable``. ``announce``: log a recipe the first time it appears there (one rank of the
    group says it). Every peer received the same header, so every peer rewrites the same verdicts."""
    for name in list(results):
        got = received.get(name)
        if got is None or not got.meta.get("unreplayable") or got.error is None:
            continue
        reason = f"SCOUT cannot replay {name!r}: {got.error}; outputs were not compared"
        results[name] = C3Result(
            verdict=Verdict.INCONCLUSIVE,
            recipe=name,
            step=step,
            reason=reason,
            preconditions_ok=False,
        )
        if name not in unreplayable and announce:
            log.warning(
                "gemscout: %s (step %d; the recipe stays INCONCLUSIVE and nothing is certified until "
                "it can be replayed: fix the input, or leave its kind out of ScoutConfig.recipes)",
                reason,
                step,
            )
        unreplayable[name] = got.error


def cycle_reports(
    domain: PeerDomain,
    step: int,
    due: Sequence[Recipe],
    results: Mapping[str, C3Result],
    times: Mapping[str, Mapping[int, float]],
    by_rank: Mapping[int, Mapping[str, Any]],
    *,
    config: StragglerConfig | None,
    detectors: dict[str, ComputeStragglerDetector],
    sustained: SustainedStragglerDetector,
    comm_detector: CommStragglerDetector,
    timer: JobCollectiveTimer | FsdpCollectiveTimer | None,
) -> list[FaultReport]:
    """One cycle's reports, in this order: each SDC verdict's, the compute stragglers' (``detectors`` per recipe,
    created on first use, and ``sustained``), a rank late to the job's own collectives (``comm_detector``, only
    with a ``timer``: the gathered ``"comm_s"``), then the domain's own communication stragglers. ``config`` None:
    no straggler reports. Pure but for the detectors' state, which every rank advances alike."""
    reports = [
        report for result in results.values() if (report := result.fault_report()) is not None
    ]
    reports += compute_reports(
        detectors,
        config,
        step,
        results,
        times,
        len(by_rank),
        sustained=sustained,
        when=job_clock(by_rank),
    )
    if (
        timer is not None
        and (
            late := job_comm_report(
                comm_detector,
                step,
                by_rank,
                timer.rank_to_host,
                getattr(timer, "groups", None),
                domain.job_collectives,
            )
        )
        is not None
    ):
        reports.append(late)
    reports += domain.comm_reports(step, due, by_rank, config)
    return reports
