"""The verifier: one test per check, each tampering with exactly one thing and expecting exactly that failure."""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest
from evidence_support import add_commit, git, make_facts, make_payload, make_repo, rewrite_manifest

from qualification.errors import (
    EXIT_COMMIT_MISMATCH,
    EXIT_FAILED,
    EXIT_NOT_ON_MAIN,
    EXIT_OK,
    EXIT_STALE,
    BundleInvalid,
    CommitMismatch,
    UsageError,
)
from qualification.evidence import Freshness, Summary, seal_bundle, verify_bundle
from qualification.evidence.manifest import MANIFEST_NAME
from qualification.evidence.seal import write_archive

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def sealed(tmp_path: Path) -> tuple[Path, Path, str]:
    """An unsigned bundle sealed at the head of main: (bundle, repo, commit)."""
    repo, commit = make_repo(tmp_path)
    bundle = make_payload(tmp_path)
    seal_bundle(bundle, make_facts(repo), repo=repo)
    return bundle, repo, commit


def _fails(bundle: Path, commit: str, repo: Path | None = None, **kwargs: object) -> BundleInvalid:
    with pytest.raises(BundleInvalid) as caught:
        verify_bundle(bundle, expected_commit=commit, repo=repo, **kwargs)  # type: ignore[arg-type]
    return caught.value


def test_happy_path_is_valid_current_and_exits_0(sealed: tuple[Path, Path, str]) -> None:
    bundle, repo, commit = sealed
    result = verify_bundle(bundle, expected_commit=commit.upper(), repo=repo)
    assert result.freshness.state is Freshness.CURRENT
    assert result.exit_code == EXIT_OK
    assert result.checks_passed == ("intake", "schema", "files", "consistency", "commit")
    assert result.signature == "none" and result.result == "PASSED" and result.commit == commit
    as_json = result.to_json()
    assert (
        as_json["status"] == "VALID"
        and as_json["freshness"] == "CURRENT"
        and as_json["commits_behind"] == 0
    )


# 1. intake


def test_missing_manifest(sealed: tuple[Path, Path, str]) -> None:
    bundle, _, commit = sealed
    (bundle / MANIFEST_NAME).unlink()
    assert "intake: manifest.json is missing" in str(_fails(bundle, commit))


def test_malformed_manifest(sealed: tuple[Path, Path, str]) -> None:
    bundle, _, commit = sealed
    (bundle / MANIFEST_NAME).write_text('{"_type": ')
    assert "intake: manifest.json is not valid JSON" in str(_fails(bundle, commit))


def test_manifest_with_a_duplicate_key(sealed: tuple[Path, Path, str]) -> None:
    bundle, _, commit = sealed
    text = (bundle / MANIFEST_NAME).read_text()
    (bundle / MANIFEST_NAME).write_text(
        text.replace('"result": "PASSED"', '"result": "FAILED", "result": "PASSED"')
    )
    assert "intake: manifest.json is not valid JSON (duplicate key 'result')" in str(
        _fails(bundle, commit)
    )


