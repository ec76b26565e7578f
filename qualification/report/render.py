"""Render a run directory or sealed bundle into one self-contained HTML file.

The page has no script, stylesheet, font or image from anywhere: CSS is inline and charts are inline SVG, so it opens
offline and from an artifact download. Templates run with autoescape on; the only markup that is not escaped by jinja
is the SVG from :mod:`.svg`, which escapes its own text.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jinja2
import pandas as pd

from qualification import expect
from qualification.errors import UsageError
from qualification.evidence.manifest import MANIFEST_NAME, sha256_file
from qualification.evidence.verdict import headline, scope_text
from qualification.evidence.verify import VerificationResult
from qualification.report._goodput import goodput_view, is_goodput_cell
from qualification.report._load import RunRecord, load_run
from qualification.report._perf import is_performance_cell, performance_view
from qualification.report.svg import EVENT_COLOURS, TimelineMark, timeline_strip

TEMPLATE = "report.html.j2"
VERDICTS = ("passed", "failed", "skipped", "measured")
_PHASES = (
    ("fault", "detection"),
    ("detection", "relaunch"),
    ("relaunch", "decision"),
    ("detection", "decision"),
    ("decision", "recovery"),
    ("fault", "recovery"),
    ("detection", "recovery"),
    ("fault", "first-step"),
)
"""Latencies between the first occurrences of two events, shown only when the cell recorded both, in that order: a
phase is measured from the event it names, never from a stand-in."""


def default_output(source: Path) -> Path:
    """``<source>.html`` beside the directory: a file written into a sealed bundle would make it fail verification
    (an undeclared extra file), and one written into an unsealed run would be sealed into the evidence later."""
    resolved = source.resolve()
    return resolved.with_name(resolved.name + ".html")


def render(
    source: Path,
    out_file: Path | None = None,
    *,
    verification: VerificationResult | None = None,
    verification_error: str | None = None,
) -> Path:
    """Write the HTML report of ``source`` (a run directory or sealed bundle) to ``out_file`` and return its path.

    ``out_file`` defaults to :func:`default_output`. ``verification`` is the result of
    :func:`qualification.evidence.verify.verify_bundle` on ``source`` (shown as VALID with its freshness);
    ``verification_error`` is the message of a verification that failed (shown as INVALID). Without either the
    report says the bundle was not verified. Reads every file once and writes the report atomically; raises
    :class:`UsageError` when ``source`` is not a run or bundle directory, or ``out_file`` lies inside a sealed one.
    """
    run = load_run(source)
    target = out_file if out_file is not None else default_output(source)
    if run.sealed and target.resolve().is_relative_to(source.resolve()):
        raise UsageError(
            f"{target} is inside the sealed bundle {source}; an extra file there would fail its "
            "verification. Write the report beside the bundle."
        )
    html = render_html(run, verification=verification, verification_error=verification_error)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(html, encoding="utf-8")
    os.replace(tmp, target)
    return target


def render_html(
    run: RunRecord,
    *,
    verification: VerificationResult | None = None,
    verification_error: str | None = None,
) -> str:
    """The report of ``run`` as an HTML string (see :func:`render`)."""
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).with_name("templates")),
        autoescape=True,  # every string in a result is untrusted: a cell message may hold markup
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    cells = run.cells
    view = _verification_view(run, verification, verification_error)
    return environment.get_template(TEMPLATE).render(
        run=run,
        commit_short=run.commit[:12] if run.commit else None,
        verification=view,
        # One verdict for the banner: INVALID, STALE or NOT VERIFIED dominate PASSED, in words and colour.
        headline=headline(
            validity=view["status"],
            result=run.result,
            scope=_headline_scope(run, verification if view["status"] == "VALID" else None),
            freshness=view.get("freshness"),
        ),
        scope=scope_text(run.scope) if run.scope is not None else None,
        campaigns=_cell_tables(cells),
        performance=[performance_view(cell) for cell in cells if is_performance_cell(cell)],
        goodput=[goodput_view(cell) for cell in cells if is_goodput_cell(cell)],
        details=[_cell_details(index, cell) for index, cell in enumerate(cells)],
        event_colours=EVENT_COLOURS,
        generated_at=datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
    )


def _headline_scope(
    run: RunRecord, verification: VerificationResult | None
) -> dict[str, Any] | None:
    # The verified manifest's scope when there is one; else what the files record (an unsealed run's summary); a
    # record with none (schema 1.0.0) says so.
    if verification is not None and verification.schema_version != "1.0.0":
        return verification.scope
    return run.scope


def _cell_tables(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One table per campaign (the part of the cell id before ``/``), cells in run order, with verdict counts."""
    if not cells:
        return []
    frame = pd.DataFrame(cells, dtype=object)
    frame["anchor"] = [f"cell-{index}" for index in range(len(frame))]
    tables = []
    for name, group in frame.groupby("campaign", sort=False):
        counts = group["verdict"].value_counts().reindex(VERDICTS, fill_value=0)
        durations = pd.to_numeric(group["duration_s"], errors="coerce")
        tables.append(
            {
                "name": str(name),
                "counts": {verdict: int(counts[verdict]) for verdict in VERDICTS},
                "total_s": float(durations.sum()) if durations.notna().any() else None,
                "rows": group.to_dict("records"),
            }
        )
    return tables


