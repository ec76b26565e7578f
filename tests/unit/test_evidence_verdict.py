"""One verdict: the worst dimension leads, in words and tone; only valid + CURRENT + complete + PASSED is green."""

from __future__ import annotations

import pytest

from qualification.evidence.verdict import headline, scope_text

pytestmark = pytest.mark.timeout(30)

COMPLETE = {
    "complete": True,
    "cellsInCampaign": 4,
    "campaignCellsRun": 4,
    "cellsRun": 4,
    "filter": None,
    "seedOverride": None,
}
PARTIAL = {
    **COMPLETE,
    "complete": False,
    "campaignCellsRun": 1,
    "cellsRun": 1,
    "filter": "two-peers",
}


@pytest.mark.parametrize(
    ("validity", "result", "scope", "freshness", "word", "tone"),
    [
        ("VALID", "PASSED", COMPLETE, "CURRENT", "PASSED", "passed"),
        ("INVALID", "PASSED", COMPLETE, None, "INVALID", "failed"),
        ("VALID", "FAILED", COMPLETE, "CURRENT", "FAILED", "failed"),
        ("NOT VERIFIED", "PASSED", COMPLETE, None, "NOT VERIFIED", "neutral"),
        ("NOT SEALED", "PASSED", COMPLETE, None, "NOT SEALED", "neutral"),
        ("VALID", "PASSED", COMPLETE, "STALE", "STALE", "warning"),
        ("VALID", "PASSED", PARTIAL, "STALE", "STALE", "warning"),
        ("VALID", "PASSED", PARTIAL, "CURRENT", "PARTIAL", "warning"),
        ("VALID", "PASSED", None, "CURRENT", "SCOPE UNKNOWN", "warning"),
        ("VALID", "PASSED-WITH-SKIPS", COMPLETE, "CURRENT", "PASSED-WITH-SKIPS", "warning"),
        ("VALID", "MEASURED", COMPLETE, "CURRENT", "MEASURED", "neutral"),
    ],
)
def test_the_worst_dimension_leads(
    validity: str,
    result: str,
    scope: dict | None,
    freshness: str | None,  # type: ignore[type-arg]
    word: str,
    tone: str,
) -> None:
    verdict = headline(validity=validity, result=result, scope=scope, freshness=freshness)
    assert (verdict.word, verdict.tone) == (word, tone)
    assert verdict.text.startswith(word)
    if tone != "passed":
        assert not verdict.text.startswith("PASSED,"), (
            "only the green case may read as a plain pass"
        )


def test_partial_scope_is_said_with_its_counts_and_what_narrowed_it() -> None:
    assert scope_text(PARTIAL) == "PARTIAL 1 of 4 cells (--filter 'two-peers')"
    assert (
        scope_text({**PARTIAL, "filter": None, "seedOverride": 3})
        == "PARTIAL 1 of 4 cells (--seed 3)"
    )
    assert scope_text(COMPLETE) is None
    text = headline(validity="INVALID", result="PASSED", scope=PARTIAL, freshness=None).text
    assert (
        text
        == "INVALID: the bundle failed verification (it claims PASSED, PARTIAL 1 of 4 cells (--filter 'two-peers'))"
    )
