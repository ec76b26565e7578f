"""The HTML report, rendered from synthetic run directories and bundles: what it shows, and that it stays inert.

Everything in a run directory is untrusted (a cell program writes its own message, timeline and metrics), so the
report must escape it all, including inside the SVG charts, and must never write into a sealed bundle.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from evidence_support import make_facts, make_payload, make_repo

from qualification.cli import main as qualify_main
from qualification.errors import UsageError
from qualification.evidence import seal_bundle, verify_bundle
from qualification.evidence.freshness import Freshness, FreshnessReport
from qualification.evidence.verify import VerificationResult
from qualification.report import default_output, render
from qualification.report._perf import performance_view

pytestmark = pytest.mark.timeout(60)

RECOVERY_TIMELINE = [
    {"t": 0.0, "event": "start", "detail": "3 ranks"},
    {"t": 12.5, "event": "fault", "detail": "SIGKILL rank 1 at step 4", "rank": 1},
    {"t": 21.5, "event": "detection", "detail": "rank 1 exited with -9"},
    {"t": 30.0, "event": "decision", "detail": "restore step 4"},
    {"t": 31.0, "event": "recovery", "detail": "resumed at step 4"},
    {"t": 35.0, "event": "finish", "detail": "bitwise_equal=True"},
]
MODES = {
    "baseline": {"throughput_steps_s": 100.0, "p50_ms": 10.0, "p95_ms": 12.0, "peak_rss_mib": 900},
    "gemini": {"throughput_steps_s": 98.0, "p50_ms": 10.2, "p95_ms": 12.6, "peak_rss_mib": 950},
    "scout": {"throughput_steps_s": 90.0, "p50_ms": 11.0, "p95_ms": 14.4, "peak_rss_mib": 910},
    "combined": {"throughput_steps_s": 97.0, "p50_ms": 10.5, "p95_ms": 13.0, "peak_rss_mib": 990},
}
THRESHOLDS = {
    mode: {"throughput_pct": -5, "p95_pct": 10} for mode in ("gemini", "scout", "combined")
}


def cell(
    name: str, verdict: str = "passed", *, campaign: str = "synthetic", **result: Any
) -> dict[str, Any]:
    """A summary.json cell record as the engine writes it; ``result`` overrides observed/metrics/timeline/message."""
    cell_id = f"{campaign}/{name}"
    return {
        "id": cell_id,
        "verdict": verdict,
        "reason": "all 1 expectations met" if verdict == "passed" else "broken",
        "duration_s": 35.2,
        "exit_code": 0,
        "timed_out": False,
        "swept_pids": [],
        "pid": 1,
        "argv": ["python"],
        "cwd": ".",
        "log": f"cells/{name}/log.txt",
        "result": f"cells/{name}/result.json",
        "started_at": "2026-08-13T10:01:00.000Z",
        "finished_at": "2026-08-13T10:01:35.200Z",
        "cell": {
            "id": cell_id,
            "program": "lifecycle",
            "workload": "tiny",
            "topology": "ddp",
            "world_size": 3,
            "fault": {"kind": "sigkill", "rank": 1, "step": 4},
            "seed": 0,
            "timeout_s": 60,
            "params": {},
            "expect": {"final_step": 6},
            "requires": [],
        },
        "observed": {"final_step": 6},
        "metrics": {"duration_s": 35.0},
        "timeline": [],
        "message": "ran",
        **result,
    }


def make_run(root: Path, cells: list[dict[str, Any]], *, name: str = "synthetic") -> Path:
    """A `qualify run` directory (unsealed): campaign.toml, summary.json, and each cell's log and result.json."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "campaign.toml").write_text(
        f'name = "{name}"\ntier = "cpu"\ndescription = "synthetic run"\n'
    )
    failed = sum(c["verdict"] == "failed" for c in cells)
    passed = sum(c["verdict"] == "passed" for c in cells)
    summary = {
        "summary_version": 1,
        "campaign": {
            "name": name,
            "tier": "cpu",
            "description": "synthetic run",
            "file": "campaign.toml",
            "source_path": f"campaigns/{name}.toml",
        },
        "boundaries": {"validated": ["recovery after SIGKILL"], "not_validated": ["NCCL & <GPUs>"]},
        "started_at": "2026-08-13T10:00:00.000Z",
        "finished_at": "2026-08-13T10:05:00.000Z",
        "duration_s": 300.0,
        "invocation": {
            "argv": ["qualify", "run", name],
            "cwd": "/src",
            "jobs": 1,
            "filter": None,
            "seed_override": None,
            "grace_s": 5.0,
        },
        "counts": {
            "total": len(cells),
            "passed": passed,
            "failed": failed,
            "skipped": len(cells) - passed - failed,
        },
        "verdict": "failed" if failed else "passed",
        "cells": cells,
    }
    (root / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    for record in cells:
        cell_dir = root / Path(record["log"]).parent
        cell_dir.mkdir(parents=True, exist_ok=True)
        (cell_dir / "log.txt").write_text("log\n")
        (cell_dir / "result.json").write_text(
            json.dumps({k: record.get(k) for k in ("observed", "metrics", "message")})
        )
    return root


def text_of(html: str) -> str:
    """The page's visible-ish text: tags dropped, whitespace collapsed."""
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def test_performance_cell_gets_overhead_and_percentile_charts(tmp_path: Path) -> None:
    perf = cell("healthy-path", metrics={"modes": MODES, "thresholds": THRESHOLDS})
    html = render(make_run(tmp_path / "run", [perf])).read_text()
    assert 'aria-label="overhead against the baseline per mode"' in html
    assert 'aria-label="step latency percentiles per mode"' in html
    assert "No performance cells" not in html
    text = text_of(html)
    # scout: throughput -10 % is below its -5 % floor and p95 +20 % above its +10 % ceiling
    assert "over: throughput -10.0 % beyond -5 %; p95 +20.0 % beyond +10 %" in text
    assert text.count("within thresholds") == 2  # gemini and combined
    assert "p95 14.40 ms" in text
    # summary.json sorts its keys; the report puts the suite's modes back in their natural order
    assert [
        text.index(f" {mode} · throughput") for mode in ("gemini", "scout", "combined")
    ] == sorted(text.index(f" {mode} · throughput") for mode in ("gemini", "scout", "combined"))


def test_performance_view_computes_changes_against_the_baseline() -> None:
    view = performance_view(
        cell("healthy-path", metrics={"modes": MODES, "thresholds": THRESHOLDS})
    )
    rows = {row["mode"]: row for row in view["rows"]}
    assert list(rows) == ["baseline", "gemini", "scout", "combined"]
    assert rows["gemini"]["throughput_change"] == "-2.0" and rows["gemini"]["p95_change"] == "+5.0"
    assert rows["gemini"]["status"] == "passed" and rows["scout"]["status"] == "failed"
    assert rows["baseline"]["verdict"] == "reference"


def test_performance_without_baseline_or_with_junk_values_still_renders() -> None:
    modes = {
        "gemini": {"throughput_steps_s": "fast", "p50_ms": float("nan"), "p95_ms": True},
        "scout": 3,
    }
    view = performance_view(cell("odd", metrics={"modes": modes, "thresholds": {"gemini": "x"}}))
    assert [row["mode"] for row in view["rows"]] == ["gemini"]
    assert (
        view["rows"][0]["verdict"] == "no baseline to compare with"
        and view["rows"][0]["p95"] == "–"
    )
    assert view["overhead_svg"] is None and "not measured" in view["percentile_svg"]


def test_run_without_performance_cells_says_so(tmp_path: Path) -> None:
    html = render(make_run(tmp_path / "run", [cell("plain")])).read_text()
    assert (
        "No performance cells in this run." in html and "<svg" not in html.split("Cell details")[0]
    )


def test_untrusted_text_is_escaped_everywhere_including_svg(tmp_path: Path) -> None:
    evil = "<script>alert(1)</script>"
    hostile = cell(
        "hostile",
        "failed",
        message=evil,
        observed={"final_step": evil},
        timeline=[{"t": 1.0, "event": "fault", "detail": f'"><img src=x onerror=alert(1)>{evil}'}],
        metrics={"modes": {"baseline": MODES["baseline"], f"<b>{evil}": MODES["gemini"]}},
    )
    html = render(make_run(tmp_path / "run", [hostile])).read_text()
    assert "<script" not in html.lower()
    assert "<img" not in html and "<b>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert (
        html.count("&lt;script&gt;") >= 4
    )  # message, observed value, timeline tooltip + table, mode labels


