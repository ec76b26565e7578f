"""CURRENT-EVIDENCE-ONLY: a bundle sealed at X still describes main's head Y when the trees of X and Y differ only in
evidence files (docs/evidence/, docs/validation.md, generated blocks' bodies); anything else makes it STALE. Real
temporary git repositories, real ``git diff``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from evidence_support import git, make_facts, make_payload

from qualification.errors import EXIT_OK, EXIT_STALE
from qualification.evidence import Freshness, seal_bundle, verify_bundle
from qualification.evidence.cli import main as evidence_cli
from qualification.evidence.freshness import check_freshness, evidence_only
from qualification.report.docblocks import body_sha256

pytestmark = pytest.mark.timeout(60)


def _block(body: str) -> str:
    return (
        f"<!-- BEGIN GENERATED figures bundle=docs/evidence/demo sha256={body_sha256(body)} -->\n"
        f"{body}\n<!-- END GENERATED figures -->\n"
    )


README = "# Demo\n\nProse that is not evidence.\n\n{block}\nMore prose.\n"


def _write(repo: Path, files: dict[str, str], message: str) -> str:
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


@pytest.fixture
def sealed_x(tmp_path: Path) -> tuple[Path, Path, str]:
    """A repo on main whose commit X holds code, a README with a generated block and a committed bundle; a bundle
    sealed at X (outside the repo): (bundle, repo, X)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    x = _write(
        repo,
        {
            "campaigns/quick.toml": 'name = "quick"\ntier = "cpu"\n',
            "src/train.py": "STEPS = 8\n",
            "README.md": README.format(block=_block("| cell | 24.1 s |")),
            "docs/validation.md": "# Validation\n\nold page\n",
            "docs/evidence/demo/manifest.json": "{}\n",
        },
        "code and docs",
    )
    bundle = make_payload(tmp_path)
    seal_bundle(bundle, make_facts(repo), repo=repo)
    return bundle, repo, x


def _evidence_commit(repo: Path) -> str:
    """What scripts/regenerate_evidence.sh commits after sealing: the bundle, the page and re-rendered blocks."""
    return _write(
        repo,
        {
            "docs/evidence/demo/manifest.json": '{"new": true}\n',
            "docs/evidence/quickstart/summary.json": "{}\n",
            "docs/validation.md": "# Validation\n\nnew page\n",
            "README.md": README.format(block=_block("| cell | 19.7 s |")),
        },
        "evidence",
    )


def test_a_commit_of_evidence_alone_keeps_the_bundle_current(
    sealed_x: tuple[Path, Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    bundle, repo, x = sealed_x
    y = _evidence_commit(repo)
    result = verify_bundle(bundle, expected_commit=x, repo=repo)
    fresh = result.freshness
    assert (fresh.state, fresh.commits_behind, fresh.main_head) == (
        Freshness.CURRENT_EVIDENCE_ONLY,
        1,
        y,
    )
    assert fresh.covers_head and fresh.non_evidence == ()
    assert result.exit_code == EXIT_OK and "CURRENT-EVIDENCE-ONLY" in result.message
    assert result.headline.tone == "passed"
    assert result.headline.text == "PASSED, CURRENT-EVIDENCE-ONLY, complete"
    # The CLI says the same, in JSON and in words.
    assert (
        evidence_cli(["verify", str(bundle), "--expected-commit", x, "--repo", str(repo), "--json"])
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert doc["freshness"] == "CURRENT-EVIDENCE-ONLY" and doc["non_evidence_changes"] == []
    assert evidence_cli(["verify", str(bundle), "--expected-commit", x, "--repo", str(repo)]) == 0
    assert (
        "freshness  CURRENT-EVIDENCE-ONLY against main, 1 commit(s) behind"
        in capsys.readouterr().out
    )


def test_any_other_change_after_the_evidence_makes_it_stale(
    sealed_x: tuple[Path, Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    bundle, repo, x = sealed_x
    _evidence_commit(repo)
    z = _write(repo, {"src/train.py": "STEPS = 9\n"}, "code")
    result = verify_bundle(bundle, expected_commit=x, repo=repo)
    assert (result.freshness.state, result.freshness.commits_behind) == (Freshness.STALE, 2)
    assert result.freshness.non_evidence == ("src/train.py",)
    assert result.exit_code == EXIT_STALE and "src/train.py" in result.message
    assert not result.freshness.covers_head and result.headline.word == "STALE"
    assert check_freshness(x, repo=repo).main_head == z
    code = evidence_cli(
        ["verify", str(bundle), "--expected-commit", x, "--repo", str(repo), "--json"]
    )
    assert code == EXIT_STALE
    assert json.loads(capsys.readouterr().out)["non_evidence_changes"] == ["src/train.py"]


@pytest.mark.parametrize(
    ("files", "culprit"),
    [
        (
            {
                "README.md": README.format(block=_block("| cell | 24.1 s |")).replace(
                    "Prose", "Text"
                )
            },
            "README.md",
        ),
        (
            {"docs/guide.md": "# A new page\n"},
            "docs/guide.md",
        ),  # a new Markdown file is prose, not a block
        ({"campaigns/quick.toml": 'name = "quick"\ntier = "gpu"\n'}, "campaigns/quick.toml"),
        (
            {"docs/evidence.md": "# How evidence works\n"},
            "docs/evidence.md",
        ),  # not under docs/evidence/
    ],
)
def test_prose_outside_a_block_and_lookalike_paths_are_not_evidence(
    sealed_x: tuple[Path, Path, str], files: dict[str, str], culprit: str
) -> None:
    bundle, repo, x = sealed_x
    _write(repo, files, "not evidence")
    result = verify_bundle(bundle, expected_commit=x, repo=repo)
    assert result.freshness.state is Freshness.STALE and result.freshness.non_evidence == (culprit,)


def test_the_trees_are_compared_so_a_reverted_change_leaves_it_exact(
    sealed_x: tuple[Path, Path, str],
) -> None:
    bundle, repo, x = sealed_x
    _write(repo, {"src/train.py": "STEPS = 9\n"}, "code")
    _write(repo, {"src/train.py": "STEPS = 8\n"}, "revert")
    y = _evidence_commit(repo)
    assert evidence_only(repo, x, y) == []
    result = verify_bundle(bundle, expected_commit=x, repo=repo)
    assert (result.freshness.state, result.freshness.commits_behind) == (
        Freshness.CURRENT_EVIDENCE_ONLY,
        3,
    )


def test_an_unterminated_block_or_a_deleted_file_is_a_change(
    sealed_x: tuple[Path, Path, str],
) -> None:
    _, repo, x = sealed_x
    broken = README.format(block=_block("| cell | 24.1 s |")).replace(
        "<!-- END GENERATED figures -->\n", ""
    )
    y = _write(repo, {"README.md": broken}, "broken block")
    assert evidence_only(repo, x, y) == ["README.md"]
    git(repo, "rm", "-q", "src/train.py")
    git(repo, "commit", "-q", "-m", "delete")
    assert evidence_only(repo, x, git(repo, "rev-parse", "HEAD")) == ["README.md", "src/train.py"]
