"""What the AllToAll check records and finds: one recorded call's metadata, one EP group's result."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from gemscout.reports import FaultReport

__all__ = ["AllToAllRecord", "AllToAllResult"]


@dataclass(frozen=True, slots=True)
class AllToAllRecord:
    """The metadata of one recorded ``all_to_all_single`` (no payload)."""

    group: tuple[int, ...]
    """Global ranks of the group, in group-rank order."""
    dtype: str
    row_shape: tuple[int, ...]
    """Shape of one row (the input's shape without dim 0)."""
    input_splits: tuple[int, ...]
    """Rows this rank sent to each group rank."""
    output_splits: tuple[int, ...]
    """Rows this rank received from each group rank."""

    def to_json(self) -> list[Any]:
        return [
            list(self.group),
            self.dtype,
            list(self.row_shape),
            list(self.input_splits),
            list(self.output_splits),
        ]


@dataclass(slots=True)
class AllToAllResult:
    """What one check found for one EP group; identical on every rank of that group."""

    step: int
    group: tuple[int, ...]
    verdict: str
    """``clean``, ``mismatch`` or ``inconclusive`` (nothing replayed; ``reason`` says why)."""
    reason: str = ""
    cases: dict[str, list[list[int]]] = field(default_factory=dict)
    """Rows sent per case, ``[src][dst]`` by group rank."""
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    reports: list[FaultReport] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (reports as their dicts)."""
        doc = dataclasses.asdict(dataclasses.replace(self, reports=[]))
        doc["reports"] = [r.to_dict() for r in self.reports]
        return doc