def test_oversized_manifest(
    sealed: tuple[Path, Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle, _, commit = sealed
    monkeypatch.setattr("qualification.evidence.verify.MAX_METADATA_BYTES", 16)
    assert "intake: manifest.json is" in str(_fails(bundle, commit))


def test_path_traversal_subject(sealed: tuple[Path, Path, str]) -> None:
    bundle, _, commit = sealed
    rewrite_manifest(bundle, lambda m: m["subject"][0].update(name="../../etc/passwd"))
    error = _fails(bundle, commit)
    assert "intake: subject name '../../etc/passwd' escapes the bundle" in str(error)
    assert error.exit_code == EXIT_FAILED


def test_absolute_path_subject(sealed: tuple[Path, Path, str]) -> None:
    bundle, _, commit = sealed
    rewrite_manifest(bundle, lambda m: m["subject"][0].update(name="/etc/passwd"))
    assert "intake: subject name '/etc/passwd' is an absolute path" in str(_fails(bundle, commit))


def test_reserved_subject_name(sealed: tuple[Path, Path, str]) -> None:
    bundle, _, commit = sealed
    rewrite_manifest(bundle, lambda m: m["subject"][0].update(name=MANIFEST_NAME))
    assert "is reserved" in str(_fails(bundle, commit))


def test_symlink_in_bundle(sealed: tuple[Path, Path, str]) -> None:
    bundle, _, commit = sealed
    log = bundle / "logs" / "000-unit.log"
    moved = bundle.parent / "outside.log"
    log.rename(moved)
    log.symlink_to(moved)  # same bytes, same digest: only the link itself is wrong
    assert "intake: 'logs/000-unit.log' is a symlink" in str(_fails(bundle, commit))


def test_special_file_in_bundle(sealed: tuple[Path, Path, str]) -> None:
    bundle, _, commit = sealed
    os.mkfifo(bundle / "logs" / "pipe")
    assert "is not a regular file" in str(_fails(bundle, commit))


def test_file_over_the_size_limit(sealed: tuple[Path, Path, str]) -> None:
    bundle, _, commit = sealed
    error = _fails(bundle, commit, max_file_bytes=8)
    assert "intake:" in str(error) and "over the 8-byte limit" in str(error)


# 3. schema (2. signature is in test_evidence_sign.py)


def test_schema_violation_names_the_pointer(sealed: tuple[Path, Path, str]) -> None:
    bundle, _, commit = sealed
    rewrite_manifest(bundle, lambda m: m["predicate"].update(summmary={}))
    assert "schema: /predicate: Additional properties are not allowed ('summmary'" in str(
        _fails(bundle, commit)
    )


def test_newer_minor_schema_version_fails_closed(sealed: tuple[Path, Path, str]) -> None:
    bundle, _, commit = sealed
    rewrite_manifest(bundle, lambda m: m["predicate"].update(schemaVersion="1.7.0"))
    assert "newer than this verifier understands" in str(_fails(bundle, commit))


# 4. files


def test_edited_payload(sealed: tuple[Path, Path, str]) -> None:
    bundle, _, commit = sealed
    log = bundle / "logs" / "000-unit.log"
    log.write_text(log.read_text().replace("3 passed", "3 failed"))  # same size, other bytes
    assert "files: 'logs/000-unit.log' does not match its sha256" in str(_fails(bundle, commit))


def test_edited_manifest_digest(sealed: tuple[Path, Path, str]) -> None:
    bundle, _, commit = sealed
    rewrite_manifest(bundle, lambda m: m["subject"][1]["digest"].update(sha256="0" * 64))
    assert "files: 'logs/001-dist.log' does not match its sha256" in str(_fails(bundle, commit))


def test_edited_payload_size(sealed: tuple[Path, Path, str]) -> None:
    bundle, _, commit = sealed
    with (bundle / "reports" / "cells.json").open("a") as handle:
        handle.write("more\n")
    assert "files: 'reports/cells.json' is" in str(_fails(bundle, commit))


def test_extra_file(sealed: tuple[Path, Path, str]) -> None:
    bundle, _, commit = sealed
    (bundle / "logs" / "999-extra.log").write_text("smuggled\n")
    assert "files: 'logs/999-extra.log' is in the bundle but is not a subject" in str(
        _fails(bundle, commit)
    )


def test_missing_file(sealed: tuple[Path, Path, str]) -> None:
    bundle, _, commit = sealed
    (bundle / "reports" / "cells.json").unlink()
    assert "files: subject 'reports/cells.json' is missing from the bundle" in str(
        _fails(bundle, commit)
    )


def test_duplicate_subject(sealed: tuple[Path, Path, str]) -> None:
    bundle, _, commit = sealed
    rewrite_manifest(bundle, lambda m: m["subject"].append(dict(m["subject"][0])))
    assert "is listed twice" in str(_fails(bundle, commit))


# 5. consistency


@pytest.mark.parametrize(
    ("mutation", "message"),
    [
        (
            lambda p: p["commands"][1].update(exitCode=2),
            "result is PASSED but the counts and exit codes make it FAILED",
        ),
        (
            lambda p: p["summary"].update(passed=2, failed=1),
            "result is PASSED but the counts and exit codes make it ",
        ),
        (
            lambda p: p["summary"].update(total=4),
            "summary total 4 != passed+failed+skipped+measured 3",
        ),
        (
            lambda p: p["summary"].update(total=0, passed=0),
            "result is PASSED but the counts and exit codes make it ",
        ),
        (
            lambda p: p["summary"].update(passed=2, skipped=1),
            "result is PASSED but the counts and exit codes make it PASSED-WITH-SKIPS",
        ),
        (
            lambda p: p["scope"].update(filter="two-peers"),
            "scope.complete is true but its filter, seed and cell counts",
        ),
        (lambda p: p["scope"].update(campaignCellsRun=1), "scope.complete is true but"),
        (
            lambda p: p["boundaries"]["validated"].append({"claim": "NCCL", "backedBy": ["999"]}),
            "validated claim 'NCCL' is backed by '999', which is not a command of this run",
        ),
        (
            lambda p: p["run"].update(finishedOn="2026-08-13T09:00:00Z"),
            "run.startedOn is after run.finishedOn",
        ),
        (
            lambda p: p["commands"][0].update(startedOn="2026-08-13T10:30:00Z"),
            "'000' startedOn is after",
        ),
        (
            lambda p: p["commands"][0].update(startedOn="2026-08-13T09:59:00Z"),
            "ran outside the run",
        ),
        (
            lambda p: p["commands"][0].update(log="logs/absent.log"),
            "log 'logs/absent.log' of command '000'",
        ),
    ],
)
def test_inconsistent_manifest(sealed: tuple[Path, Path, str], mutation, message: str) -> None:  # type: ignore[no-untyped-def]
    bundle, _, commit = sealed
    rewrite_manifest(bundle, lambda m: mutation(m["predicate"]))
    error = _fails(bundle, commit)
    assert str(error).startswith("consistency: ") and message in str(error)


# 6. commit


def test_wrong_commit(sealed: tuple[Path, Path, str]) -> None:
    bundle, _, commit = sealed
    with pytest.raises(
        CommitMismatch, match=f"commit: bundle was made from {commit}, expected 0{{40}}"
    ) as caught:
        verify_bundle(bundle, expected_commit="0" * 40)
    assert caught.value.exit_code == EXIT_COMMIT_MISMATCH


@pytest.mark.parametrize("bad", ["abc1234", "g" * 40, ""])
def test_expected_commit_must_be_full_hex(sealed: tuple[Path, Path, str], bad: str) -> None:
    with pytest.raises(UsageError, match="full 40-hex commit SHA"):
        verify_bundle(sealed[0], expected_commit=bad)


def test_missing_bundle_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        verify_bundle(tmp_path / "nope", expected_commit="0" * 40)


# 7. freshness


def test_stale_when_main_moved_on(sealed: tuple[Path, Path, str]) -> None:
    bundle, repo, commit = sealed
    newer = add_commit(repo)
    result = verify_bundle(bundle, expected_commit=commit, repo=repo)
    assert (result.freshness.state, result.freshness.commits_behind) == (Freshness.STALE, 1)
    assert result.freshness.main_head == newer
    assert result.exit_code == EXIT_STALE and "STALE" in result.message
    assert (
        verify_bundle(bundle, expected_commit=commit, repo=repo, allow_stale=True).exit_code
        == EXIT_OK
    )


def test_not_on_main_when_sealed_on_a_side_branch(tmp_path: Path) -> None:
    repo, _ = make_repo(tmp_path)
    git(repo, "checkout", "-q", "-b", "side")
    side = add_commit(repo, "side.txt")
    bundle = make_payload(tmp_path)
    seal_bundle(bundle, make_facts(repo), repo=repo)
    result = verify_bundle(bundle, expected_commit=side, repo=repo)
    assert result.freshness.state is Freshness.NOT_ON_MAIN
    assert result.exit_code == EXIT_NOT_ON_MAIN


def test_unknown_without_a_repository(sealed: tuple[Path, Path, str], tmp_path: Path) -> None:
    bundle, _, commit = sealed
    assert (
        verify_bundle(bundle, expected_commit=commit, repo=None).freshness.state
        is Freshness.UNKNOWN
    )
    not_a_repo = tmp_path / "plain"
    not_a_repo.mkdir()
    result = verify_bundle(bundle, expected_commit=commit, repo=not_a_repo)
    assert result.freshness.state is Freshness.UNKNOWN and result.exit_code == EXIT_NOT_ON_MAIN


def test_unknown_when_main_ref_is_absent(sealed: tuple[Path, Path, str]) -> None:
    bundle, repo, commit = sealed
    result = verify_bundle(bundle, expected_commit=commit, repo=repo, main_ref="origin/main")
    assert result.freshness.state is Freshness.UNKNOWN and "origin/main" in result.freshness.reason


def test_dirty_tree_is_never_current(tmp_path: Path) -> None:
    repo, commit = make_repo(tmp_path)
    (repo / "campaigns" / "quick.toml").write_text('name = "edited, uncommitted"\n')
    bundle = make_payload(tmp_path)
    assert seal_bundle(bundle, make_facts(repo), repo=repo).dirty
    result = verify_bundle(bundle, expected_commit=commit, repo=repo)
    assert result.freshness.state is Freshness.UNKNOWN and "dirty" in result.freshness.reason
    assert result.exit_code == EXIT_NOT_ON_MAIN
    assert (
        verify_bundle(bundle, expected_commit=commit, repo=repo, allow_stale=True).exit_code
        == EXIT_NOT_ON_MAIN
    )


def test_valid_record_of_a_failed_run_exits_1(tmp_path: Path) -> None:
    repo, commit = make_repo(tmp_path)
    bundle = make_payload(tmp_path)
    seal_bundle(bundle, make_facts(repo, exit_codes=(0, 1), failed=1), repo=repo)
    result = verify_bundle(bundle, expected_commit=commit, repo=repo)
    assert result.result == "FAILED" and result.exit_code == EXIT_FAILED
    assert result.freshness.state is Freshness.CURRENT


# archives


def test_archive_verifies_like_the_directory(
    sealed: tuple[Path, Path, str], tmp_path: Path
) -> None:
    bundle, repo, commit = sealed
    archive = write_archive(bundle, tmp_path / "bundle.tar.gz")
    assert verify_bundle(archive, expected_commit=commit, repo=repo).exit_code == EXIT_OK
    shutil.rmtree(bundle)  # the archive stands alone


def test_archive_packed_with_a_top_folder_verifies(
    sealed: tuple[Path, Path, str], tmp_path: Path
) -> None:
    bundle, repo, commit = sealed
    archive = tmp_path / "wrapped.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(bundle, arcname="qualification-evidence")
    assert verify_bundle(archive, expected_commit=commit, repo=repo).exit_code == EXIT_OK


@pytest.mark.parametrize(
    ("member", "message"),
    [
        ("../escape.log", "escapes the bundle"),
        ("/abs.log", "absolute path"),
        ("link.log", "is a link"),
    ],
)
def test_unsafe_archive_members_are_rejected(
    sealed: tuple[Path, Path, str], tmp_path: Path, member: str, message: str
) -> None:
    bundle, _, commit = sealed
    archive = write_archive(bundle, tmp_path / "bundle.tar.gz")
    hostile = tmp_path / "hostile.tar.gz"
    with tarfile.open(archive) as source, tarfile.open(hostile, "w:gz") as tar:
        for info in source:
            tar.addfile(info, source.extractfile(info))
        extra = tarfile.TarInfo(member)
        if member == "link.log":
            extra.type, extra.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(extra)
        else:
            extra.size = 3
            tar.addfile(extra, io.BytesIO(b"bad"))
    error = _fails(hostile, commit)
    assert "intake: archive member" in str(error) and message in str(error)
    assert not (tmp_path / "escape.log").exists()


# scope and claims (schema 1.1)


def test_a_partial_run_is_valid_but_require_complete_refuses_it(tmp_path: Path) -> None:
    from qualification.errors import EXIT_INCOMPLETE
    from qualification.evidence import Scope

    repo, commit = make_repo(tmp_path)
    bundle = make_payload(tmp_path)
    scope = Scope(cells_in_campaign=4, campaign_cells_run=2, cells_run=2, filter="two-peers")
    seal_bundle(
        bundle,
        make_facts(repo, summary=Summary(total=2, passed=2, failed=0, skipped=0), scope=scope),
        repo=repo,
    )
    result = verify_bundle(bundle, expected_commit=commit, repo=repo)
    assert result.exit_code == EXIT_OK and not result.complete
    assert result.headline.word == "PARTIAL" and result.headline.tone == "warning"
    assert "PARTIAL 2 of 4 cells (--filter 'two-peers')" in result.headline.text
    refused = verify_bundle(bundle, expected_commit=commit, repo=repo, require_complete=True)
    assert refused.exit_code == EXIT_INCOMPLETE and "--require-complete" in refused.message
    # The filter is part of the evidence: removing it (and calling the run complete) breaks consistency.
    rewrite_manifest(bundle, lambda m: m["predicate"]["scope"].update(filter=None, complete=True))
    assert "scope.complete is true but" in str(_fails(bundle, commit))


def test_a_failed_command_moves_its_claim_to_not_validated(tmp_path: Path) -> None:
    repo, commit = make_repo(tmp_path)
    bundle = make_payload(tmp_path)
    seal_bundle(bundle, make_facts(repo, exit_codes=(0, 3), failed=1), repo=repo)
    manifest = json.loads((bundle / MANIFEST_NAME).read_text())["predicate"]
    assert manifest["boundaries"]["validated"] == []
    moved = manifest["boundaries"]["notValidated"][0]
    assert moved["claim"] == "two-rank gloo recovery" and moved["reason"].startswith(
        "failed: 1 of 2 backing commands"
    )
    assert manifest["boundaries"]["notValidated"][1] == {
        "claim": "NCCL",
        "reason": "declared not validated by the campaign",
    }


def test_a_boundary_moved_into_validated_by_hand_fails(sealed: tuple[Path, Path, str]) -> None:
    bundle, _, commit = sealed

    def promote(m: dict) -> None:  # type: ignore[type-arg]
        bounds = m["predicate"]["boundaries"]
        claim = bounds["notValidated"].pop(0)
        bounds["validated"].append({"claim": claim["claim"], "backedBy": []})

    rewrite_manifest(bundle, promote)
    assert "backedBy" in str(_fails(bundle, commit))  # schema: a validated claim names its backing


def test_a_schema_1_0_bundle_still_verifies_by_its_own_rules(
    sealed: tuple[Path, Path, str],
) -> None:
    bundle, repo, commit = sealed

    def downgrade(m: dict) -> None:  # type: ignore[type-arg]
        p = m["predicate"]
        p["schemaVersion"] = "1.0.0"
        del p["scope"], p["summary"]["measured"]
        p["boundaries"] = {
            "validated": [c["claim"] for c in p["boundaries"]["validated"]],
            "notValidated": [c["claim"] for c in p["boundaries"]["notValidated"]],
        }

    rewrite_manifest(bundle, downgrade)
    result = verify_bundle(bundle, expected_commit=commit, repo=repo)
    assert result.exit_code == EXIT_OK and result.schema_version == "1.0.0" and result.scope is None
    assert result.headline.word == "SCOPE UNKNOWN" and result.headline.tone == "warning"
    assert (
        verify_bundle(bundle, expected_commit=commit, repo=repo, require_complete=True).exit_code
        == 7
    )
    rewrite_manifest(bundle, lambda m: m["predicate"].update(result="PASSED-WITH-SKIPS"))
    assert "schema" in str(_fails(bundle, commit))  # 1.0.0 knows PASSED and FAILED only
