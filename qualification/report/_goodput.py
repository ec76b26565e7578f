"""The goodput benchmark in the report: per arm its wall time, goodput, wasted time per failure, step time and
seconds from the last step to the relaunched start per failure, as a table and
two bar charts, from a ``bench_cell`` whose ``metrics`` hold ``arms`` (:mod:`qualification.bench.goodput`)."""

from __future__ import annotations

import math
from typing import Any

from qualification.report.svg import ValueBar, value_chart


def _float(value: Any) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok and math.isfinite(value) else math.nan


def _ms(seconds: Any) -> str:
    value = _float(seconds)
    return f"{value * 1e3:.1f}" if math.isfinite(value) else "–"


def is_goodput_cell(cell: dict[str, Any]) -> bool:
    arms = cell["metrics"].get("arms")
    return isinstance(arms, list) and any(isinstance(a, dict) for a in arms)


def goodput_view(cell: dict[str, Any]) -> dict[str, Any]:
    arms = [a for a in cell["metrics"]["arms"] if isinstance(a, dict)]
    rows = []
    for arm in arms:
        bitwise = arm.get("bitwise_equal_to_ideal")
        rows.append(
            {
                "arm": str(arm.get("arm", "?")),
                "wall": _float(arm.get("wall_s")),
                "goodput": _float(arm.get("goodput")),
                "wasted": _float(arm.get("wasted_per_failure_s")),
                "step_ms": _ms(arm.get("step_s")),
                "relaunch": ", ".join(f"{_float(x):.1f}" for x in arm.get("relaunch_s") or [])
                or "–",
                "resumed": ", ".join(map(str, arm.get("resume_steps") or [])) or "–",
                "bitwise": "yes" if bitwise else "no" if bitwise is False else "–",
            }
        )
    skipped = cell["metrics"].get("skipped")
    return {
        "id": cell["id"],
        "rows": rows,
        "skipped": dict(skipped) if isinstance(skipped, dict) else {},
        "goodput_svg": value_chart(
            [ValueBar(r["arm"], r["goodput"], "") for r in rows],
            unit="",
            label="goodput per arm (useful step time over wall time)",
        ),
        "wasted_svg": value_chart(
            [ValueBar(r["arm"], r["wasted"], "per failure") for r in rows],
            unit="s",
            label="wasted time per failure per arm",
        ),
    }
