"""Smoke test of the GEMINI benchmark program: ``--quick`` runs end to end and writes every measurement and ratio.

It asserts no timing thresholds: speed is judged by the benchmark's own output, not by a test.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from qualification.bench._report import MEASUREMENT_KEYS, RATIO_KEYS, TARGETS


@pytest.mark.timeout(180)
def test_quick_run_writes_every_measurement_and_ratio(tmp_path: Path) -> None:
    out = tmp_path / "gemini.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "qualification.bench.gemini",
            "--quick",
            "--out",
            str(out),
            "--scratch",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "gemini"
    assert doc["host"]["cpu_count"] >= 1 and doc["host"]["torch"]
    assert doc["notes"]
    (size,) = doc["sizes"]
    for section, keys in (("measurements", MEASUREMENT_KEYS), ("ratios", RATIO_KEYS)):
        values = size[section]
        assert set(keys) <= set(values), f"{section} lacks {sorted(set(keys) - set(values))}"
        bad = {
            k: values[k]
            for k in keys
            if not (
                isinstance(values[k], int | float) and math.isfinite(values[k]) and values[k] > 0
            )
        }
        assert not bad, f"{section} not positive numbers: {bad}"
    assert set(size["targets"]) == set(size["met"]) == set(TARGETS)
    assert all(isinstance(v, bool) for v in size["met"].values())
    # Recovery restored the lost rank from its peer's memory, bit for bit.
    assert size["checks"]["recovered_bitwise_equal"] is True
    assert size["checks"]["recovery_sources"]["1"] == "peer:0"
    assert size["checks"]["gemini_errors"] == []
    assert (tmp_path / "gemini-raw" / "4mib" / "on.rank1.json").exists()
