"""Check 5 of the verifier, consistency: does the record add up?

On a manifest that already passed intake, signature, schema and files (:mod:`.verify`): the result follows from the
counts and exit codes, the counts add up, times are ordered and every command's log is a subject; from schema 1.1 the
scope adds up, every validated claim is backed by commands that exited 0, and a sealed ``summary.json`` records the
same scope, claims and cell verdicts. Each check raises :class:`~qualification.errors.BundleInvalid` with the prefix
``consistency:``; none reads anything but the manifest and ``summary.json``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from qualification.errors import BundleInvalid
from qualification.evidence.facts import result_of
from qualification.evidence.manifest import BundleFile, parse_json

__all__ = ["SUMMARY_NAME", "check_claims", "check_consistency", "check_summary"]

SUMMARY_NAME = "summary.json"
"""The engine's run record; when a bundle holds it, it must agree with the manifest."""


def check_consistency(document: dict[str, Any]) -> None:
    predicate = document["predicate"]
    summary, commands, run = predicate["summary"], predicate["commands"], predicate["run"]
    counted = summary["passed"] + summary["failed"] + summary["skipped"]
    if predicate["schemaVersion"].startswith("1.0.") and summary["total"] != counted:
        raise BundleInvalid(
            f"consistency: summary total {summary['total']} != passed+failed+skipped {counted}"
        )
    subjects = {s["name"] for s in document["subject"]}
    run_start, run_finish = _time(run["startedOn"]), _time(run["finishedOn"])
    if run_start > run_finish:
        raise BundleInvalid("consistency: run.startedOn is after run.finishedOn")
    for command in commands:
        start, finish = _time(command["startedOn"]), _time(command["finishedOn"])
        if start > finish:
            raise BundleInvalid(
                f"consistency: command {command['id']!r} startedOn is after its finishedOn"
            )
        if start < run_start or finish > run_finish:
            raise BundleInvalid(
                f"consistency: command {command['id']!r} ran outside the run's start..finish"
            )
        if command["log"] not in subjects:
            raise BundleInvalid(
                f"consistency: log {command['log']!r} of command {command['id']!r} is not a subject"
            )
    if predicate["schemaVersion"].startswith("1.0."):
        if predicate["result"] == "PASSED":
            if summary["passed"] == 0:
                raise BundleInvalid("consistency: result is PASSED but no cell passed")
            if summary["failed"]:
                raise BundleInvalid(
                    f"consistency: result is PASSED but summary.failed is {summary['failed']}"
                )
            for command in commands:
                if command["exitCode"] != 0:
                    raise BundleInvalid(
                        f"consistency: result is PASSED but command {command['id']!r} exited {command['exitCode']}"
                    )
        return
    if summary["total"] != counted + summary["measured"]:
        raise BundleInvalid(
            f"consistency: summary total {summary['total']} != passed+failed+skipped+measured "
            f"{counted + summary['measured']}"
        )
    derived = result_of(
        summary["passed"],
        summary["failed"],
        summary["skipped"],
        summary["measured"],
        [c["exitCode"] for c in commands],
    )
    if predicate["result"] != derived:
        raise BundleInvalid(
            f"consistency: result is {predicate['result']} but the counts and exit codes make it {derived}"
        )


