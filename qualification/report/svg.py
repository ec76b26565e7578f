"""Small inline SVG charts for the report: overhead bars, latency percentiles and a per-cell timeline strip.

Each function returns :class:`markupsafe.Markup` that the template inserts as-is, so this module is the one place
where report text bypasses jinja's autoescape: every string that comes from a run (mode names, event details) goes
through :func:`markupsafe.escape` here, and every number is formatted, never interpolated raw. Charts draw with
``currentColor`` and a fixed palette, need no script or font, and carry ``<title>`` tooltips and ``role="img"``
labels so they read without the picture.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from markupsafe import Markup, escape

OK_COLOUR = "#1a7f37"
BAD_COLOUR = "#cf222e"
NEUTRAL_COLOUR = "#57606a"
P50_COLOUR = "#6e9fd8"
P95_COLOUR = "#1f4f8f"

EVENT_COLOURS = {
    "fault": "#cf222e",
    "detection": "#bf8700",
    "decision": "#0969da",
    "recovery": "#1a7f37",
}
"""The four lanes of a timeline strip, in the order a recovery goes through them; other events share a fifth."""

_WIDTH = 760
_LABEL_W = 150


@dataclass(frozen=True, slots=True)
class OverheadBar:
    """One bar: ``metric`` of ``mode`` changed by ``change_pct`` against the baseline; ``limit_pct`` is its threshold.

    ``higher_is_better`` says which side of the limit passes: throughput must stay above a (negative) floor,
    latency and memory below a ceiling.
    """

    mode: str
    metric: str
    change_pct: float
    limit_pct: float | None
    higher_is_better: bool

    @property
    def within(self) -> bool | None:
        if self.limit_pct is None:
            return None
        return (
            self.change_pct >= self.limit_pct
            if self.higher_is_better
            else self.change_pct <= self.limit_pct
        )


@dataclass(frozen=True, slots=True)
class LatencyRow:
    mode: str
    p50_ms: float | None
    p95_ms: float | None


@dataclass(frozen=True, slots=True)
class TimelineMark:
    t: float
    event: str
    detail: str
    rank: int | None


def _num(value: float) -> str:
    """A coordinate: two decimals at most, never ``nan``/``inf`` (callers clamp before this)."""
    return f"{value:.2f}".rstrip("0").rstrip(".")


def _svg(height: float, label: str, body: list[str]) -> Markup:
    return Markup(
        f'<svg xmlns="http://www.w3.org/2000/svg" role="img" aria-label="{escape(label)}" '
        f'viewBox="0 0 {_WIDTH} {_num(height)}" width="{_WIDTH}" height="{_num(height)}" class="chart">'
        + "".join(body)
        + "</svg>"
    )


def overhead_chart(bars: Sequence[OverheadBar]) -> Markup:
    """Horizontal bars of the change against the baseline in %, zero in the middle, each bar's threshold as a tick.

    A bar is green inside its threshold, red outside it, grey without one; the value and the limit are written in a
    column of their own on the right, so a tick never sits on top of a label.
    """
    values = [abs(b.change_pct) for b in bars] + [
        abs(b.limit_pct) for b in bars if b.limit_pct is not None
    ]
    span = 5.0 * math.ceil(max([5.0, *values]) * 1.1 / 5.0)  # a round axis: ±5, ±10, ±15 ...
    row_h, top, value_w = 22.0, 24.0, 150
    plot_w = _WIDTH - _LABEL_W - value_w - 10
    zero_x = _LABEL_W + plot_w / 2

    def x(pct: float) -> float:
        return zero_x + max(-span, min(span, pct)) / span * (plot_w / 2)

    height = top + row_h * len(bars) + 26
    body = [
        f'<text x="{_num(zero_x)}" y="14" text-anchor="middle" class="axis">0 %</text>',
        f'<text x="{_LABEL_W}" y="14" class="axis">-{span:g} %</text>',
        f'<text x="{_num(_LABEL_W + plot_w)}" y="14" text-anchor="end" class="axis">+{span:g} %</text>',
    ]
    for i, bar in enumerate(bars):
        y = top + i * row_h
        colour = {True: OK_COLOUR, False: BAD_COLOUR, None: NEUTRAL_COLOUR}[bar.within]
        left, right = sorted((x(0.0), x(bar.change_pct)))
        kind = "floor" if bar.higher_is_better else "ceiling"
        limit = "no threshold" if bar.limit_pct is None else f"{kind} {bar.limit_pct:+g} %"
        body.append(
            f'<text x="{_LABEL_W - 8}" y="{_num(y + 15)}" text-anchor="end">'
            f"{escape(bar.mode)} · {escape(bar.metric)}</text>"
            f'<rect x="{_num(left)}" y="{_num(y + 4)}" width="{_num(max(right - left, 1.0))}" height="14" '
            f'fill="{colour}"><title>{escape(bar.mode)} {escape(bar.metric)}: {bar.change_pct:+.2f} % '
            f"vs baseline ({limit})</title></rect>"
            f'<text x="{_WIDTH - 8}" y="{_num(y + 15)}" text-anchor="end" class="value" fill="{colour}">'
            f"{bar.change_pct:+.1f} % ({limit})</text>"
        )
        if bar.limit_pct is not None:
            lx = x(bar.limit_pct)
            body.append(
                f'<line x1="{_num(lx)}" x2="{_num(lx)}" y1="{_num(y + 1)}" y2="{_num(y + row_h - 1)}" '
                f'class="limit"><title>{limit}</title></line>'
            )
    bottom = top + row_h * len(bars)
    body.append(
        f'<line x1="{_num(zero_x)}" x2="{_num(zero_x)}" y1="{_num(top - 4)}" y2="{_num(bottom)}" '
        'class="zero"/>'
    )
    body.append(
        f'<text x="{_LABEL_W}" y="{_num(bottom + 18)}" class="axis">change vs baseline; dashed tick = '
        "threshold (throughput: floor, latency and memory: ceiling)</text>"
    )
    return _svg(height, "overhead against the baseline per mode", body)


def percentile_chart(rows: Sequence[LatencyRow]) -> Markup:
    """Per mode, a p50 bar over a p95 bar on one millisecond scale, each labelled with its value."""
    values = [v for r in rows for v in (r.p50_ms, r.p95_ms) if v is not None and math.isfinite(v)]
    scale_max = max([1e-9, *values]) * 1.15
    plot_w = _WIDTH - _LABEL_W - 70
    bar_h, row_h, top = 11.0, 30.0, 8.0
    body = []
    for i, row in enumerate(rows):
        y = top + i * row_h
        body.append(
            f'<text x="{_LABEL_W - 8}" y="{_num(y + 15)}" text-anchor="end">{escape(row.mode)}</text>'
        )
        for j, (name, value, colour) in enumerate(
            (("p50", row.p50_ms, P50_COLOUR), ("p95", row.p95_ms, P95_COLOUR))
        ):
            by = y + j * (bar_h + 1)
            if value is None or not math.isfinite(value):
                body.append(
                    f'<text x="{_LABEL_W}" y="{_num(by + 9)}" class="value">{name}: not measured</text>'
                )
                continue
            w = max(value, 0.0) / scale_max * plot_w
            body.append(
                f'<rect x="{_LABEL_W}" y="{_num(by)}" width="{_num(max(w, 1.0))}" height="{_num(bar_h)}" '
                f'fill="{colour}"><title>{escape(row.mode)} {name}: {value:.3f} ms</title></rect>'
                f'<text x="{_num(_LABEL_W + w + 4)}" y="{_num(by + 9)}" class="value">{name} {value:.2f} ms</text>'
            )
    height = top + row_h * len(rows) + 20
    body.append(
        f'<text x="{_LABEL_W}" y="{_num(height - 6)}" class="axis">step latency, ms '
        f"(light: p50, dark: p95; scale 0–{scale_max:.3g} ms)</text>"
    )
    return _svg(height, "step latency percentiles per mode", body)


def timeline_strip(marks: Sequence[TimelineMark], end_s: float | None = None) -> Markup:
    """One lane per recovery phase (fault, detection, decision, recovery) plus one for other events, on a shared
    time axis from 0 to the last event (or ``end_s``); each marker's tooltip holds its time, rank and detail."""
    lanes = [*EVENT_COLOURS, "other"]
    last = max([m.t for m in marks if math.isfinite(m.t)] + [end_s or 0.0, 1e-9])
    plot_w = _WIDTH - _LABEL_W - 30
    lane_h, top = 18.0, 6.0

    def x(t: float) -> float:
        return _LABEL_W + max(0.0, min(t, last)) / last * plot_w if math.isfinite(t) else _LABEL_W

    body = []
    for i, lane in enumerate(lanes):
        y = top + i * lane_h
        body.append(
            f'<text x="{_LABEL_W - 8}" y="{_num(y + 12)}" text-anchor="end" class="lane">{lane}</text>'
            f'<line x1="{_LABEL_W}" x2="{_LABEL_W + plot_w}" y1="{_num(y + 8)}" y2="{_num(y + 8)}" '
            'class="track"/>'
        )
    for mark in marks:
        lane = mark.event if mark.event in EVENT_COLOURS else "other"
        cy = top + lanes.index(lane) * lane_h + 8
        colour = EVENT_COLOURS.get(mark.event, NEUTRAL_COLOUR)
        who = "" if mark.rank is None else f" rank {mark.rank}"
        tip = f"{mark.t:.3f} s {escape(mark.event)}{who}: {escape(mark.detail)}"
        shape = (
            f'<circle cx="{_num(x(mark.t))}" cy="{_num(cy)}" r="6" fill="{colour}">'
            if lane != "other"
            else f'<rect x="{_num(x(mark.t) - 2)}" y="{_num(cy - 6)}" width="4" height="12" fill="{colour}">'
        )
        body.append(
            shape + f"<title>{tip}</title>" + ("</circle>" if lane != "other" else "</rect>")
        )
    axis_y = top + len(lanes) * lane_h + 8
    body.append(
        f'<text x="{_LABEL_W}" y="{_num(axis_y)}" class="axis">0 s</text>'
        f'<text x="{_LABEL_W + plot_w}" y="{_num(axis_y)}" text-anchor="end" class="axis">{last:.2f} s</text>'
    )
    return _svg(axis_y + 6, "timeline of fault, detection, decision and recovery", body)


