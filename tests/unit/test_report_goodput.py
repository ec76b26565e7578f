"""The goodput benchmark's section of the HTML report: a row and two bars per arm, a skipped arm named with its
reason, and run-supplied text escaped (the cell and run records are the report tests' own builders)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_report import cell, make_run, text_of

from qualification.report import render
from qualification.report._goodput import goodput_view

pytestmark = pytest.mark.timeout(60)

ARMS = [
    {"arm": "gemscout", "wall_s": 29.4, "goodput": 0.124, "wasted_per_failure_s": 6.29,
     "resume_steps": [14, 29, 44], "bitwise_equal_to_ideal": True, "step_s": 0.0821,
     "relaunch_s": [3.03, 7.83, 6.23]},
    {"arm": "dcp", "wall_s": 28.6, "goodput": 0.128, "wasted_per_failure_s": 5.99,
     "resume_steps": [7, 28, 42], "bitwise_equal_to_ideal": True},
    {"arm": "torchft", "wall_s": 20.0, "goodput": 0.15, "wasted_per_failure_s": 2.5,
     "resume_steps": [], "bitwise_equal_to_ideal": False},
]  # fmt: skip


def test_goodput_cell_gets_a_table_and_two_charts(tmp_path: Path) -> None:
    gp = cell("goodput", metrics={"benchmark": "goodput", "arms": ARMS, "skipped": {}})
    html = render(make_run(tmp_path / "run", [gp])).read_text()
    assert 'aria-label="goodput per arm (useful step time over wall time)"' in html
    assert 'aria-label="wasted time per failure per arm"' in html
    text = text_of(html)
    assert "Goodput under failures" in text
    assert "gemscout 29.4 0.124 6.29 82.1 3.0, 7.8, 6.2 14, 29, 44 yes" in text
    assert "torchft 20.0 0.150 2.50 – – – no" in text


def test_a_skipped_arm_is_named_with_its_reason_and_text_is_escaped() -> None:
    view = goodput_view(
        cell(
            "goodput",
            metrics={
                "arms": [{**ARMS[0], "arm": "<b>x</b>"}],
                "skipped": {"torchft": "not installed"},
            },
        )
    )
    assert view["skipped"] == {"torchft": "not installed"}
    assert "<b>x</b>" not in view["goodput_svg"] and "&lt;b&gt;x&lt;/b&gt;" in view["goodput_svg"]


def test_a_run_without_a_goodput_cell_has_no_goodput_section(tmp_path: Path) -> None:
    html = render(make_run(tmp_path / "run", [cell("plain")])).read_text()
    assert "Goodput under failures" not in html
