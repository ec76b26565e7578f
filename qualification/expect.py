"""Check a cell's expectations against what its program observed.

An expectation is either a plain value (string, number, boolean, list), compared for equality, or an operator table
with any of ``le``, ``ge`` (numeric bounds) and ``in`` (membership), all of which must hold. Booleans never equal
numbers here, although Python says ``True == 1``: an expectation ``bitwise_equal = true`` must not pass on an observed
``1``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

OPERATORS = ("le", "ge", "in")


def check(expect: Mapping[str, Any], observed: Mapping[str, Any]) -> list[str]:
    """Return one line per unmet expectation (empty when all hold), in the order of ``expect``.

    Each line names the key, the expectation and the observed value, e.g.
    ``recovered_step: expected 4, observed 3`` or ``loss: expected <= 0.5, observed 0.7``.
    """
    mismatches = []
    for key, want in expect.items():
        if key not in observed:
            mismatches.append(f"{key}: expected {describe(want)}, but the program did not report it")
            continue
        got = observed[key]
        if not holds(want, got):
            mismatches.append(f"{key}: expected {describe(want)}, observed {_show(got)}")
    return mismatches


def holds(want: Any, got: Any) -> bool:
    """True when the observed value ``got`` satisfies the expectation ``want``."""
    if isinstance(want, Mapping):
        return all(_operator_holds(op, bound, got) for op, bound in want.items())
    return same(want, got)


def same(want: Any, got: Any) -> bool:
    """Equality of JSON values that keeps booleans apart from numbers (and compares lists element-wise)."""
    if isinstance(want, bool) or isinstance(got, bool):
        return isinstance(want, bool) and isinstance(got, bool) and want is got
    if isinstance(want, list | tuple) and isinstance(got, list | tuple):
        return len(want) == len(got) and all(same(w, g) for w, g in zip(want, got, strict=True))
    if isinstance(want, Mapping) and isinstance(got, Mapping):
        return want.keys() == got.keys() and all(same(want[k], got[k]) for k in want)
    if _is_number(want) and _is_number(got):
        return bool(want == got)
    return type(want) is type(got) and bool(want == got)


def describe(want: Any) -> str:
    """The expectation in words: ``4``, ``<= 0.5``, ``>= 1 and <= 3``, ``one of [1, 2]``."""
    if not isinstance(want, Mapping):
        return _show(want)
    parts = []
    for op, bound in want.items():
        if op == "le":
            parts.append(f"<= {_show(bound)}")
        elif op == "ge":
            parts.append(f">= {_show(bound)}")
        elif op == "in":
            parts.append(f"one of {_show(bound)}")
        else:
            parts.append(f"{op} {_show(bound)}")
    return " and ".join(parts)


def _operator_holds(op: str, bound: Any, got: Any) -> bool:
    if op == "in":
        return any(same(choice, got) for choice in bound)
    if not _is_number(got):
        return False
    if op == "le":
        return bool(got <= bound)
    if op == "ge":
        return bool(got >= bound)
    # The campaign schema admits only OPERATORS; reaching here means the schema and this module disagree.
    raise AssertionError(f"unknown expectation operator {op!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    if value is None:
        return "null"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return str(value)
