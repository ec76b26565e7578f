"""Preconditions: what peers must agree on before their outputs may be compared.

C3 compares outputs, and an output differs for many innocent reasons: a peer replayed another step, another recipe,
inputs of another shape, another input batch or another RNG state (dropout). Attributing any of those to "the odd
rank out" would name an innocent rank, so :func:`judge` checks every precondition first and answers
``INCONCLUSIVE`` — never ``ATTRIBUTED`` — when one disagrees, with a reason naming the field and how the ranks split.

The parameters are the exception. Peers are replicas, so their own parameters must be bitwise equal; when everything
else agrees and they differ, nothing innocent explains it: a parameter was corrupted in memory, or a rank's update
went wrong earlier. That divergence is judged by strict majority over the parameter digests, like an output.

Records travel between peers as JSON (:meth:`Precondition.to_dict` / :meth:`Precondition.from_dict`); nothing here
is ever pickled.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gemscout.errors import EvidenceError
from gemscout.scout.consensus import C3Result, Verdict, c3, validate_c3_inputs

__all__ = [
    "PRECONDITION_FIELDS",
    "Precondition",
    "PreconditionMismatch",
    "check_preconditions",
    "find_precondition_mismatch",
    "judge",
]

# Checked in this order; the first field that disagrees is the one a reason names. Cheap identity fields come first
# because a peer on another step also has other inputs, and "step" is the more useful thing to be told.
PRECONDITION_FIELDS: tuple[str, ...] = (
    "step",
    "recipe",
    "shapes",
    "input_digest",
    "rng_digest",
    "param_digest",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Precondition:
    """What one peer held when it replayed a recipe. Construction validates and raises ``ValueError``."""

    step: int
    """Training step the recipe was captured at (>= 0)."""
    recipe: str
    """Recipe id, e.g. ``"hidden.3"``."""
    shapes: tuple[tuple[int, ...], ...]
    """Shapes of the recipe inputs, in the recipe's input order."""
    input_digest: str
    """Digest of the recipe inputs (after the source broadcast)."""
    rng_digest: str
    """Digest of the RNG state the replay starts from."""
    param_digest: str
    """Digest of the parameters the replay uses."""

    def __post_init__(self) -> None:
        if type(self.step) is not int or self.step < 0:
            raise ValueError(f"Precondition.step must be an int >= 0, got {self.step!r}")
        for name in ("recipe", "input_digest", "rng_digest", "param_digest"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"Precondition.{name} must be a non-empty string, got {value!r}")
        try:
            shapes = tuple(tuple(shape) for shape in self.shapes)
        except TypeError:
            raise ValueError(
                f"Precondition.shapes must be a sequence of shapes, got {self.shapes!r}"
            ) from None
        for shape in shapes:
            if any(type(size) is not int or size < 0 for size in shape):
                raise ValueError(
                    f"Precondition.shapes must hold non-negative int sizes, got {shape!r}"
                )
        object.__setattr__(self, "shapes", shapes)

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON dictionary form (shapes as lists)."""
        return {
            "step": self.step,
            "recipe": self.recipe,
            "shapes": [list(shape) for shape in self.shapes],
            "input_digest": self.input_digest,
            "rng_digest": self.rng_digest,
            "param_digest": self.param_digest,
        }

    def to_json(self) -> str:
        """Canonical JSON text (sorted keys)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Precondition:
        """Build a record from :meth:`to_dict` output.

        Raises :class:`~gemscout.errors.EvidenceError` for a non-mapping, missing or unknown keys, or invalid values.
        """
        if not isinstance(data, Mapping):
            raise EvidenceError(
                f"precondition record must be a JSON object, got {type(data).__name__}"
            )
        missing = sorted(set(PRECONDITION_FIELDS) - set(data))
        unknown = sorted(set(data) - set(PRECONDITION_FIELDS))
        if missing or unknown:
            raise EvidenceError(
                f"precondition record keys do not match: missing {missing}, unknown {unknown}"
            )
        shapes = data["shapes"]
        if not isinstance(shapes, list | tuple) or not all(
            isinstance(shape, list | tuple) for shape in shapes
        ):
            raise EvidenceError(
                f"precondition record 'shapes' must be a list of lists, got {shapes!r}"
            )
        try:
            return cls(**{name: data[name] for name in PRECONDITION_FIELDS})
        except ValueError as exc:
            raise EvidenceError(f"malformed precondition record: {exc}") from exc

    @classmethod
    def from_json(cls, text: str | bytes) -> Precondition:
        """Parse :meth:`to_json` output; raises :class:`~gemscout.errors.EvidenceError` on bad JSON or content."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise EvidenceError(f"precondition record is not valid JSON: {exc}") from exc
        return cls.from_dict(data)


@dataclass(frozen=True, slots=True, kw_only=True)
class PreconditionMismatch:
    """The first precondition field on which peers disagree, and how the ranks split over its values."""

    field: str
    """Name of the disagreeing field (one of :data:`PRECONDITION_FIELDS`)."""
    groups: tuple[tuple[int, ...], ...]
    """Ranks grouped by the value they hold, largest group first (ties by lowest rank)."""
    disagreeing_ranks: tuple[int, ...]
    """Ranks outside the single largest group; every rank when the largest group is tied."""

    @property
    def reason(self) -> str:
        """One sentence naming the field and the ranks; explicitly not an attribution."""
        split = " | ".join(str(list(group)) for group in self.groups)
        return (
            f"precondition '{self.field}' disagrees across peers (ranks by value: {split}); "
            f"disagreeing ranks {list(self.disagreeing_ranks)}; outputs were not compared"
        )


def find_precondition_mismatch(
    records_by_rank: Mapping[int, Precondition],
) -> PreconditionMismatch | None:
    """Return the first field (in :data:`PRECONDITION_FIELDS` order) on which the records differ, or None.

    Raises ``TypeError`` when a value is not a :class:`Precondition`.
    """
    for rank, record in records_by_rank.items():
        if not isinstance(record, Precondition):
            raise TypeError(
                f"records_by_rank[{rank!r}] must be a Precondition, got {type(record).__name__}"
            )
    for name in PRECONDITION_FIELDS:
        by_value: dict[Any, list[int]] = {}
        for rank in sorted(records_by_rank):
            by_value.setdefault(getattr(records_by_rank[rank], name), []).append(rank)
        if len(by_value) == 1:
            continue
        groups = sorted(
            (tuple(ranks) for ranks in by_value.values()), key=lambda group: (-len(group), group[0])
        )
        if len(groups[0]) > len(groups[1]):
            disagreeing = tuple(sorted(rank for group in groups[1:] for rank in group))
        else:
            disagreeing = tuple(sorted(records_by_rank))
        return PreconditionMismatch(field=name, groups=tuple(groups), disagreeing_ranks=disagreeing)
    return None


def check_preconditions(records_by_rank: Mapping[int, Precondition]) -> str | None:
    """Return None when every peer's record agrees on every field, else a reason naming the first disagreeing field
    and the ranks on each side. Pure; raises ``TypeError`` for a value that is not a :class:`Precondition`."""
    mismatch = find_precondition_mismatch(records_by_rank)
    return None if mismatch is None else mismatch.reason


def _inconclusive(
    recipe: str, step: int, digests_by_rank: Mapping[int, str], reason: str
) -> C3Result:
    return C3Result(
        verdict=Verdict.INCONCLUSIVE,
        recipe=recipe,
        step=step,
        digests_by_rank=dict(digests_by_rank),
        reason=reason,
        preconditions_ok=False,
    )


def judge(
    records_by_rank: Mapping[int, Precondition],
    digests_by_rank: Mapping[int, str],
    *,
    recipe: str,
    step: int,
) -> C3Result:
    """Check preconditions, then apply :func:`~gemscout.scout.consensus.c3` to the output digests.

    The verdict is ``INCONCLUSIVE`` with ``preconditions_ok=False`` — whatever the digests say — when a rank sent a
    digest but no record or the reverse, when the records disagree on a field the replay starts from (the reason
    names the first one and the ranks), or when the agreed records are for another ``step`` or ``recipe`` than the
    one being judged. When they disagree only on ``param_digest``, the replicas' own parameters diverged: that is
    judged by strict majority over the parameter digests (:func:`_diverged`), an attribution like an output's.
    Pure and non-blocking. Raises ``ValueError`` for the inputs :func:`c3` rejects and ``TypeError`` for a record that
    is not a :class:`Precondition`.
    """
    validate_c3_inputs(digests_by_rank, recipe=recipe, step=step, allow_empty=True)
    if not isinstance(records_by_rank, Mapping):
        raise TypeError(
            f"records_by_rank must be a mapping of rank to Precondition, got {type(records_by_rank).__name__}"
        )
    if not records_by_rank and not digests_by_rank:
        raise ValueError("judge needs at least one peer's record and digest")
    record_ranks, digest_ranks = set(records_by_rank), set(digests_by_rank)
    if record_ranks != digest_ranks:
        return _inconclusive(
            recipe,
            step,
            digests_by_rank,
            f"peers are incomplete: no precondition record from ranks {sorted(digest_ranks - record_ranks)}, "
            f"no output digest from ranks {sorted(record_ranks - digest_ranks)}; outputs were not compared",
        )
    mismatch = find_precondition_mismatch(records_by_rank)
    if mismatch is not None and mismatch.field != "param_digest":
        return _inconclusive(recipe, step, digests_by_rank, mismatch.reason)
    agreed = next(iter(records_by_rank.values()))
    for name, expected in (("step", step), ("recipe", recipe)):
        held = getattr(agreed, name)
        if held != expected:
            return _inconclusive(
                recipe,
                step,
                digests_by_rank,
                f"precondition '{name}' does not match the verdict being made: peers agree on {held!r} but "
                f"{expected!r} was asked for (all ranks {sorted(record_ranks)}); outputs were not compared",
            )
    if mismatch is not None:
        return _diverged(records_by_rank, mismatch, recipe=recipe, step=step)
    return c3(digests_by_rank, recipe=recipe, step=step)


def _diverged(
    records_by_rank: Mapping[int, Precondition],
    mismatch: PreconditionMismatch,
    *,
    recipe: str,
    step: int,
) -> C3Result:
    """Peers agree on everything they replay from (step, recipe, shapes, inputs, RNG) but hold different parameters.

    Peers are replicas: their own parameters (and buffers, and for an optimizer slice its hyper-parameters) must be
    bitwise equal, so a difference *is* the fault — a parameter corrupted in memory, or a wrong update on that rank
    earlier. It is judged like an output, by strict majority over the parameter digests: the odd rank is named, and
    with no majority (two peers, a tie) the corruption is detected without a culprit. The outputs are not compared
    (they differ because the parameters do). The result's digests are the parameter digests."""
    result = c3(
        {rank: record.param_digest for rank, record in records_by_rank.items()},
        recipe=recipe,
        step=step,
    )
    split = " | ".join(str(list(group)) for group in mismatch.groups)
    if result.verdict is Verdict.ATTRIBUTED:
        reason = (
            f"parameters diverged: ranks {list(result.ranks)} hold parameters of {recipe!r} that differ from the "
            f"majority's (ranks by parameter digest: {split}); outputs were not compared"
        )
    else:
        reason = (
            f"parameters diverged without a strict majority (ranks by parameter digest: {split}): detection "
            "without a culprit; outputs were not compared"
        )
    return dataclasses.replace(result, reason=reason)
