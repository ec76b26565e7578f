"""scripts/regenerate_evidence.sh: refuses what would make committed evidence describe another tree, and (heavy) makes
it end to end from a clean clone.

The refusals run the real script in a throwaway git repository that holds a copy of it (the script works on the
checkout it lives in), so they cost well under a second and touch nothing here. The end-to-end case clones this
repository at HEAD, runs the script there for the quickstart campaign and checks what it wrote: a bundle under
docs/evidence/ that verifies against that commit, and docs/validation.md naming it. It runs a real campaign (about a
minute on 2 busy cores), so it is behind GEMSCOUT_HEAVY_TESTS=1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "regenerate_evidence.sh"


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(repo), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={
            **os.environ,
            "GIT_AUTHOR_NAME": "t",
            "GIT_AUTHOR_EMAIL": "t@example.invalid",
            "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@example.invalid",
        },
    )
    return done.stdout.strip()


def _run(script: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "PYTHON": sys.executable},
    )


@pytest.fixture
def toy(tmp_path: Path) -> Path:
    """A committed checkout holding the script and one campaign file; two commits, so HEAD~1 exists."""
    repo = tmp_path / "toy"
    (repo / "scripts").mkdir(parents=True)
    (repo / "campaigns").mkdir()
    shutil.copy(SCRIPT, repo / "scripts" / SCRIPT.name)
    (repo / "campaigns" / "demo.toml").write_text('name = "demo"\n')
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "one")
    (repo / "README.md").write_text("toy\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "two")
    return repo


@pytest.mark.timeout(60)
def test_refusals_exit_2_with_one_line_and_write_nothing(toy: Path) -> None:
    script = toy / "scripts" / SCRIPT.name
    cases = {
        (): "usage: scripts/regenerate_evidence.sh",
        ("nosuch",): "unknown campaign nosuch: no campaigns/nosuch.toml",
        ("--commit", _git(toy, "rev-parse", "HEAD~1"), "demo"): "check out",
    }
    for args, said in cases.items():
        done = _run(script, *args)
        assert done.returncode == 2, (args, done.stderr)
        assert said in done.stderr and len(done.stderr.strip().splitlines()) == 1, (
            args,
            done.stderr,
        )
    (toy / "README.md").write_text(
        "edited\n"
    )  # a dirty checkout: the docs written there would not be evidence-only
    done = _run(script, "demo")
    assert done.returncode == 2 and "uncommitted changes" in done.stderr, done.stderr
    assert not (toy / "docs").exists()


@pytest.mark.timeout(600)
@pytest.mark.skipif(
    not os.environ.get("GEMSCOUT_HEAVY_TESTS"),
    reason="runs the quickstart campaign from a clean clone; `make evidence` does the same, or set "
    "GEMSCOUT_HEAVY_TESTS=1",
)
def test_quickstart_evidence_from_a_clean_clone(tmp_path: Path) -> None:
    clone = tmp_path / "checkout"
    subprocess.run(
        ["git", "clone", "-q", "--no-hardlinks", str(REPO), str(clone)], check=True, timeout=120
    )
    commit = _git(clone, "rev-parse", "HEAD")
    done = _run(clone / "scripts" / SCRIPT.name, "quickstart", timeout=560)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    bundle = clone / "docs" / "evidence" / "quickstart"
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["predicate"]["source"]["digest"]["gitCommit"] == commit
    assert manifest["predicate"]["source"]["dirty"] is False
    verified = subprocess.run(
        [
            sys.executable,
            "-m",
            "qualification",
            "verify",
            str(bundle),
            "--expected-commit",
            commit,
            "--main-ref",
            "HEAD",
            "--require-complete",
        ],
        cwd=clone,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": f"{clone / 'src'}{os.pathsep}{clone}"},
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert f"Commit: `{commit}`." in (clone / "docs" / "validation.md").read_text()
    # The only changes are the evidence: what `git diff --stat <commit> <commit+1>` would show once committed.
    paths = [
        *_git(clone, "diff", "--name-only").splitlines(),
        *_git(clone, "ls-files", "--others", "--exclude-standard").splitlines(),
    ]
    outside = [
        p
        for p in paths
        if not p.startswith("docs/evidence/") and p not in ("docs/validation.md", "README.md")
    ]
    assert paths and outside == [], outside