def check_claims(document: dict[str, Any], files: dict[str, BundleFile]) -> None:
    """Scope and claims (1.1): they add up, every validated claim is backed by commands that exited 0, and the sealed
    ``summary.json`` of an engine run records the same scope and claims, with every backing cell passed or measured
    with every target met. A claim moved into ``validated`` by hand, or a filter removed, fails here."""
    predicate = document["predicate"]
    scope, summary = predicate["scope"], predicate["summary"]
    if scope["cellsRun"] != summary["total"]:
        raise BundleInvalid(
            f"consistency: scope.cellsRun {scope['cellsRun']} != summary.total {summary['total']}"
        )
    if scope["campaignCellsRun"] > min(scope["cellsInCampaign"], scope["cellsRun"]):
        raise BundleInvalid(
            "consistency: scope.campaignCellsRun exceeds the cells in the campaign or the cells run"
        )
    complete = (
        scope["filter"] is None
        and scope["seedOverride"] is None
        and scope["campaignCellsRun"] == scope["cellsInCampaign"] == scope["cellsRun"]
    )
    if scope["complete"] != complete:
        raise BundleInvalid(
            f"consistency: scope.complete is {str(scope['complete']).lower()} but its filter, seed "
            f"and cell counts make it {str(complete).lower()}"
        )
    exits = {c["id"]: c["exitCode"] for c in predicate["commands"]}
    for claim in predicate["boundaries"]["validated"]:
        for cell in claim["backedBy"]:
            if exits.get(cell) != 0:
                why = (
                    "is not a command of this run" if cell not in exits else f"exited {exits[cell]}"
                )
                raise BundleInvalid(
                    f"consistency: validated claim {claim['claim'][:60]!r} is backed by {cell!r}, which {why}"
                )
    if SUMMARY_NAME in files:
        check_summary(predicate, files[SUMMARY_NAME])


def check_summary(predicate: dict[str, Any], summary_file: BundleFile) -> None:
    try:
        summary = parse_json(summary_file.path.read_bytes())
    except (ValueError, RecursionError) as exc:
        raise BundleInvalid(f"consistency: {SUMMARY_NAME} is not valid JSON ({exc})") from exc
    if not isinstance(summary, dict) or summary.get("summary_version") != 2:
        # Not the engine's run record as `qualify run` seals it (which refuses older summaries): a bundle sealed
        # from facts may hold any file of that name. Its bytes are still bound by their digest.
        return
    if not isinstance(summary.get("scope"), dict):
        raise BundleInvalid(f"consistency: {SUMMARY_NAME} records no scope, but the manifest does")
    recorded = summary["scope"]
    scope = predicate["scope"]
    pairs = (
        ("complete", "complete"),
        ("cells_in_campaign", "cellsInCampaign"),
        ("campaign_cells_run", "campaignCellsRun"),
        ("cells_run", "cellsRun"),
        ("filter", "filter"),
        ("seed_override", "seedOverride"),
    )
    for snake, camel in pairs:
        if recorded.get(snake) != scope[camel]:
            raise BundleInvalid(
                f"consistency: scope.{camel} is {scope[camel]!r} in the manifest but "
                f"{recorded.get(snake)!r} in {SUMMARY_NAME}"
            )
    bounds = summary.get("boundaries") if isinstance(summary.get("boundaries"), dict) else {}
    sealed_validated = [
        {"claim": c.get("claim"), "backedBy": c.get("backed_by")}
        for c in bounds.get("validated") or []
        if isinstance(c, dict)
    ]
    sealed_not = [
        {"claim": c.get("claim"), "reason": c.get("reason")}
        for c in bounds.get("not_validated") or []
        if isinstance(c, dict)
    ]
    if sealed_validated != predicate["boundaries"]["validated"]:
        raise BundleInvalid(
            f"consistency: the manifest's validated claims differ from those in {SUMMARY_NAME}"
        )
    if sealed_not != predicate["boundaries"]["notValidated"]:
        raise BundleInvalid(
            f"consistency: the manifest's not-validated claims differ from those in {SUMMARY_NAME}"
        )
    cells = {c.get("id"): c for c in summary.get("cells") or [] if isinstance(c, dict)}
    for claim in sealed_validated:
        for cell_id in claim["backedBy"] or []:
            cell = cells.get(cell_id) or {}
            verdict = cell.get("verdict")
            missed = [
                t
                for t in cell.get("targets") or []
                if isinstance(t, dict) and t.get("met") is not True
            ]
            if verdict not in ("passed", "measured") or missed:
                raise BundleInvalid(
                    f"consistency: validated claim {claim['claim'][:60]!r} is backed by "
                    f"{cell_id!r}, whose verdict in {SUMMARY_NAME} is {verdict!r}"
                    + (" with a missed target" if missed else "")
                )


def _time(text: str) -> datetime:
    return datetime.fromisoformat(text)  # the schema already asserted RFC 3339 with a trailing Z
