"""``validation-evidence`` end to end, as a user runs it: the console script and scripts/validation_evidence.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)
REPO_ROOT = Path(__file__).resolve().parents[2]
_CONSOLE = Path(sys.executable).parent / "validation-evidence"
ENTRIES = {
    # After `pip install -e .` the console script exists; otherwise run the same main() as a module.
    "console-script": [str(_CONSOLE)]
    if _CONSOLE.exists()
    else [sys.executable, "-m", "qualification.evidence.cli"],
    "scripts-wrapper": [sys.executable, str(REPO_ROOT / "scripts" / "validation_evidence.py")],
}
# A GIT_DIR inherited from a git hook would aim every command at the wrong repository.
_ENV = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
_IDENTITY = (
    "-c",
    "user.name=E2E",
    "-c",
    "user.email=e2e@test.invalid",
    "-c",
    "commit.gpgsign=false",
)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *_IDENTITY, "-C", str(repo), *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
        env=_ENV,
    ).stdout.strip()


def _cli(entry: str, *args: object, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    command = [*ENTRIES[entry], *(str(a) for a in args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=50, cwd=cwd)


def _assert_one_line_error(
    done: subprocess.CompletedProcess[str], exit_code: int, fragment: str
) -> None:
    assert done.returncode == exit_code, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("validation-evidence: error: "), done.stderr
    assert fragment in lines[0]
    assert "Traceback" not in done.stderr + done.stdout


@pytest.fixture
def workspace(tmp_path: Path) -> dict[str, Path | str]:
    """A repo at one commit on main, a payload with one log, and the run facts as JSON."""
    repo = tmp_path / "repo"
    (repo / "campaigns").mkdir(parents=True)
    _git(repo, "init", "-q", "-b", "main")
    (repo / "campaigns" / "quick.toml").write_text('name = "quick"\ntier = "cpu"\n')
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "campaign")
    bundle = tmp_path / "bundle"
    (bundle / "logs").mkdir(parents=True)
    (bundle / "logs" / "000-unit.log").write_text("2 passed\n")
    facts = tmp_path / "facts.json"
    facts.write_text(
        json.dumps(
            {
                "campaign": {"path": str(repo / "campaigns" / "quick.toml")},
                "startedOn": "2026-08-13T10:00:00Z",
                "finishedOn": "2026-08-13T10:05:00Z",
                "trigger": "workflow_dispatch",
                "runner": "self-hosted",
                "runUrl": "https://github.com/org/gemscout/actions/runs/1",
                "summary": {"total": 2, "passed": 2, "failed": 0, "skipped": 0},
                "topology": {
                    "hosts": 1,
                    "worldSize": 2,
                    "backends": ["gloo"],
                    "devices": ["cpu", "cpu"],
                },
                "boundaries": {"validated": ["two-rank gloo"], "notValidated": ["NCCL", "RDMA"]},
                "commands": [
                    {
                        "id": "000-unit",
                        "argv": ["python", "-m", "pytest", "tests/unit"],
                        "cwd": ".",
                        "startedOn": "2026-08-13T10:01:00Z",
                        "finishedOn": "2026-08-13T10:02:00Z",
                        "exitCode": 0,
                        "log": "logs/000-unit.log",
                    }
                ],
            }
        )
    )
    return {
        "repo": repo,
        "bundle": bundle,
        "facts": facts,
        "key": tmp_path / "key.pem",
        "commit": _git(repo, "rev-parse", "HEAD"),
    }


def _seal_signed(entry: str, ws: dict, *extra: object) -> None:
    assert _cli(entry, "keygen", ws["key"]).returncode == 0
    done = _cli(
        entry, "seal", ws["bundle"], "--facts", ws["facts"], "--campaign", ws["repo"] / "campaigns" / "quick.toml",
        "--repo", ws["repo"], "--sign", "key", "--key", ws["key"], *extra,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "result PASSED" in done.stdout


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_seal_then_verify_is_current(entry: str, workspace: dict) -> None:
    ws = workspace
    archive = ws["bundle"].parent / "bundle.tar.gz"
    _seal_signed(entry, ws, "--archive", archive)
    public = f"{ws['key']}.pub"
    for target in (ws["bundle"], archive):
        done = _cli(
            entry,
            "verify",
            target,
            "--expected-commit",
            ws["commit"],
            "--repo",
            ws["repo"],
            "--public-key",
            public,
            "--json",
        )
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert (
            report["status"] == "VALID"
            and report["freshness"] == "CURRENT"
            and report["signature"] == "key"
        )
        assert report["checks_passed"] == [
            "intake",
            "signature",
            "schema",
            "files",
            "consistency",
            "commit",
        ]
    human = _cli(
        entry,
        "verify",
        ws["bundle"],
        "--expected-commit",
        ws["commit"],
        "--repo",
        ws["repo"],
        "--public-key",
        public,
    )
    assert human.returncode == 0 and human.stdout.startswith("VALID: valid, PASSED and CURRENT")


def test_stale_exits_3_and_allow_stale_exits_0(workspace: dict) -> None:
    ws = workspace
    _seal_signed("console-script", ws)
    (ws["repo"] / "next.txt").write_text("next\n")
    _git(ws["repo"], "add", "next.txt")
    _git(ws["repo"], "commit", "-q", "-m", "next")
    args = (
        "verify",
        ws["bundle"],
        "--expected-commit",
        ws["commit"],
        "--repo",
        ws["repo"],
        "--public-key",
        f"{ws['key']}.pub",
    )
    stale = _cli("console-script", *args, "--json")
    assert stale.returncode == 3
    assert (json.loads(stale.stdout)["freshness"], json.loads(stale.stdout)["commits_behind"]) == (
        "STALE",
        1,
    )
    assert _cli("console-script", *args, "--allow-stale").returncode == 0


def test_verify_runs_from_inside_the_clone_by_default(workspace: dict) -> None:
    ws = workspace
    _seal_signed("scripts-wrapper", ws)
    done = _cli(
        "scripts-wrapper", "verify", ws["bundle"], "--expected-commit", ws["commit"], "--public-key", f"{ws['key']}.pub",
        cwd=ws["repo"],
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("tamper", "exit_code", "fragment"),
    [
        ("payload", 1, "files: 'logs/000-unit.log' does not match its sha256"),
        ("wrong-key", 5, "signature: made by another key"),
        ("wrong-commit", 4, "commit: bundle was made from"),
        ("malformed-manifest", 1, "intake: manifest.json is not valid JSON"),
    ],
)
def test_rejections_are_one_line_with_their_exit_code(
    workspace: dict, tamper: str, exit_code: int, fragment: str
) -> None:
    ws = workspace
    _seal_signed("console-script", ws)
    public, expected = f"{ws['key']}.pub", ws["commit"]
    if tamper == "payload":
        (ws["bundle"] / "logs" / "000-unit.log").write_text("2 failed\n")
    elif tamper == "wrong-key":
        other = ws["bundle"].parent / "other.pem"
        _cli("console-script", "keygen", other)
        public = f"{other}.pub"
    elif tamper == "wrong-commit":
        expected = "f" * 40
    else:
        (ws["bundle"] / "manifest.json").write_text("{ not json")
    done = _cli(
        "console-script",
        "verify",
        ws["bundle"],
        "--expected-commit",
        expected,
        "--repo",
        ws["repo"],
        "--public-key",
        public,
    )
    _assert_one_line_error(done, exit_code, fragment)


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_bad_input_is_one_line_usage_error(entry: str, tmp_path: Path) -> None:
    missing = _cli(entry, "verify", tmp_path / "no-such-bundle", "--expected-commit", "a" * 40)
    _assert_one_line_error(missing, 2, "does not exist")
    bundle = tmp_path / "b"
    bundle.mkdir()
    short = _cli(entry, "verify", bundle, "--expected-commit", "abc1234")
    _assert_one_line_error(short, 2, "full 40-hex commit SHA, got 'abc1234'")
    _assert_one_line_error(
        _cli(entry, "verify", bundle, "--expected-commit", "a" * 40, "--frobnicate"),
        2,
        "--frobnicate",
    )
    _assert_one_line_error(_cli(entry), 2, "required")
    _assert_one_line_error(
        _cli(entry, "seal", bundle, "--facts", tmp_path / "absent.json"),
        2,
        "cannot read facts file",
    )


def test_json_mode_reports_errors_as_json_too(tmp_path: Path) -> None:
    done = _cli("console-script", "verify", tmp_path, "--expected-commit", "abc", "--json")
    assert done.returncode == 2
    assert json.loads(done.stdout) == {
        "status": "ERROR",
        "exit_code": 2,
        "message": done.stderr.split("error: ", 1)[1].strip(),
    }


def test_help_documents_every_subcommand() -> None:
    done = _cli("console-script", "--help")
    assert done.returncode == 0
    for command in ("seal", "sign", "verify", "keygen"):
        assert command in done.stdout
