"""Check a cell's expectations against what its program observed.

An expectation is either a plain value (string, number, boolean, list), compared for equality, or an operator table
with any of ``le``, ``ge`` (numeric bounds), ``eq`` (equality) and ``in`` (membership), all of which must hold.
Booleans never equal numbers here, although Python says ``True == 1``: an expectation ``bitwise_equal = true`` must
not pass on an observed ``1``.

A bound of ``le``, ``ge`` or ``eq`` may refer to another observed value or to the cell's own parameters instead of a
literal: ``attributed_step = { ge = "fault.step", le = "fault.step + params.rotation" }``. A reference is a sum of
terms, each ``observed.KEY``, ``params.KEY``, ``fault.KEY``, ``cell.world_size`` / ``cell.seed`` or an integer, joined by ``+`` or ``-``; it is resolved
before the comparison, and a reference to something absent (or not a number, in a sum) is itself an unmet
expectation, never a silent pass.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

OPERATORS = ("le", "ge", "eq", "in")
REFERENCE = re.compile(
    r"^\s*(observed|params|fault|cell)\.[A-Za-z_][A-Za-z0-9_]*(\s*[+-]\s*((observed|params|fault|cell)\."
    r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+))*\s*$"
)
_TERM = re.compile(r"([+-]?)\s*((observed|params|fault|cell)\.([A-Za-z_][A-Za-z0-9_]*)|[0-9]+)")


class Unresolved(Exception):
    """A reference names a value the cell does not have."""


def check(
    expect: Mapping[str, Any],
    observed: Mapping[str, Any],
    *,
    params: Mapping[str, Any] | None = None,
    fault: Mapping[str, Any] | None = None,
    cell: Mapping[str, Any] | None = None,
) -> list[str]:
    """Return one line per unmet expectation (empty when all hold), in the order of ``expect``.

    Each line names the key, the expectation and the observed value, e.g.
    ``recovered_step: expected 4, observed 3`` or ``loss: expected <= 0.5, observed 0.7``; a reference is shown with
    the value it resolved to (``expected <= fault.step + params.rotation (= 14), observed 15``).
    """
    scope = {"observed": observed, "params": params or {}, "fault": fault or {}, "cell": cell or {}}
    mismatches = []
    for key, want in expect.items():
        if key not in observed:
            mismatches.append(
                f"{key}: expected {describe(want)}, but the program did not report it"
            )
            continue
        got = observed[key]
        try:
            resolved = resolve(want, scope)
        except Unresolved as exc:
            mismatches.append(f"{key}: expected {describe(want)}, but {exc}")
            continue
        if not holds(resolved, got):
            mismatches.append(f"{key}: expected {describe(want, resolved)}, observed {_show(got)}")
    return mismatches


def is_reference(value: Any) -> bool:
    return isinstance(value, str) and REFERENCE.match(value) is not None


def resolve(want: Any, scope: Mapping[str, Mapping[str, Any]]) -> Any:
    """``want`` with every reference bound in its operator table replaced by the value it names."""
    if not isinstance(want, Mapping):
        return want
    return {
        op: _resolve_bound(bound, scope)
        if op in ("le", "ge", "eq") and is_reference(bound)
        else bound
        for op, bound in want.items()
    }


def _resolve_bound(text: str, scope: Mapping[str, Mapping[str, Any]]) -> Any:
    terms = list(_TERM.finditer(text))
    values = []
    for term in terms:
        sign, whole, table, key = term.group(1), term.group(2), term.group(3), term.group(4)
        if table is None:
            value: Any = int(whole)
        elif key not in scope.get(table, {}):
            raise Unresolved(f"{whole} is not reported or set for this cell")
        else:
            value = scope[table][key]
        values.append((-1 if sign == "-" else 1, whole, value))
    if len(values) == 1 and values[0][0] == 1:
        return values[0][2]  # a plain reference may name any value (eq on a string or a list)
    total: int | float = 0
    for sign, whole, value in values:
        if not _is_number(value):
            raise Unresolved(f"{whole} is {_show(value)}, not a number")
        total += sign * value
    return total


def holds(want: Any, got: Any) -> bool:
    """True when the observed value ``got`` satisfies the (resolved) expectation ``want``."""
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


def describe(want: Any, resolved: Any = None) -> str:
    """The expectation in words: ``4``, ``<= 0.5``, ``>= 1 and <= 3``, ``one of [1, 2]``; a reference as written,
    then what it resolved to when ``resolved`` is given."""
    if not isinstance(want, Mapping):
        return _show(want)
    parts = []
    for op, bound in want.items():
        shown = bound if is_reference(bound) else _show(bound)
        if is_reference(bound) and isinstance(resolved, Mapping) and op in resolved:
            shown += f" (= {_show(resolved[op])})"
        if op == "le":
            parts.append(f"<= {shown}")
        elif op == "ge":
            parts.append(f">= {shown}")
        elif op == "eq":
            parts.append(f"== {shown}")
        elif op == "in":
            parts.append(f"one of {_show(bound)}")
        else:
            parts.append(f"{op} {_show(bound)}")
    return " and ".join(parts)


def _operator_holds(op: str, bound: Any, got: Any) -> bool:
    if op == "in":
        return any(same(choice, got) for choice in bound)
    if op == "eq":
        return same(bound, got)
    if not _is_number(got) or not _is_number(bound):
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
