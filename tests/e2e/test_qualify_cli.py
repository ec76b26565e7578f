"""`qualify` end to end, as a user runs it: real processes, real timeouts, real process-tree cleanup.

The selftest campaign has one cell per verdict path (pass, unmet expectation, crash, hang that ignores SIGTERM, hung
gloo ranks that left the driver's session, unmet requirement); it runs once per module and each test reads its
evidence.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
GRACE_S = 1.0


def qualify(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "qualification", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def label_of(cell_id: str) -> str:
    # selftest/selftest-<label>-<topology>-w<N>-<fault>-s<seed>
    return cell_id.split("/", 1)[1].removeprefix("selftest-").rsplit("-", 4)[0]


def survivors(session_id: int) -> list[psutil.Process]:
    alive = []
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and session_id in (
                os.getsid(proc.pid),
                os.getpgid(proc.pid),
            ):
                alive.append(proc)
        except (psutil.Error, OSError):
            continue
    return alive


@pytest.fixture(scope="module")
def selftest_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("selftest") / "run"
    proc = qualify(
        "run",
        "selftest",
        "--out",
        str(out),
        "--jobs",
        "2",
        "--grace",
        str(GRACE_S),
        "--no-seal",
        "--no-report",
        timeout=110,
    )
    summary = json.loads((out / "summary.json").read_text())
    cells = {label_of(c["id"]): c for c in summary["cells"]}
    return {"proc": proc, "out": out, "summary": summary, "cells": cells}


@pytest.mark.timeout(120)
def test_campaign_completes_and_exits_1_with_one_line(selftest_run: dict[str, Any]) -> None:
    proc, summary = selftest_run["proc"], selftest_run["summary"]
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("qualify: 4 of 9 cells failed"), proc.stderr
    assert "Traceback" not in proc.stderr
    gpu = selftest_run["cells"]["needs-gpu"]["verdict"] == "passed"
    assert summary["counts"] == {
        "total": 9,
        "passed": 4 + gpu,
        "failed": 4,
        "skipped": 1 - gpu,
        "measured": 0,
    }
    assert summary["verdict"] == "failed"


@pytest.mark.timeout(120)
def test_each_verdict_has_its_precise_reason(selftest_run: dict[str, Any]) -> None:
    cells = selftest_run["cells"]
    assert [cells[k]["verdict"] for k in ("pass", "dist-pass")] == ["passed", "passed"]
    assert cells["dist-pass"]["observed"] == {"all_reduce_sum": 3.0, "ranks_reporting": 2}
    assert cells["fail-expectation"]["verdict"] == "failed"
    assert cells["fail-expectation"]["reason"] == "answer: expected 42, observed 41"
    assert cells["fail-expectation"]["exit_code"] == 0
    assert cells["crash"]["reason"].startswith("crashed: exit code 1")
    assert "crashing on purpose" in (selftest_run["out"] / cells["crash"]["log"]).read_text()
    if cells["needs-gpu"]["verdict"] == "skipped":
        assert cells["needs-gpu"]["reason"].startswith("requires gpu: ")
        assert cells["needs-gpu"]["exit_code"] is None and cells["needs-gpu"]["argv"] == []


@pytest.mark.timeout(120)
def test_hang_is_killed_at_its_timeout_even_when_it_ignores_sigterm(
    selftest_run: dict[str, Any],
) -> None:
    hang = selftest_run["cells"]["hang"]
    assert hang["verdict"] == "failed" and hang["timed_out"] is True
    assert hang["reason"].startswith("timed out after 3 s")
    assert hang["exit_code"] == -9, (
        "SIGTERM is ignored, so only the SIGKILL after the grace period can end it"
    )
    assert 3.0 <= hang["duration_s"] < 3.0 + GRACE_S + 5.0
    assert "ignoring SIGTERM" in (selftest_run["out"] / hang["log"]).read_text()


@pytest.mark.timeout(120)
def test_hung_ranks_outside_the_session_are_swept(selftest_run: dict[str, Any]) -> None:
    cell = selftest_run["cells"]["hang-children"]
    assert cell["verdict"] == "failed" and cell["timed_out"] is True
    cell_dir = selftest_run["out"] / Path(cell["log"]).parent
    ranks = [json.loads((cell_dir / f"rank{r}.pid").read_text()) for r in range(2)]
    for rank in ranks:
        assert rank["sid"] == rank["pid"] != cell["pid"], "the rank left the driver's session"
        assert rank["pid"] in cell["swept_pids"]
        assert (
            not psutil.pid_exists(rank["pid"])
            or psutil.Process(rank["pid"]).status() == psutil.STATUS_ZOMBIE
        )


@pytest.mark.timeout(120)
def test_a_process_left_behind_by_a_passing_cell_is_ended_and_reported(
    selftest_run: dict[str, Any],
) -> None:
    cell = selftest_run["cells"]["leak"]
    leaked = json.loads((selftest_run["out"] / Path(cell["log"]).parent / "leak.pid").read_text())[
        "pid"
    ]
    assert cell["verdict"] == "passed" and not cell["timed_out"]
    assert cell["swept_pids"] == [leaked]
    assert "the engine ended 1 process(es) the cell left running" in cell["reason"]
    assert not psutil.pid_exists(leaked) or psutil.Process(leaked).status() == psutil.STATUS_ZOMBIE


@pytest.mark.timeout(120)
def test_no_process_of_any_cell_survives(selftest_run: dict[str, Any]) -> None:
    for cell in selftest_run["summary"]["cells"]:
        if cell["pid"] is not None:
            assert survivors(cell["pid"]) == [], cell["id"]


@pytest.mark.timeout(120)
def test_run_directory_layout(selftest_run: dict[str, Any]) -> None:
    out, summary = selftest_run["out"], selftest_run["summary"]
    assert (out / "campaign.toml").read_bytes() == (
        REPO / "campaigns" / "selftest.toml"
    ).read_bytes()
    # The failure paths fail by design, so only the claim backed by passing cells holds.
    validated = {c["claim"][:30] for c in summary["boundaries"]["validated"]}
    assert "the cell engine's PASSED verdi" in validated
    reasons = {c["claim"][:12]: c["reason"] for c in summary["boundaries"]["not_validated"]}
    assert reasons["the failure "] == "declared not validated by the campaign"
    assert summary["scope"]["complete"] is True and summary["scope"]["cells_in_campaign"] == 9
    assert summary["invocation"]["jobs"] == 2
    for cell in summary["cells"]:
        assert {
            "id",
            "verdict",
            "reason",
            "duration_s",
            "exit_code",
            "log",
            "argv",
            "started_at",
            "finished_at",
            "cell",
        } <= set(cell)
        if cell["verdict"] == "skipped":
            continue
        cell_dir = out / Path(cell["log"]).parent
        assert json.loads((cell_dir / "cell.json").read_text())["id"] == cell["id"]
        assert cell["argv"][1:4] == ["-m", "qualification.programs.selftest", "--cell"]
        assert cell["started_at"] <= cell["finished_at"]
    passed = selftest_run["cells"]["pass"]
    assert passed["result"] == f"{Path(passed['log']).parent.as_posix()}/result.json"
    assert [e["event"] for e in passed["timeline"]] == ["start", "finish"]


@pytest.mark.timeout(60)
def test_malformed_campaign_exits_2_with_one_line_and_runs_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(
        (REPO / "campaigns" / "selftest.toml")
        .read_text()
        .replace('label = "crash"', 'label = "crash"\ntimeout = 3')
    )
    out = tmp_path / "out"
    proc = qualify("run", str(bad), "--out", str(out))
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(bad) in lines[0] and "timeout" in lines[0] and "unknown key" in lines[0]
    assert not out.exists()


@pytest.mark.timeout(60)
def test_usage_errors_exit_2(tmp_path: Path) -> None:
    unknown = qualify("run", "no-such-campaign", "--out", str(tmp_path / "a"))
    assert unknown.returncode == 2 and len(unknown.stderr.strip().splitlines()) == 1
    assert "no campaign named 'no-such-campaign'" in unknown.stderr
    nothing = qualify("run", "selftest", "--filter", "zzz", "--out", str(tmp_path / "b"))
    assert nothing.returncode == 2 and "matches none" in nothing.stderr
    keyless = qualify("run", "selftest", "--sign", "key", "--out", str(tmp_path / "c"))
    assert keyless.returncode == 2 and "--key" in keyless.stderr
    assert qualify("run", "selftest", "--jobs", "0").returncode == 2
    assert not any((tmp_path / d).exists() for d in "abc")


@pytest.mark.timeout(60)
def test_list_shows_every_campaign_with_its_cell_count() -> None:
    proc = qualify("list")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines()}
    assert "9 cells" in rows["selftest"]
    assert "1 cells" in rows["quickstart"]
    assert {p.stem for p in (REPO / "campaigns").glob("*.toml")} == set(rows)


@pytest.mark.timeout(90)
@pytest.mark.skipif(
    shutil.which("git") is None or not (REPO / ".git").exists(),
    reason="sealing needs a git checkout",
)
def test_run_seals_the_run_directory(tmp_path: Path) -> None:
    out = tmp_path / "sealed"
    proc = qualify(
        "run", "selftest", "--filter", "selftest-pass-*-s0", "--out", str(out), "--no-report"
    )
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    names = {s["name"] for s in manifest["subject"]}
    assert {"summary.json", "campaign.toml"} <= names
    assert any(n.endswith("/log.txt") for n in names) and any(
        n.endswith("/result.json") for n in names
    )
    assert manifest["predicate"]["summary"] == {
        "total": 1,
        "passed": 1,
        "failed": 0,
        "skipped": 0,
        "measured": 0,
    }
    assert manifest["predicate"]["scope"]["filter"] == "selftest-pass-*-s0"
    assert manifest["predicate"]["scope"]["complete"] is False
    # A run directory left unsealed can be sealed later from its summary.
    later = tmp_path / "later"
    assert (
        qualify(
            "run",
            "selftest",
            "--filter",
            "selftest-pass-*-s0",
            "--out",
            str(later),
            "--no-seal",
            "--no-report",
        ).returncode
        == 0
    )
    assert not (later / "manifest.json").exists()
    sealed = qualify("seal", str(later))
    assert sealed.returncode == 0, sealed.stderr
    assert (later / "manifest.json").is_file()


@pytest.mark.timeout(90)
@pytest.mark.skipif(
    shutil.which("git") is None or not (REPO / ".git").exists(),
    reason="sealing needs a git checkout",
)
def test_key_signed_run_verifies_through_qualify(tmp_path: Path) -> None:
    from qualification.evidence.sign import generate_key

    private, public = generate_key(tmp_path / "signing.pem")
    out = tmp_path / "signed"
    proc = qualify(
        "run",
        "selftest",
        "--filter",
        "selftest-pass-*-s0",
        "--out",
        str(out),
        "--no-report",
        "--sign",
        "key",
        "--key",
        str(private),
    )
    assert proc.returncode == 0, proc.stderr
    commit = json.loads((out / "manifest.json").read_text())["predicate"]["source"]["digest"][
        "gitCommit"
    ]
    checked = qualify(
        "verify", str(out), "--expected-commit", commit, "--public-key", str(public), "--json"
    )
    # 0 when sealed from a clean checkout at main's head; 6 (freshness UNKNOWN) from a dirty working tree.
    assert checked.returncode in (0, 6), checked.stderr
    verdict = json.loads(checked.stdout)
    assert (
        verdict["status"] == "VALID"
        and verdict["signature"] != "none"
        and verdict["result"] == "PASSED"
    )
    wrong = qualify("verify", str(out), "--expected-commit", "0" * 40, "--public-key", str(public))
    assert wrong.returncode == 4
    (out / "summary.json").write_text("{}")
    assert (
        qualify(
            "verify", str(out), "--expected-commit", commit, "--public-key", str(public)
        ).returncode
        == 1
    )


@pytest.mark.timeout(90)
@pytest.mark.skipif(
    shutil.which("git") is None or not (REPO / ".git").exists(),
    reason="sealing needs a git checkout",
)
def test_report_verifies_the_bundle_it_renders(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert (
        qualify(
            "run", "selftest", "--filter", "selftest-pass-*-s0", "--out", str(out), "--no-report"
        ).returncode
        == 0
    )
    commit = json.loads((out / "manifest.json").read_text())["predicate"]["source"]["digest"][
        "gitCommit"
    ]
    page = tmp_path / "verified.html"
    proc = qualify("report", str(out), "--out", str(page), "--expected-commit", commit)
    # 0 when sealed from a clean checkout at main's head; 6 (freshness UNKNOWN) from a dirty working tree.
    assert proc.returncode in (0, 6), proc.stderr
    assert "VALID" in page.read_text() and "bundle VALID" in proc.stderr
    # Another commit: the verifier's exit code (4), and the page still written, saying INVALID and why.
    wrong = tmp_path / "wrong.html"
    proc = qualify("report", str(out), "--out", str(wrong), "--expected-commit", "1" * 40)
    assert proc.returncode == 4, proc.stderr
    assert "INVALID" in wrong.read_text() and "1111111111" in wrong.read_text()
    # A bad SHA is a usage error: one line, exit 2, no page.
    bad = tmp_path / "bad.html"
    proc = qualify("report", str(out), "--out", str(bad), "--expected-commit", "abc")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and not bad.exists()
