"""The HTML report in a real browser: headless Chromium opens it from disk, with no network, and shows the summary.

Needs Debian's ``chromium`` package on PATH (CI installs it); skipped, saying so, where it is missing. The run
directory is synthetic so the test takes seconds; the report is the thing under test, not the engine.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from qualification.report import render

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(
        shutil.which("chromium") is None,
        reason="chromium is not on PATH (Debian: apt-get install -y chromium)",
    ),
]

BROWSER_TIMEOUT_S = 60
WIDTH, HEIGHT = 1280, 1600
PASSED_GREEN = (0x1A, 0x7F, 0x37)
"""The summary banner's fill for a PASSED run (``--ok`` in the template)."""


def make_run(root: Path) -> Path:
    """An unsealed run with one passing recovery cell, as `qualify run --no-seal` would leave it."""
    cell_id = "browser-check/lifecycle-ddp-w3-sigkill-rank1-step4-s0"
    timeline = [
        {"t": 1.0, "event": "fault", "detail": "SIGKILL rank 1", "rank": 1},
        {"t": 3.0, "event": "detection", "detail": "rank 1 exited"},
        {"t": 4.0, "event": "decision", "detail": "restore step 4"},
        {"t": 5.0, "event": "recovery", "detail": "resumed"},
    ]
    summary = {
        "summary_version": 1,
        "campaign": {
            "name": "browser-check",
            "tier": "cpu",
            "description": "report rendering check",
            "file": "campaign.toml",
            "source_path": "campaigns/browser-check.toml",
        },
        "boundaries": {"validated": ["the report renders"], "not_validated": ["anything else"]},
        "started_at": "2026-08-13T10:00:00.000Z",
        "finished_at": "2026-08-13T10:00:06.000Z",
        "duration_s": 6.0,
        "invocation": {"argv": ["qualify", "run", "browser-check"], "cwd": "."},
        "counts": {"total": 1, "passed": 1, "failed": 0, "skipped": 0},
        "verdict": "passed",
        "cells": [
            {
                "id": cell_id,
                "verdict": "passed",
                "reason": "all 1 expectations met",
                "duration_s": 6.0,
                "exit_code": 0,
                "timed_out": False,
                "swept_pids": [],
                "log": "cells/c/log.txt",
                "result": None,
                "cell": {
                    "id": cell_id,
                    "topology": "ddp",
                    "world_size": 3,
                    "seed": 0,
                    "fault": {"kind": "sigkill", "rank": 1, "step": 4},
                    "expect": {"final_step": 6},
                },
                "observed": {"final_step": 6},
                "metrics": {},
                "timeline": timeline,
                "message": "<script>document.title='owned'</script>",
            }
        ],
    }
    root.mkdir()
    (root / "campaign.toml").write_text('name = "browser-check"\ntier = "cpu"\n')
    (root / "summary.json").write_text(json.dumps(summary))
    return root


