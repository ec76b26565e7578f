"""scripts/render_validation_doc.py end to end: real git repos, bundles sealed with the evidence API, the script run
as a user runs it. The page must say exactly what the verified evidence supports, and a tampered bundle writes none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from qualification.evidence import (
    Boundaries,
    CampaignRef,
    CommandRecord,
    SealInput,
    Signer,
    Summary,
    Topology,
    generate_key,
    make_signer,
    seal_bundle,
)

pytestmark = pytest.mark.timeout(60)
REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "render_validation_doc.py"
T0 = datetime(2026, 8, 13, 10, 0, tzinfo=UTC)
# A GIT_DIR inherited from a git hook would aim every command at the wrong repository.
_ENV = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
_IDENTITY = (
    "-c",
    "user.name=Doc Test",
    "-c",
    "user.email=doc@test.invalid",
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


def _repo(root: Path) -> tuple[Path, str]:
    repo = root / "repo"
    (repo / "campaigns").mkdir(parents=True)
    _git(repo, "init", "-q", "-b", "main")
    (repo / "campaigns" / "demo.toml").write_text('name = "demo"\ntier = "cpu"\n')
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "campaign")
    return repo, _git(repo, "rev-parse", "HEAD")


def _cell(
    label: str,
    verdict: str,
    observed: dict[str, Any] | None,
    expect: dict[str, Any],
    reason: str = "",
) -> dict[str, Any]:
    cell_id = f"demo/lifecycle-{label}-ddp-w3-s0"
    ran = verdict != "skipped"
    return {
        "id": cell_id,
        "verdict": verdict,
        "reason": reason,
        "observed": observed,
        "exit_code": 0 if ran else None,
        "log": f"cells/{label}/log.txt" if ran else None,
        "cell": {"id": cell_id, "expect": expect},
    }


def _bundle(
    root: Path,
    repo: Path,
    cells: list[dict[str, Any]],
    name: str = "bundle",
    signer: Signer | None = None,
) -> Path:
    """A sealed bundle shaped like `qualify run` output: summary.json, one log per cell that ran."""
    bundle = root / name
    bundle.mkdir()
    commands = []
    for i, cell in enumerate(c for c in cells if c["log"]):
        (bundle / cell["log"]).parent.mkdir(parents=True)
        (bundle / cell["log"]).write_text(f"{cell['id']}\n")
        commands.append(
            CommandRecord(
                id=cell["id"],
                argv=("python", "-m", "qualification.programs.lifecycle"),
                cwd=".",
                started_on=T0 + timedelta(seconds=10 * i + 1),
                finished_on=T0 + timedelta(seconds=10 * i + 9),
                exit_code=cell["exit_code"],
                log=cell["log"],
            )
        )
    counts = {v: sum(c["verdict"] == v for c in cells) for v in ("passed", "failed", "skipped")}
    summary = {
        "summary_version": 1,
        "campaign": {"name": "demo", "tier": "cpu"},
        "counts": {"total": len(cells), **counts},
        "cells": cells,
    }
    (bundle / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    facts = SealInput(
        campaign=CampaignRef(name="demo", tier="cpu", path=repo / "campaigns" / "demo.toml"),
        commands=tuple(commands),
        summary=Summary(total=len(cells), **counts),
        topology=Topology(hosts=1, world_size=3, backends=("gloo",), devices=("cpu",)),
        boundaries=Boundaries(
            validated=("recovery of rank 1 from its peer",), not_validated=("NCCL | RDMA",)
        ),
        started_on=T0,
        finished_on=T0 + timedelta(minutes=5),
    )
    seal_bundle(bundle, facts, repo=repo, signer=signer)
    return bundle


PASSING = [
    _cell(
        "kill",
        "passed",
        {"recovered_step": 4, "bitwise_equal": True, "decision": {"mode": "restore"}},
        {"recovered_step": 4, "bitwise_equal": True},
    )
]


def _render(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *(str(a) for a in args)],
        capture_output=True,
        text=True,
        timeout=50,
        env=_ENV,
    )


def test_a_current_bundle_renders_a_current_page(tmp_path: Path) -> None:
    repo, commit = _repo(tmp_path)
    bundle = _bundle(tmp_path, repo, PASSING)
    page = tmp_path / "validation.md"
    done = _render(
        bundle, "--repo", repo, "--expected-commit", commit, "--out", page, "--require-current"
    )
    assert done.returncode == 0, done.stderr
    text = page.read_text()
    assert "**Status: current qualification.**" in text
    assert f"Commit: `{commit}`." in text and "Date: 2026-08-13 UTC" in text
    assert "Campaigns: demo." in text
    assert f"current qualification: commit {commit[:12]} is the head of main" in text
    assert (
        "| `demo/lifecycle-kill-ddp-w3-s0` | PASSED | bitwise_equal=true; recovered_step=4 |"
        in text
    )
    assert "- recovery of rank 1 from its peer" in text and "- NCCL \\| RDMA" in text
    assert "- topology: 1 host(s), world size 3, backends gloo, devices cpu" in text
    assert "Historical evidence" not in text
    # The same bundle renders the same bytes: the page has no generation timestamp to churn.
    again = tmp_path / "again.md"
    assert (
        _render(bundle, "--repo", repo, "--expected-commit", commit, "--out", again).returncode == 0
    )
    assert again.read_bytes() == page.read_bytes()


def test_a_bundle_of_an_older_commit_is_historical(tmp_path: Path) -> None:
    repo, old = _repo(tmp_path)
    bundle = _bundle(tmp_path, repo, PASSING)
    (repo / "more.txt").write_text("more\n")
    _git(repo, "add", "more.txt")
    _git(repo, "commit", "-q", "-m", "more")
    head = _git(repo, "rev-parse", "HEAD")
    page = tmp_path / "validation.md"
    done = _render(
        bundle, "--repo", repo, "--out", page
    )  # --expected-commit defaults to HEAD of --repo
    assert done.returncode == 0, done.stderr
    text = page.read_text()
    assert f"Commit: `{head}`." in text and "**Status: not current qualification.**" in text
    assert "## Historical evidence" in text
    assert f"historical: evidence for commit {old[:12]}, 1 commit(s) behind main" in text
    assert "No bundle for this commit was given." in text
    refused = _render(bundle, "--repo", repo, "--out", tmp_path / "strict.md", "--require-current")
    assert refused.returncode == 6 and not (tmp_path / "strict.md").exists()


def test_a_bundle_followed_only_by_evidence_commits_is_current(tmp_path: Path) -> None:
    # docs/evidence/ is committed in the commit after the one it was sealed at: the page for that next commit (the
    # head of main) is still current qualification, and says from which commit the evidence comes.
    repo, sealed_at = _repo(tmp_path)
    bundle = _bundle(tmp_path, repo, PASSING)
    (repo / "docs" / "evidence" / "demo").mkdir(parents=True)
    (repo / "docs" / "evidence" / "demo" / "summary.json").write_text("{}\n")
    (repo / "docs" / "validation.md").write_text("# Validation\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "evidence")
    head = _git(repo, "rev-parse", "HEAD")
    page = tmp_path / "validation.md"
    done = _render(bundle, "--repo", repo, "--out", page, "--require-current")
    assert done.returncode == 0, done.stderr
    text = page.read_text()
    assert f"Commit: `{head}`." in text and "**Status: current qualification.**" in text
    assert (
        f"was run at `{sealed_at[:12]}`, from which `{head[:12]}`, the head of main, differs only in "
        "evidence files" in text
    )
    assert (
        f"current qualification: main is 1 commit(s) past commit {sealed_at[:12]}, changing only "
        "evidence files" in text
    )
    assert "Historical evidence" not in text
    # One more commit that changes anything else, and the same bundle is historical again.
    (repo / "campaigns" / "demo.toml").write_text('name = "demo"\ntier = "gpu"\n')
    _git(repo, "commit", "-q", "-am", "campaign change")
    refused = _render(bundle, "--repo", repo, "--out", tmp_path / "strict.md", "--require-current")
    assert refused.returncode == 6 and not (tmp_path / "strict.md").exists()
    assert _render(bundle, "--repo", repo, "--out", page).returncode == 0
    assert "## Historical evidence" in page.read_text()


def test_a_dirty_tree_is_labelled_and_never_current(tmp_path: Path) -> None:
    repo, commit = _repo(tmp_path)
    (repo / "uncommitted.txt").write_text("work in progress\n")
    bundle = _bundle(tmp_path, repo, PASSING)
    page = tmp_path / "validation.md"
    assert (
        _render(bundle, "--repo", repo, "--expected-commit", commit, "--out", page).returncode == 0
    )
    text = page.read_text()
    assert f"evidence from a dirty tree at commit {commit[:12]}: not current qualification" in text
    assert "**Status: not current qualification.**" in text and "(dirty tree)" in text
    refused = _render(
        bundle,
        "--repo",
        repo,
        "--expected-commit",
        commit,
        "--out",
        tmp_path / "strict.md",
        "--require-current",
    )
    assert (
        refused.returncode == 6 and "not current qualification, no page written" in refused.stderr
    )
    assert not (tmp_path / "strict.md").exists()


def test_failed_and_skipped_cells_are_shown_with_their_reasons(tmp_path: Path) -> None:
    repo, commit = _repo(tmp_path)
    cells = [
        _cell(
            "bad",
            "failed",
            {"recovered_step": 3},
            {"recovered_step": 4},
            reason="recovered_step: expected 4, observed 3 | <script>",
        ),
        _cell(
            "gpu",
            "skipped",
            None,
            {"bitwise_equal": True},
            reason="requires gpu: this machine has 0",
        ),
    ]
    bundle = _bundle(tmp_path, repo, cells)
    page = tmp_path / "validation.md"
    assert (
        _render(bundle, "--repo", repo, "--expected-commit", commit, "--out", page).returncode == 0
    )
    text = page.read_text()
    assert f"a FAILED run at commit {commit[:12]}: not a qualification" in text
    assert (
        "| `demo/lifecycle-bad-ddp-w3-s0` | FAILED | recovered_step: expected 4, observed 3 \\| &lt;script&gt;; "
        "recovered_step=3 |"
    ) in text
    assert "| `demo/lifecycle-gpu-ddp-w3-s0` | SKIPPED | requires gpu: this machine has 0 |" in text
    assert "<script>" not in text


def test_a_run_where_every_cell_was_skipped_shows_nothing(tmp_path: Path) -> None:
    repo, commit = _repo(tmp_path)
    bundle = _bundle(tmp_path, repo, [_cell("gpu", "skipped", None, {}, reason="requires gpu")])
    page = tmp_path / "validation.md"
    assert (
        _render(bundle, "--repo", repo, "--expected-commit", commit, "--out", page).returncode == 0
    )
    assert (
        f"nothing ran at commit {commit[:12]} (every cell was skipped): shows nothing"
        in page.read_text()
    )
    assert (
        _render(
            bundle,
            "--repo",
            repo,
            "--expected-commit",
            commit,
            "--out",
            tmp_path / "strict.md",
            "--require-current",
        ).returncode
        == 6
    )


@pytest.mark.parametrize("tamper", ["log", "summary", "extra-file"])
def test_a_tampered_bundle_is_refused_with_one_line(tmp_path: Path, tamper: str) -> None:
    repo, commit = _repo(tmp_path)
    bundle = _bundle(tmp_path, repo, PASSING)
    if tamper == "log":
        (bundle / "cells" / "kill" / "log.txt").write_text("edited after sealing\n")
    elif tamper == "summary":
        summary = json.loads((bundle / "summary.json").read_text())
        summary["cells"][0]["verdict"] = "passed, honestly"
        (bundle / "summary.json").write_text(json.dumps(summary))
    else:
        (bundle / "notes.txt").write_text("added after sealing\n")
    page = tmp_path / "validation.md"
    done = _render(bundle, "--repo", repo, "--expected-commit", commit, "--out", page)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("render_validation_doc: error: files: "), (
        done.stderr
    )
    assert "Traceback" not in done.stderr + done.stdout
    assert not page.exists()


def test_an_edited_signed_manifest_is_refused(tmp_path: Path) -> None:
    # Unsigned, a manifest is only as good as whoever hands it over; signed, rewriting its commit breaks the signature.
    repo, commit = _repo(tmp_path)
    private, public = generate_key(tmp_path / "evidence.pem")
    bundle = _bundle(tmp_path, repo, PASSING, signer=make_signer("key", key=private))
    manifest = bundle / "manifest.json"
    manifest.write_text(manifest.read_text().replace(commit, "0" * 40))
    page = tmp_path / "validation.md"
    done = _render(
        bundle, "--repo", repo, "--expected-commit", commit, "--public-key", public, "--out", page
    )
    assert done.returncode == 5, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("render_validation_doc: error: signature: "), (
        done.stderr
    )
    assert not page.exists()
    intact = _bundle(tmp_path, repo, PASSING, name="intact", signer=make_signer("key", key=private))
    done = _render(
        intact, "--repo", repo, "--expected-commit", commit, "--public-key", public, "--out", page
    )
    assert done.returncode == 0, done.stderr
    assert "signature key" in page.read_text()


def test_bad_usage_is_one_line_and_exit_2(tmp_path: Path) -> None:
    done = _render(
        tmp_path / "missing", "--expected-commit", "abc", "--out", tmp_path / "validation.md"
    )
    assert done.returncode == 2
    assert (
        done.stderr.startswith("render_validation_doc: error: ")
        and len(done.stderr.strip().splitlines()) == 1
    )


def test_a_kill_cell_shows_its_measured_recovery_time_apart_from_its_checks() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("render_validation_doc", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(
        "render_validation_doc", module
    )  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    cell = _cell(
        "kill",
        "passed",
        {"recovered_step": 4, "fault_to_first_step_s": 17.573},
        {"recovered_step": 4},
    )
    assert (
        module.key_observations(cell)
        == "recovered_step=4; SIGKILL to first resumed step 17.57 s (measured)"
    )
    cell["observed"]["fault_to_first_step_s"] = True  # not a number: never shown as one
    assert module.key_observations(cell) == "recovered_step=4"


def test_a_generated_block_lists_every_target_with_its_measured_figure() -> None:
    """A page that cites a measurement cites it from the block: each target, its sealed figure, met or MISSED."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("render_validation_doc", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("render_validation_doc", module)
    spec.loader.exec_module(module)
    bundle = REPO_ROOT / "docs" / "evidence" / "goodput"
    summary = json.loads((bundle / "summary.json").read_text())
    targets = [(c["id"], t) for c in summary["cells"] for t in c.get("targets") or []]
    assert targets, "the committed goodput bundle has measurement targets"
    evidence = module.load_evidence(
        bundle,
        expected_commit=module._claimed_commit(bundle),
        trust=module.TrustPolicy(),
        repo=REPO_ROOT,
        main_ref="main",
    )
    body = module.block_body(evidence, "docs/evidence/goodput", behind=None)
    assert "| cell | target | measured | met |" in body
    for cell_id, target in targets:
        verdict = "met" if target["met"] else "MISSED"
        assert f"| `{cell_id}` | {target['name']} | {target['detail']} | {verdict} |" in body