def test_report_is_self_contained(tmp_path: Path) -> None:
    html = render(make_run(tmp_path / "run", [cell("a", timeline=RECOVERY_TIMELINE)])).read_text()
    assert not re.search(r"""(?:src|href)\s*=\s*(?!["']?#)""", html), (
        "every src/href must be a fragment"
    )
    assert "<link" not in html and "@import" not in html and "url(" not in html
    assert "default-src 'none'" in html


def test_summary_of_an_unsealed_run(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", [cell("ok"), cell("bad", "failed")], name="mixed")
    out = render(run)
    assert out == tmp_path / "run.html"
    summary = text_of(out.read_text().split('id="summary"', 1)[1].split("</section>", 1)[0])
    assert "FAILED" in summary and "mixed" in summary
    assert "2 total 1 passed 1 failed 0 skipped" in summary
    assert "NOT SEALED" in summary and "2026-08-13T10:00:00.000Z" in summary
    text = text_of(out.read_text())
    assert "NCCL &amp; &lt;GPUs&gt;" in text  # boundaries from summary.json, escaped
    assert "qualify run mixed" in text  # the invocation stands in for the environment


def test_timeline_shows_the_recovery_phases(tmp_path: Path) -> None:
    html = render(
        make_run(tmp_path / "run", [cell("recover", timeline=RECOVERY_TIMELINE)])
    ).read_text()
    text = text_of(html)
    assert "fault → detection 9.00 s" in text and "detection → decision 8.50 s" in text
    assert "decision → recovery 1.00 s" in text and "fault → recovery 18.50 s" in text
    assert 'aria-label="timeline of fault, detection, decision and recovery"' in html
    assert html.count("<circle") == 4 and 'id="cell-0" open' in html


def test_result_json_fills_in_only_from_inside_the_run(tmp_path: Path) -> None:
    (tmp_path / "secret.json").write_text(json.dumps({"message": "SECRET-CONTENT"}))
    outside, inside = cell("escape", result="../secret.json"), cell("old-summary")
    for record in (outside, inside):
        for key in ("observed", "metrics", "timeline", "message"):
            del record[
                key
            ]  # an older summary without result fields: the loader falls back to result.json
    run = make_run(tmp_path / "run", [outside, inside])
    (run / "cells" / "old-summary" / "result.json").write_text(
        json.dumps({"message": "from result.json"})
    )
    html = render(run).read_text()
    assert "SECRET-CONTENT" not in html and "from result.json" in html


def test_not_a_run_directory_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="neither summary.json nor manifest.json"):
        render(tmp_path)
    with pytest.raises(UsageError, match="not a directory"):
        render(tmp_path / "missing")