@dataclass(frozen=True, slots=True)
class ValueBar:
    label: str
    value: float
    note: str


def value_chart(bars: Sequence[ValueBar], *, unit: str, label: str) -> Markup:
    """Horizontal bars of one quantity per row, from zero, each with its value and a note on the right."""
    scale_max = max([1e-9, *(b.value for b in bars if math.isfinite(b.value))]) * 1.1
    row_h, top, value_w = 22.0, 8.0, 230
    plot_w = _WIDTH - _LABEL_W - value_w - 10
    body = []
    for i, bar in enumerate(bars):
        y = top + i * row_h
        value = bar.value if math.isfinite(bar.value) else 0.0
        width = max(value / scale_max * plot_w, 1.0)
        body.append(
            f'<text x="{_LABEL_W - 8}" y="{_num(y + 15)}" text-anchor="end">{escape(bar.label)}</text>'
            f'<rect x="{_LABEL_W}" y="{_num(y + 4)}" width="{_num(width)}" height="14" '
            f'fill="{NEUTRAL_COLOUR}"><title>{escape(bar.label)}: {bar.value:.3g} {escape(unit)}'
            f"</title></rect>"
            f'<text x="{_WIDTH - 8}" y="{_num(y + 15)}" text-anchor="end" class="value">'
            f"{bar.value:.3g} {escape(unit)} {escape(bar.note)}</text>"
        )
    return _svg(top + row_h * len(bars) + 8, label, body)
