"""Fault reports: what SCOUT tells the caller when it sees something wrong.

A :class:`FaultReport` is an evidence object. It is valid from construction (bad values raise ``ValueError``), frozen,
and travels as JSON only: :meth:`FaultReport.to_json` / :meth:`FaultReport.from_json` round-trip it exactly, and
:meth:`FaultReport.from_dict` rejects anything malformed with an :class:`~gemscout.errors.EvidenceError` rather than
building a half-valid report.
"""

from __future__ import annotations

import enum
import json
import math
import time
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gemscout.errors import EvidenceError

__all__ = ["FaultKind", "FaultReport", "Scope"]

# Bumped whenever the dictionary layout changes, so a reader never guesses at a report written by another version.
REPORT_VERSION = 1


class FaultKind(enum.StrEnum):
    """What went wrong."""

    SDC = "sdc"
    STRAGGLER = "straggler"
    HANG = "hang"
    DATA_STALL = "data_stall"
    CHECKPOINT_STALL = "checkpoint_stall"
    HEALTH = "health"
    TAMPER = "tamper"  # the out-of-band store was written by someone without the job's secret (a watch finding)


class Scope(enum.StrEnum):
    """How precisely the fault is localized."""

    RANK = "rank"  # the named ranks are the culprits
    PEER_GROUP = (
        "peer_group"  # something in this group of peers is wrong, but no culprit can be named
    )
    NODE = "node"  # the fault belongs to a host; ``host`` names it and ``ranks`` are the ranks seen on it


def _freeze(value: Any) -> Any:
    """Turn parsed JSON into an immutable equivalent (dict → read-only mapping, list → tuple)."""
    if isinstance(value, dict):
        return types.MappingProxyType({key: _freeze(item) for key, item in value.items()})
    if isinstance(value, list):
        return tuple(_freeze(item) for item in value)
    return value


def _thaw(value: Any) -> Any:
    """Inverse of :func:`_freeze`: plain dicts and lists, ready for ``json.dumps``."""
    if isinstance(value, Mapping):
        return {key: _thaw(item) for key, item in value.items()}
    if isinstance(value, tuple | list):
        return [_thaw(item) for item in value]
    return value


