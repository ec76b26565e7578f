"""One verdict for a bundle, the same everywhere it is shown (``verify``, the HTML banner, docs/validation.md).

A bundle has four dimensions: its validity (VALID, INVALID, or not verified / not sealed), the run's result (PASSED,
PASSED-WITH-SKIPS, MEASURED, FAILED), its scope (the whole campaign or PARTIAL) and its freshness (CURRENT,
CURRENT-EVIDENCE-ONLY, STALE, NOT-ON-MAIN, UNKNOWN). Shown apart, a green PASSED can sit next to a red INVALID. The headline puts the worst first,
in words and in tone, so that nothing reads as a pass that is not one:

    INVALID > FAILED > NOT SEALED / NOT VERIFIED > STALE / NOT-ON-MAIN / UNKNOWN > PARTIAL > PASSED-WITH-SKIPS
    > MEASURED > PASSED

Only VALID + CURRENT (or CURRENT-EVIDENCE-ONLY: main moved on by evidence files alone) + a complete campaign +
PASSED is ``passed`` (green).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TONES = ("passed", "warning", "failed", "neutral")
COVERS_HEAD = ("CURRENT", "CURRENT-EVIDENCE-ONLY")
"""Freshness states whose bundle describes main's head (see :mod:`qualification.evidence.freshness`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Headline:
    """``word`` is the dominant state, ``text`` the whole verdict in one line, ``tone`` its colour class."""

    word: str
    text: str
    tone: str

    def to_json(self) -> dict[str, str]:
        return {"word": self.word, "text": self.text, "tone": self.tone}


def scope_text(scope: Mapping[str, Any] | None) -> str | None:
    """``PARTIAL 1 of 4 cells (--filter 'two-peers')`` for a narrowed run; None for a complete one; a note when the
    bundle records no scope (schema 1.0.0). Takes the manifest's camelCase scope."""
    if scope is None:
        return "scope not recorded (schema 1.0.0)"
    if scope.get("complete"):
        return None
    narrowed = []
    if scope.get("filter") is not None:
        narrowed.append(f"--filter {scope['filter']!r}")
    if scope.get("seedOverride") is not None:
        narrowed.append(f"--seed {scope['seedOverride']}")
    how = f" ({' and '.join(narrowed)})" if narrowed else ""
    return f"PARTIAL {scope.get('campaignCellsRun')} of {scope.get('cellsInCampaign')} cells{how}"


def headline(
    *, validity: str, result: str, scope: Mapping[str, Any] | None, freshness: str | None
) -> Headline:
    """The verdict of a bundle (see the module docstring).

    ``validity`` is VALID, INVALID, NOT VERIFIED or NOT SEALED; ``freshness`` is None unless verified."""
    partial = scope_text(scope)
    tail = f"{result}" + (f", {partial}" if partial else "")
    if validity == "INVALID":
        return Headline(
            word="INVALID",
            text=f"INVALID: the bundle failed verification (it claims {tail})",
            tone="failed",
        )
    if result == "FAILED":
        prefix = "" if validity == "VALID" else f" ({validity})"
        return Headline(
            word="FAILED",
            text=f"FAILED{prefix}" + (f", {partial}" if partial else ""),
            tone="failed",
        )
    if validity != "VALID":
        return Headline(word=validity, text=f"{validity}: {tail}", tone="neutral")
    if freshness not in COVERS_HEAD:
        return Headline(word=str(freshness), text=f"{freshness}: {tail}", tone="warning")
    if partial is not None:
        word = "PARTIAL" if scope is not None else "SCOPE UNKNOWN"
        return Headline(word=word, text=f"{word}: {tail}", tone="warning")
    if result == "PASSED-WITH-SKIPS":
        return Headline(word=result, text=result, tone="warning")
    if result == "MEASURED":
        return Headline(
            word=result, text=f"{result}: measurement cells only; read each target", tone="neutral"
        )
    return Headline(word=result, text=f"{result}, {freshness}, complete", tone="passed")
