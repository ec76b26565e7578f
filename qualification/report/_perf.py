"""Healthy-path performance: per-mode tables and chart inputs from a cell whose ``metrics`` hold ``modes``.

The healthy-path suite runs baseline, GEMINI-only, SCOUT-only and combined modes and writes, per mode,
``throughput_steps_s``, ``p50_ms``, ``p95_ms`` and ``peak_rss_mib``, plus ``thresholds[mode]`` such as
``{"throughput_pct": -5, "p95_pct": 10}``: a throughput change may not fall below its (negative) floor, a latency or
memory change may not rise above its ceiling. Changes are ``(mode / baseline - 1) * 100``. Shown when present, not
judged: ``process_cpu_ms`` (CPU per step, background threads included — what a shared machine's load cannot stretch)
and ``due_step_extra_ms`` (how much longer a capture / replay step takes than the others).
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from qualification.report.svg import LatencyRow, OverheadBar, overhead_chart, percentile_chart

METRICS = (
    "throughput_steps_s",
    "p50_ms",
    "p95_ms",
    "peak_rss_mib",
    "process_cpu_ms",
    "due_step_extra_ms",
)
# threshold key -> (metric it bounds, label, higher is better)
THRESHOLDS = {
    "throughput_pct": ("throughput_steps_s", "throughput", True),
    "p50_pct": ("p50_ms", "p50", False),
    "p95_pct": ("p95_ms", "p95", False),
    "peak_rss_pct": ("peak_rss_mib", "peak RSS", False),
}
MODE_ORDER = ("baseline", "gemini", "scout", "combined")
"""How the suite's modes read best; summary.json sorts keys, so its order is alphabetical and not this."""
CHARTED = ("throughput_pct", "p95_pct")
"""Bars every mode gets; other metrics get a bar only when the suite set a threshold for them."""


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return math.nan
    return float(value)


def _shown(value: float, spec: str) -> str:
    return "–" if math.isnan(value) else format(value, spec)


def is_performance_cell(cell: dict[str, Any]) -> bool:
    modes = cell["metrics"].get("modes")
    return isinstance(modes, dict) and any(isinstance(v, dict) for v in modes.values())


def performance_view(cell: dict[str, Any]) -> dict[str, Any]:
    """Table rows, an overhead chart and a percentile chart for one performance cell."""
    given = {
        str(name): values
        for name, values in cell["metrics"]["modes"].items()
        if isinstance(values, dict)
    }
    order = [m for m in MODE_ORDER if m in given] + sorted(m for m in given if m not in MODE_ORDER)
    modes = {name: given[name] for name in order}
    frame = pd.DataFrame.from_dict(
        {
            name: {metric: _float(values.get(metric)) for metric in METRICS}
            for name, values in modes.items()
        },
        orient="index",
        columns=list(METRICS),
    )
    has_baseline = "baseline" in frame.index
    if has_baseline:
        # A zero or missing baseline makes every change undefined rather than infinite.
        base = frame.loc["baseline"].where(frame.loc["baseline"] > 0)
        change = (frame / base - 1.0) * 100.0
    else:
        change = pd.DataFrame(math.nan, index=frame.index, columns=frame.columns)
    thresholds = cell["metrics"].get("thresholds")
    thresholds = thresholds if isinstance(thresholds, dict) else {}

    rows, bars = [], []
    for mode in frame.index:
        given_limits = thresholds.get(mode)
        limits: dict[str, Any] = given_limits if isinstance(given_limits, dict) else {}
        findings, judged = [], False
        for key, (metric, label, higher_is_better) in THRESHOLDS.items():
            delta, limit = float(change.at[mode, metric]), _float(limits.get(key))
            if (
                mode == "baseline"
                or (key not in CHARTED and math.isnan(limit))
                or math.isnan(delta)
            ):
                continue
            bar = OverheadBar(
                mode, label, delta, None if math.isnan(limit) else limit, higher_is_better
            )
            bars.append(bar)
            if bar.within is not None:
                judged = True
                if not bar.within:
                    findings.append(f"{label} {delta:+.1f} % beyond {limit:+g} %")
        if mode == "baseline":
            verdict, status = "reference", "neutral"
        elif not has_baseline:
            verdict, status = "no baseline to compare with", "neutral"
        elif findings:
            verdict, status = "over: " + "; ".join(findings), "failed"
        else:
            verdict, status = (
                ("within thresholds", "passed") if judged else ("no thresholds", "neutral")
            )
        rows.append(
            {
                "mode": mode,
                "throughput": _shown(frame.at[mode, "throughput_steps_s"], ".2f"),
                "p50": _shown(frame.at[mode, "p50_ms"], ".2f"),
                "p95": _shown(frame.at[mode, "p95_ms"], ".2f"),
                "rss": _shown(frame.at[mode, "peak_rss_mib"], ".0f"),
                "throughput_change": _shown(change.at[mode, "throughput_steps_s"], "+.1f"),
                "p95_change": _shown(change.at[mode, "p95_ms"], "+.1f"),
                "cpu_change": _shown(change.at[mode, "process_cpu_ms"], "+.1f"),
                "due_extra": _shown(frame.at[mode, "due_step_extra_ms"], "+.1f"),
                "thresholds": ", ".join(
                    f"{k} {v:+g}" for k, v in limits.items() if not math.isnan(_float(v))
                )
                or "–",
                "verdict": verdict,
                "status": status,
            }
        )
    latency = [
        LatencyRow(mode, None if math.isnan(p50) else p50, None if math.isnan(p95) else p95)
        for mode, p50, p95 in zip(frame.index, frame["p50_ms"], frame["p95_ms"], strict=True)
    ]
    return {
        "id": cell["id"],
        "rows": rows,
        "overhead_svg": overhead_chart(bars) if bars else None,
        "percentile_svg": percentile_chart(latency),
    }