def _cell_details(index: int, cell: dict[str, Any]) -> dict[str, Any]:
    """Message, expectations against observations, timeline strip with phase latencies, and metrics of one cell."""
    scope = {"observed": cell["observed"], **cell.get("scope", {})}
    expectations = []
    for key, want in cell["expect"].items():
        try:  # a reference to another observation or a parameter is shown with the value it resolved to
            resolved = expect.resolve(want, scope)
        except expect.Unresolved:
            resolved = None
        expectations.append(
            {
                "key": key,
                "expected": expect.describe(want, resolved),
                "observed": _compact(cell["observed"][key])
                if key in cell["observed"]
                else "not reported",
                "met": resolved is not None
                and key in cell["observed"]
                and _holds(resolved, cell["observed"][key]),
            }
        )
    reported = {k: v for k, v in cell["observed"].items() if k not in cell["expect"]}
    events = cell["timeline"]
    first: dict[str, float] = {}
    for event in events:
        first.setdefault(event["event"], event["t"])
    phases = [
        {"name": f"{a} → {b}", "seconds": first[b] - first[a]}
        for a, b in _PHASES
        if a in first and b in first and first[b] >= first[a]
    ]
    marks = [TimelineMark(e["t"], e["event"], e["detail"], e["rank"]) for e in events]
    key_events = any(e["event"] in EVENT_COLOURS for e in events)
    return {
        "anchor": f"cell-{index}",
        "cell": cell,
        "expectations": expectations,
        "reported": [(key, _compact(value)) for key, value in reported.items()],
        "metrics": json.dumps(cell["metrics"], indent=1, sort_keys=True, default=str)
        if cell["metrics"]
        else "",
        "events": events,
        "phases": phases,
        # A strip of empty lanes says nothing; cells without recovery events get their event table only.
        "strip": timeline_strip(marks, cell["duration_s"]) if key_events else None,
        "open": cell["verdict"] == "failed" or key_events,
        "targets": cell.get("targets") or [],
    }


def _holds(want: Any, got: Any) -> bool:
    try:
        return expect.holds(want, got)
    except (
        AssertionError,
        TypeError,
    ):  # an expectation the schema would have refused; the engine's reason stands
        return False


def _compact(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 400 else text[:400] + " …"


def _verification_view(
    run: RunRecord, result: VerificationResult | None, error: str | None
) -> dict[str, Any]:
    """What the summary says about verification: VALID + freshness, INVALID + why, or not verified / not sealed."""
    if error is not None:
        return {"status": "INVALID", "tone": "failed", "lines": [error]}
    if result is None:
        if not run.sealed:
            return {
                "status": "NOT SEALED",
                "tone": "neutral",
                "lines": [
                    "no manifest.json: seal the run with `qualify seal DIR` to make it evidence"
                ],
            }
        return {
            "status": "NOT VERIFIED",
            "tone": "neutral",
            "lines": [
                "sealed, but this report was rendered without verifying the bundle; run "
                "`qualify verify DIR --expected-commit SHA`"
            ],
        }
    freshness = result.freshness
    behind = (
        f" ({freshness.commits_behind} commits behind {freshness.main_ref})"
        if freshness.commits_behind
        else ""
    )
    lines = [
        f"freshness {freshness.state}{behind}: {freshness.reason}",
        f"signature {result.signature}; checks {', '.join(result.checks_passed)}",
        f"manifest sha256 {result.manifest_sha256}",
    ]
    manifest = run.source / MANIFEST_NAME
    if manifest.is_file() and sha256_file(manifest) != result.manifest_sha256:
        lines.insert(
            0, "this verification result is for another manifest than the one in this directory"
        )
        return {"status": "INVALID", "tone": "failed", "lines": lines}
    tone = "passed" if freshness.covers_head else "warning"
    return {"status": "VALID", "tone": tone, "freshness": str(freshness.state), "lines": lines}