@pytest.fixture
def sealed_run(tmp_path: Path) -> tuple[Path, Path, str]:
    """A `qualify run`-shaped directory (summary + cells) sealed at the head of main: (bundle, repo, commit)."""
    repo, commit = make_repo(tmp_path)
    bundle = make_payload(tmp_path)
    make_run(bundle, [cell("ok", timeline=RECOVERY_TIMELINE)], name="quick")
    seal_bundle(bundle, make_facts(repo), repo=repo)
    return bundle, repo, commit


def test_sealed_bundle_shows_commit_and_verification_and_stays_valid(
    sealed_run: tuple[Path, Path, str],
) -> None:
    bundle, repo, commit = sealed_run
    verification = verify_bundle(bundle, expected_commit=commit, repo=repo)
    out = render(bundle, verification=verification)
    assert out == default_output(bundle) and not out.is_relative_to(bundle)
    summary = text_of(out.read_text().split('id="summary"', 1)[1].split("</section>", 1)[0])
    assert "PASSED" in summary and "quick" in summary
    assert commit in summary and commit[:12] in summary and "clean" in summary
    assert "VALID" in summary and "CURRENT" in summary
    text = text_of(out.read_text())
    assert "two-rank gloo recovery" in text  # boundaries come from the manifest when sealed
    assert "world size 2" in text and "gemscout" in text
    verify_bundle(bundle, expected_commit=commit, repo=repo)  # rendering left the bundle intact


