"""What a run actually backs: its scope (which of the campaign's cells it ran) and which claims its cells support.

A campaign's ``validated`` boundaries are claims, each naming the cells that back it (:class:`~.campaign.Claim`). A
claim holds for a run only if every backing cell ran in that run and PASSED, or was MEASURED with every target met.
Anything else moves it to *not validated*, with the reason in words a reviewer can act on (``skipped: 12 of 12
backing cells ...``). A run narrowed by ``--filter`` or ``--seed`` is PARTIAL: its scope is recorded, and the
claims whose cells it did not run are not validated by it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from qualification.campaign import Campaign
from qualification.evidence.facts import DECLARED
from qualification.outcome import CellOutcome, Verdict

_EXAMPLES = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class Scope:
    """Which of the campaign's cells a run ran, and what narrowed it."""

    cells_in_campaign: int
    campaign_cells_run: int
    """Cells of the campaign, exactly as the file expands them, that this run ran (skipped ones count as run)."""
    cells_run: int
    filter: str | None
    seed_override: int | None

    @property
    def complete(self) -> bool:
        """Every cell of the campaign, and nothing else, with nothing narrowing the run."""
        return (
            self.filter is None
            and self.seed_override is None
            and self.campaign_cells_run == self.cells_in_campaign == self.cells_run
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "complete": self.complete,
            "cells_in_campaign": self.cells_in_campaign,
            "campaign_cells_run": self.campaign_cells_run,
            "cells_run": self.cells_run,
            "filter": self.filter,
            "seed_override": self.seed_override,
        }


def scope_of(
    campaign: Campaign,
    outcomes: Sequence[CellOutcome],
    *,
    filter_expr: str | None,
    seed_override: int | None,
) -> Scope:
    """The scope of a run of ``campaign`` that produced ``outcomes``."""
    ran = {outcome.cell.id for outcome in outcomes}
    return Scope(
        cells_in_campaign=len(campaign.cells),
        campaign_cells_run=sum(cell.id in ran for cell in campaign.cells),
        cells_run=len(outcomes),
        filter=filter_expr or None,
        seed_override=seed_override,
    )


def narrowing(scope: Scope) -> str:
    """What narrowed the run, in words: ``--filter 'two-peers'``, ``--seed 3``."""
    parts = []
    if scope.filter is not None:
        parts.append(f"--filter {scope.filter!r}")
    if scope.seed_override is not None:
        parts.append(f"--seed {scope.seed_override}")
    return " and ".join(parts) or "the run"


def evaluate(
    campaign: Campaign, outcomes: Sequence[CellOutcome], scope: Scope
) -> dict[str, list[dict[str, Any]]]:
    """``{"validated": [{"claim", "backed_by"}], "not_validated": [{"claim", "reason"}]}`` for this run.

    Validated claims list the ids of the cells that back them; not validated ones are the claims this run does not
    back (with why) followed by the campaign's own ``not_validated`` list (reason :data:`DECLARED`).
    """
    by_id = {outcome.cell.id: outcome for outcome in outcomes}
    campaign_ids = [cell.id for cell in campaign.cells]
    validated: list[dict[str, Any]] = []
    not_validated: list[dict[str, Any]] = []
    for claim in campaign.claims:
        backing = claim.backing(campaign_ids)
        reasons = _problems(backing, by_id, scope)
        if reasons:
            not_validated.append({"claim": claim.text, "reason": "; ".join(reasons)})
        else:
            validated.append({"claim": claim.text, "backed_by": backing})
    not_validated += [{"claim": text, "reason": DECLARED} for text in campaign.not_validated]
    return {"validated": validated, "not_validated": not_validated}


def _problems(backing: list[str], by_id: dict[str, CellOutcome], scope: Scope) -> list[str]:
    """Why ``backing`` does not back its claim in this run, worst first; empty when it does."""
    groups: dict[str, list[tuple[str, str]]] = {"failed": [], "target missed": [], "skipped": []}
    absent = []
    for cell_id in backing:
        outcome = by_id.get(cell_id)
        if outcome is None:
            absent.append(cell_id)
        elif outcome.verdict is Verdict.FAILED:
            groups["failed"].append((cell_id, outcome.reason))
        elif outcome.verdict is Verdict.SKIPPED:
            groups["skipped"].append((cell_id, outcome.reason))
        elif outcome.verdict is Verdict.MEASURED and outcome.missed_targets:
            groups["target missed"].append((cell_id, outcome.reason))
    reasons = []
    for kind, cells in groups.items():
        if cells:
            examples = "; ".join(f"{cell_id}: {why}" for cell_id, why in cells[:_EXAMPLES])
            more = f"; and {len(cells) - _EXAMPLES} more" if len(cells) > _EXAMPLES else ""
            reasons.append(
                f"{kind}: {len(cells)} of {len(backing)} backing cells ({examples}{more})"
            )
    if absent:
        reasons.append(
            f"not run: {len(absent)} of {len(backing)} backing cells were left out by {narrowing(scope)}"
        )
    return reasons