def chromium(profile: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    """Headless Chromium with everything that could reach the network or a profile switched off."""
    command = [
        "chromium",
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        *args,
    ]
    return subprocess.run(command, capture_output=True, timeout=BROWSER_TIMEOUT_S, check=False)


def png_rows(data: bytes, rows: int) -> tuple[int, int, list[bytes]]:
    """Width, height and the first ``rows`` unfiltered scanlines (RGB) of an 8-bit RGB/RGBA, non-interlaced PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    offset, idat, header = 8, bytearray(), b""
    while offset < len(data):
        (length,), kind = (
            struct.unpack(">I", data[offset : offset + 4]),
            data[offset + 4 : offset + 8],
        )
        body = data[offset + 8 : offset + 8 + length]
        header = body if kind == b"IHDR" else header
        idat += body if kind == b"IDAT" else b""
        offset += 12 + length
    width, height, depth, colour_type, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert depth == 8 and colour_type in (2, 6) and interlace == 0, (depth, colour_type, interlace)
    channels = 3 if colour_type == 2 else 4
    stride = width * channels
    raw, previous, out = zlib.decompress(bytes(idat)), bytearray(stride), []
    for row in range(min(rows, height)):
        start = row * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up, up_left = previous[i], previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif kind == 4:
                p = left + up - up_left
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - up_left)
                line[i] = (
                    line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else up_left)
                ) & 0xFF
        out.append(bytes(b for i, b in enumerate(line) if i % channels < 3))
        previous = line
    return width, height, out


def _verified_current() -> object:
    """What the verifier returns for a valid, CURRENT, complete PASSED bundle: the only state that reads green."""
    from qualification.evidence.freshness import Freshness, FreshnessReport
    from qualification.evidence.verify import VerificationResult

    return VerificationResult(
        commit="a" * 40,
        result="PASSED",
        signature="none",
        checks_passed=("intake", "schema", "files"),
        manifest_sha256="0" * 64,
        exit_code=0,
        message="valid, PASSED and CURRENT",
        freshness=FreshnessReport(
            state=Freshness.CURRENT,
            commits_behind=0,
            main_ref="main",
            main_head="a" * 40,
            reason="head of main",
        ),
        scope={
            "complete": True,
            "cellsInCampaign": 1,
            "campaignCellsRun": 1,
            "cellsRun": 1,
            "filter": None,
            "seedOverride": None,
        },
    )


def _green_pixels(shot: Path) -> int:
    width, height, rows = png_rows(shot.read_bytes(), rows=300)
    assert (width, height) == (WIDTH, HEIGHT)
    return sum(
        all(abs(row[i + c] - PASSED_GREEN[c]) <= 3 for c in range(3))
        for row in rows
        for i in range(0, len(row), 3)
    )


def test_chromium_never_shows_an_unverified_run_in_green(tmp_path: Path) -> None:
    # Not sealed, so not evidence: the banner says NOT SEALED in grey, whatever the cells say.
    report = render(make_run(tmp_path / "run"))
    shot = tmp_path / "unverified.png"
    done = chromium(
        tmp_path / "profile-grey",
        f"--screenshot={shot}",
        f"--window-size={WIDTH},{HEIGHT}",
        report.resolve().as_uri(),
    )
    assert shot.is_file(), (
        f"no screenshot (exit {done.returncode}): {done.stderr.decode(errors='replace')[-2000:]}"
    )
    assert _green_pixels(shot) < 2_000, "an unverified run must not read as a green PASSED"
    assert '<span class="result">NOT SEALED</span>' in report.read_text()


def test_chromium_shows_the_summary(tmp_path: Path) -> None:
    report = render(make_run(tmp_path / "run"), verification=_verified_current())  # type: ignore[arg-type]
    assert report == tmp_path / "run.html"
    url = report.resolve().as_uri()

    shot = tmp_path / "report.png"
    done = chromium(
        tmp_path / "profile-shot", f"--screenshot={shot}", f"--window-size={WIDTH},{HEIGHT}", url
    )
    assert shot.is_file(), (
        f"no screenshot (exit {done.returncode}): {done.stderr.decode(errors='replace')[-2000:]}"
    )
    assert shot.stat().st_size > 20_000, "a blank page compresses to almost nothing"
    # The summary banner sits in the first 300 px and is filled with the PASSED green (valid, CURRENT, complete).
    green = _green_pixels(shot)
    assert green > 20_000, f"only {green} pixels of the PASSED banner colour near the top"

    done = chromium(tmp_path / "profile-dom", "--dump-dom", url)
    dom = done.stdout.decode()
    assert done.returncode == 0 and dom, done.stderr.decode(errors="replace")[-2000:]
    summary = re.search(r'<section id="summary".*?</section>', dom, re.S)
    assert summary is not None, "no #summary block in the rendered DOM"
    assert "PASSED" in summary.group() and "browser-check" in summary.group()
    # The script in the cell message is text, not code: the title is the report's own.
    assert "owned" not in re.search(r"<title>(.*?)</title>", dom, re.S).group(1)  # type: ignore[union-attr]
    assert "&lt;script&gt;document.title" in dom