def _canonical_evidence(evidence: Mapping[str, Any]) -> Mapping[str, Any]:
    """Validate that ``evidence`` is JSON and return a private, frozen copy of it.

    Going through JSON text is the validation: whatever survives ``json.dumps(allow_nan=False)`` is exactly what a
    reader will get back, so a report compares equal to its own round trip (integer keys become strings here, not
    only after serialization).
    """
    if not isinstance(evidence, Mapping):
        raise ValueError(
            f"FaultReport.evidence must be a mapping of str to JSON values, got {type(evidence).__name__}"
        )
    try:
        text = json.dumps(_thaw(evidence), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"FaultReport.evidence must be JSON-serializable without NaN/inf: {exc}"
        ) from exc
    return _freeze(json.loads(text))  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultReport:
    """One fault SCOUT has seen, with the evidence for it.

    Construction validates every field and raises ``ValueError`` naming the field; ``kind`` and ``scope`` also accept
    their string values. ``ranks`` is normalized to a sorted tuple without duplicates, ``evidence`` to a frozen copy of
    its JSON form. The report is hashable; ``evidence`` does not take part in the hash.
    """

    kind: FaultKind
    """What went wrong."""
    scope: Scope
    """How precisely it is localized; ``RANK`` requires at least one rank."""
    ranks: tuple[int, ...]
    """The culprit ranks (scope ``RANK``), the peers involved (``PEER_GROUP``) or the ranks on ``host`` (``NODE``)."""
    step: int
    """Training step the evidence was taken at (>= 0)."""
    reason: str
    """One human-readable sentence: why this report exists."""
    recipe: str | None = None
    """SCOUT recipe the evidence comes from, when there is one."""
    evidence: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """JSON-serializable facts behind the report: digests by rank, timings, thresholds. Stored as a frozen copy of
    its JSON form: objects become read-only mappings with string keys, arrays become tuples."""
    confirmations: int = 1
    """How many consecutive rounds showed the fault (>= 1)."""
    host: str | None = None
    """Host name of the faulty node or rank, when known; required for scope ``NODE``."""
    timestamp: float = field(default_factory=time.time)
    """Wall-clock time the report was made, seconds since the epoch."""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", FaultKind(self.kind))
        except ValueError:
            raise ValueError(
                f"FaultReport.kind must be one of {[k.value for k in FaultKind]}, got {self.kind!r}"
            ) from None
        try:
            object.__setattr__(self, "scope", Scope(self.scope))
        except ValueError:
            raise ValueError(
                f"FaultReport.scope must be one of {[s.value for s in Scope]}, got {self.scope!r}"
            ) from None
        ranks = tuple(self.ranks)
        if any(type(rank) is not int or rank < 0 for rank in ranks):
            raise ValueError(f"FaultReport.ranks must be non-negative ints, got {ranks!r}")
        object.__setattr__(self, "ranks", tuple(sorted(set(ranks))))
        if self.scope is Scope.RANK and not self.ranks:
            raise ValueError("FaultReport.ranks must name at least one rank when scope is 'rank'")
        if type(self.step) is not int or self.step < 0:
            raise ValueError(f"FaultReport.step must be an int >= 0, got {self.step!r}")
        if type(self.confirmations) is not int or self.confirmations < 1:
            raise ValueError(
                f"FaultReport.confirmations must be an int >= 1, got {self.confirmations!r}"
            )
        if not isinstance(self.reason, str) or not self.reason:
            raise ValueError("FaultReport.reason must be a non-empty string")
        if self.recipe is not None and (not isinstance(self.recipe, str) or not self.recipe):
            raise ValueError(
                f"FaultReport.recipe must be a non-empty string or None, got {self.recipe!r}"
            )
        if self.host is not None and (not isinstance(self.host, str) or not self.host):
            raise ValueError(
                f"FaultReport.host must be a non-empty string or None, got {self.host!r}"
            )
        if self.scope is Scope.NODE and self.host is None:
            raise ValueError("FaultReport.host must name the node when scope is 'node'")
        if isinstance(self.timestamp, bool) or not isinstance(self.timestamp, int | float):
            raise ValueError(
                f"FaultReport.timestamp must be a number of seconds, got {self.timestamp!r}"
            )
        if not math.isfinite(self.timestamp):
            raise ValueError(f"FaultReport.timestamp must be finite, got {self.timestamp!r}")
        object.__setattr__(self, "timestamp", float(self.timestamp))
        object.__setattr__(self, "evidence", _canonical_evidence(self.evidence))

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON dictionary form (enums as their values, tuples as lists), with a ``version`` key."""
        return {
            "version": REPORT_VERSION,
            "kind": self.kind.value,
            "scope": self.scope.value,
            "ranks": list(self.ranks),
            "step": self.step,
            "recipe": self.recipe,
            "evidence": _thaw(self.evidence),
            "confirmations": self.confirmations,
            "reason": self.reason,
            "host": self.host,
            "timestamp": self.timestamp,
        }

    def to_json(self) -> str:
        """Canonical JSON text (sorted keys, no NaN); ``from_json(to_json())`` equals the report."""
        return json.dumps(self.to_dict(), sort_keys=True, allow_nan=False, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FaultReport:
        """Build a report from :meth:`to_dict` output.

        Raises :class:`~gemscout.errors.EvidenceError` when ``data`` is not a mapping, has missing or unknown keys, an
        unsupported ``version``, or a value the constructor rejects.
        """
        if not isinstance(data, Mapping):
            raise EvidenceError(f"fault report must be a JSON object, got {type(data).__name__}")
        expected = {"version", *(f for f in cls.__dataclass_fields__)}
        missing = sorted(expected - set(data))
        unknown = sorted(set(data) - expected)
        if missing or unknown:
            raise EvidenceError(
                f"fault report keys do not match: missing {missing}, unknown {unknown}"
            )
        if data["version"] != REPORT_VERSION:
            raise EvidenceError(
                f"fault report version {data['version']!r} is not supported (expected {REPORT_VERSION})"
            )
        ranks = data["ranks"]
        if not isinstance(ranks, list | tuple):
            raise EvidenceError(f"fault report 'ranks' must be a list, got {type(ranks).__name__}")
        try:
            return cls(
                kind=data["kind"],
                scope=data["scope"],
                ranks=tuple(ranks),
                step=data["step"],
                recipe=data["recipe"],
                evidence=data["evidence"],
                confirmations=data["confirmations"],
                reason=data["reason"],
                host=data["host"],
                timestamp=data["timestamp"],
            )
        except ValueError as exc:
            raise EvidenceError(f"malformed fault report: {exc}") from exc

    @classmethod
    def from_json(cls, text: str | bytes) -> FaultReport:
        """Parse :meth:`to_json` output; raises :class:`~gemscout.errors.EvidenceError` on bad JSON or content."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise EvidenceError(f"fault report is not valid JSON: {exc}") from exc
        return cls.from_dict(data)
