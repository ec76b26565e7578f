"""Trust gating: which captured step has been vouched for by a clean pass of every recipe since it was taken.

A persistent fault on some rank in some block shows only when that block's recipe is replayed; with a rotation of
one block per due step, a clean cycle at step ``s`` says nothing about the blocks not checked at ``s``. So a capture
at step ``s`` may be trusted (GEMINI's RECOVERY_VERIFIED) only once *every* recipe of the catalog has passed clean at
some step ``>= s``, with no SDC seen in between. :class:`RotationTracker` answers "which is the newest such ``s``".

The rule, fed one due step at a time:

* ``AGREE`` → the recipe passed clean at that step;
* SDC — ``ATTRIBUTED``, or ``INCONCLUSIVE`` because the outputs differ without a majority — → nothing at or before
  that step can be vouched for: every clean pass recorded so far (same step included) is forgotten;
* ``INCONCLUSIVE`` on a precondition → neither: the recipe was not checked, and nothing is forgotten.

The certified step is then ``min`` over the catalog of each recipe's newest clean step (None until each has one).
A catalog checked whole at every due step certifies each clean due step at once. Pure: no process group.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gemscout.scout.consensus import C3Result, Verdict

__all__ = ["RotationTracker", "is_clean", "is_sdc"]


def is_clean(result: C3Result) -> bool:
    """True when every peer produced the same digest (the recipe passed clean)."""
    return result.verdict is Verdict.AGREE


def is_sdc(result: C3Result) -> bool:
    """True when the result shows corrupted output: attributed, or outputs differ with no majority (two peers)."""
    if result.verdict is Verdict.ATTRIBUTED:
        return True
    return (
        result.verdict is Verdict.INCONCLUSIVE
        and result.preconditions_ok
        and result.outputs_disagree
    )


class RotationTracker:
    """Tracks clean passes per recipe and answers the newest step every recipe has vouched for."""

    def __init__(self, catalog: Iterable[str]) -> None:
        """``catalog``: every recipe id of the rotation (non-empty, no duplicates); raises ``ValueError`` otherwise."""
        names = tuple(catalog)
        if (
            not names
            or any(not isinstance(n, str) or not n for n in names)
            or len(set(names)) != len(names)
        ):
            raise ValueError(
                f"RotationTracker needs a non-empty list of distinct recipe ids, got {names!r}"
            )
        self.catalog = names
        self._last_clean: dict[str, int] = {}
        self._last_step: int | None = None
        self._last_sdc: int | None = None

    @property
    def last_sdc_step(self) -> int | None:
        """The newest step at which SDC was seen (None if never since the last reset)."""
        return self._last_sdc

    def last_clean(self, recipe: str) -> int | None:
        """The newest step at which ``recipe`` passed clean since the last SDC, or None."""
        return self._last_clean.get(recipe)

    @property
    def pending(self) -> tuple[str, ...]:
        """Recipes that have not passed clean since the last SDC (or ever): what certification still waits for."""
        return tuple(name for name in self.catalog if name not in self._last_clean)

    def open_steps(self) -> set[int]:
        """The steps a later :attr:`certified_step` can name among those seen so far: each recipe's last clean
        pass (a certified step is always the minimum of those, and they only move forward). The captures of these
        steps must still exist when their certification comes."""
        return set(self._last_clean.values())

    @property
    def certified_step(self) -> int | None:
        """The newest step ``s`` such that every recipe passed clean at some step ``>= s`` with no SDC since; or
        None while any recipe has no clean pass since the last SDC."""
        if self.pending:
            return None
        return min(self._last_clean.values())

    def record(self, step: int, results: Mapping[str, C3Result]) -> int | None:
        """Feed the per-recipe results of the cycle at ``step`` and return :attr:`certified_step` after it.

        Steps must increase from call to call (after a recovery rewinds the step, call :meth:`reset` first).
        Raises ``ValueError`` for a non-increasing or negative step or a recipe id not in the catalog, and
        ``TypeError`` for a value that is not a :class:`C3Result`; nothing is recorded then.
        """
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(
                f"steps must increase: got {step} after {self._last_step}; reset() after a rewind"
            )
        for name, result in results.items():
            if name not in self.catalog:
                raise ValueError(
                    f"recipe {name!r} is not in the rotation catalog {list(self.catalog)}"
                )
            if not isinstance(result, C3Result):
                raise TypeError(
                    f"results[{name!r}] must be a C3Result, got {type(result).__name__}"
                )
        self._last_step = step
        if any(is_sdc(result) for result in results.values()):
            # Clean passes of this very step do not count either: the SDC may already be in what they vouched for.
            self._last_clean.clear()
            self._last_sdc = step
            return None
        for name, result in results.items():
            if is_clean(result):
                self._last_clean[name] = step
        return self.certified_step

    def reset(self) -> None:
        """Forget everything (after a recovery: the steps recorded belong to a timeline that was abandoned)."""
        self._last_clean.clear()
        self._last_step = None
        self._last_sdc = None