def test_report_refuses_to_write_into_a_sealed_bundle(sealed_run: tuple[Path, Path, str]) -> None:
    bundle, _, _ = sealed_run
    with pytest.raises(UsageError, match="inside the sealed bundle"):
        render(bundle, bundle / "report.html")


def test_invalid_and_mismatched_verifications_show_invalid(
    sealed_run: tuple[Path, Path, str],
) -> None:
    bundle, _, commit = sealed_run
    html = render(
        bundle, verification_error="files: sha256 differs for cells/ok/log.txt"
    ).read_text()
    assert "INVALID" in html and "sha256 differs for cells/ok/log.txt" in html
    other = VerificationResult(
        commit=commit,
        result="PASSED",
        signature="none",
        checks_passed=("intake",),
        manifest_sha256="0" * 64,
        freshness=FreshnessReport(
            state=Freshness.STALE,
            commits_behind=2,
            main_ref="main",
            main_head=None,
            reason="behind",
        ),
        exit_code=3,
        message="stale",
    )
    assert "for another manifest" in render(bundle, verification=other).read_text()


def test_bundle_sealed_from_facts_lists_its_commands(tmp_path: Path) -> None:
    repo, commit = make_repo(tmp_path)
    bundle = make_payload(tmp_path)
    seal_bundle(bundle, make_facts(repo, exit_codes=(0, 1), failed=1), repo=repo)
    text = text_of(render(bundle).read_text())
    assert "FAILED" in text and "NOT VERIFIED" in text
    assert "exit code 1: python -m pytest tests/dist" in text


def test_qualify_report_command_renders_beside_the_directory(
    sealed_run: tuple[Path, Path, str],
) -> None:
    bundle, _, _ = sealed_run
    assert qualify_main(["report", str(bundle)]) == 0
    assert (bundle.parent / f"{bundle.name}.html").is_file()
    (bundle / "summary.json").unlink()  # a bundle sealed from facts has only its manifest
    out = bundle.parent / "facts.html"
    assert qualify_main(["report", str(bundle), "--out", str(out)]) == 0 and out.is_file()


def test_phases_are_measured_from_the_events_they_name(tmp_path: Path) -> None:
    # A lifecycle cell: the fault fires inside the launch at a moment no event records, so no "fault →" phase may be
    # shown; a node loss recorded after detection must not become a negative "fault → detection".
    timeline = [
        {"t": 0.0, "event": "start", "detail": "baseline"},
        {"t": 5.0, "event": "launch", "detail": "faulted run launched"},
        {"t": 20.0, "event": "detection", "detail": "launcher saw rank 1 exit"},
        {"t": 20.5, "event": "fault", "detail": "node 1 lost (recorded late)"},
        {"t": 23.0, "event": "relaunch", "detail": "3 ranks"},
        {"t": 28.0, "event": "decision", "detail": "restore step 4"},
        {"t": 29.0, "event": "recovery", "detail": "resumed at step 4"},
    ]
    text = text_of(
        render(make_run(tmp_path / "run", [cell("recover", timeline=timeline)])).read_text()
    )
    assert "detection → relaunch 3.00 s" in text and "relaunch → decision 5.00 s" in text
    assert "detection → recovery 9.00 s" in text
    assert "fault → detection" not in text and "-0.50 s" not in text
