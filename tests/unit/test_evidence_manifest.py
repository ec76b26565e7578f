"""The manifest format and sealing: canonical bytes, the schema both ways, the run facts, what seal records."""

from __future__ import annotations

import copy
import json
import os
from datetime import timedelta
from importlib import resources
from pathlib import Path

import pytest
from evidence_support import T0, git, make_facts, make_payload, make_repo
from jsonschema import Draft202012Validator

from qualification.errors import BundleInvalid, UsageError
from qualification.evidence import CommandRecord, Summary, seal_bundle
from qualification.evidence.facts_file import load_facts
from qualification.evidence.manifest import (
    MANIFEST_NAME,
    PREDICATE_TYPE,
    SCHEMA_FILE,
    STATEMENT_TYPE,
    Subject,
    build_statement,
    canonical_bytes,
    load_schema,
    path_problem,
    schema_errors,
    write_atomic,
)
from qualification.evidence.seal import write_archive

pytestmark = pytest.mark.timeout(60)
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def sealed(tmp_path: Path) -> tuple[Path, Path, str, dict]:
    repo, commit = make_repo(tmp_path)
    bundle = make_payload(tmp_path)
    seal_bundle(bundle, make_facts(repo), repo=repo)
    return bundle, repo, commit, json.loads((bundle / MANIFEST_NAME).read_bytes())


def test_schema_is_valid_draft_2020_12_and_has_one_copy() -> None:
    Draft202012Validator.check_schema(load_schema())
    packaged = REPO_ROOT / "qualification" / "schemas" / "evidence-manifest.schema.json"
    assert not (REPO_ROOT / "schemas").exists()  # the package data is the only copy
    # the lookup an installed package uses (package-data in pyproject) finds these bytes
    assert (
        resources.files("qualification").joinpath("schemas", SCHEMA_FILE).read_bytes()
        == packaged.read_bytes()
    )


def test_canonical_bytes_are_sorted_utf8_and_stable() -> None:
    a = canonical_bytes({"b": 1, "a": {"z": "é", "y": [2, 1]}})
    b = canonical_bytes({"a": {"y": [2, 1], "z": "é"}, "b": 1})
    assert a == b
    assert (
        a.decode("utf-8")
        == '{\n  "a": {\n    "y": [\n      2,\n      1\n    ],\n    "z": "é"\n  },\n  "b": 1\n}\n'
    )


def test_canonical_bytes_refuse_floats() -> None:
    with pytest.raises(TypeError, match="float"):
        canonical_bytes({"summary": {"ratio": 0.5}})


def test_build_statement_sorts_subjects_and_records_size() -> None:
    statement = build_statement([Subject("b", "0" * 64, 2), Subject("a", "1" * 64, 1)], {})
    assert statement["_type"] == STATEMENT_TYPE and statement["predicateType"] == PREDICATE_TYPE
    assert [s["name"] for s in statement["subject"]] == ["a", "b"]
    assert statement["subject"][0] == {
        "name": "a",
        "digest": {"sha256": "1" * 64},
        "annotations": {"sizeBytes": 1},
    }


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("", "is empty"),
        ("/etc/passwd", "absolute"),
        ("C:/x", "absolute"),
        ("../x", "'..'"),
        ("logs/../../x", "'..'"),
        ("logs//x", "not normalized"),
        ("./x", "not normalized"),
        ("logs\\x", "backslash"),
    ],
)
def test_path_problem_names_each_unsafe_path(name: str, reason: str) -> None:
    problem = path_problem(name)
    assert problem is not None and reason in problem


def test_path_problem_accepts_plain_relative_paths() -> None:
    assert path_problem("logs/000-unit.log") is None
    assert path_problem("a..b/c") is None


def test_sealed_manifest_records_the_run(sealed: tuple[Path, Path, str, dict]) -> None:
    bundle, _, commit, manifest = sealed
    assert schema_errors(manifest) == []
    assert (bundle / MANIFEST_NAME).read_bytes() == canonical_bytes(manifest)
    assert [s["name"] for s in manifest["subject"]] == [
        "logs/000-unit.log",
        "logs/001-dist.log",
        "reports/cells.json",
    ]
    log = bundle / "logs" / "000-unit.log"
    assert manifest["subject"][0]["annotations"]["sizeBytes"] == log.stat().st_size
    predicate = manifest["predicate"]
    assert predicate["source"] == {
        "repository": None,
        "ref": "refs/heads/main",
        "digest": {"gitCommit": commit},
        "dirty": False,
    }
    assert predicate["campaign"]["path"] == "campaigns/quick.toml"
    assert predicate["result"] == "PASSED"
    assert predicate["commands"][0]["log"] == "logs/000-unit.log"
    assert predicate["run"]["startedOn"] == "2026-08-13T10:00:00.000Z"
    assert predicate["artifact"] == {"name": f"qualification-evidence-{commit}", "runUrl": None}
    declared = "declared not validated by the campaign"
    assert predicate["boundaries"]["notValidated"] == [
        {"claim": "NCCL", "reason": declared},
        {"claim": "RDMA", "reason": declared},
    ]
    assert predicate["boundaries"]["validated"] == [
        {"claim": "two-rank gloo recovery", "backedBy": ["000", "001"]}
    ]
    assert predicate["scope"] == {
        "complete": True,
        "cellsInCampaign": 3,
        "campaignCellsRun": 3,
        "cellsRun": 3,
        "filter": None,
        "seedOverride": None,
    }


def test_only_allow_listed_environment_variables_are_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "do-not-record")
    monkeypatch.setenv("GITHUB_TOKEN", "do-not-record")
    repo, _ = make_repo(tmp_path)
    bundle = make_payload(tmp_path)
    seal_bundle(bundle, make_facts(repo), repo=repo)
    text = (bundle / MANIFEST_NAME).read_text()
    assert json.loads(text)["predicate"]["environment"]["variables"]["OMP_NUM_THREADS"] == "4"
    assert "do-not-record" not in text


def test_remote_credentials_never_reach_the_manifest(tmp_path: Path) -> None:
    repo, _ = make_repo(tmp_path)
    git(repo, "remote", "add", "origin", "https://bot:ghp_secret@github.com/org/gemscout.git")
    bundle = make_payload(tmp_path)
    seal_bundle(bundle, make_facts(repo), repo=repo)
    text = (bundle / MANIFEST_NAME).read_text()
    assert "ghp_secret" not in text
    assert (
        json.loads(text)["predicate"]["source"]["repository"]
        == "https://github.com/org/gemscout.git"
    )


def test_dirty_tree_is_recorded_but_the_bundle_itself_does_not_count(tmp_path: Path) -> None:
    repo, _ = make_repo(tmp_path)
    inside = make_payload(repo)  # the bundle lives in the checkout, untracked
    sealed = seal_bundle(inside, make_facts(repo), repo=repo)
    assert sealed.dirty is False
    (repo / "campaigns" / "quick.toml").write_text('name = "edited"\n')
    (inside / MANIFEST_NAME).unlink()
    assert seal_bundle(inside, make_facts(repo), repo=repo).dirty is True


def test_failed_run_is_sealed_as_failed(tmp_path: Path) -> None:
    repo, _ = make_repo(tmp_path)
    bundle = make_payload(tmp_path)
    assert (
        seal_bundle(bundle, make_facts(repo, exit_codes=(0, 1), failed=1), repo=repo).result
        == "FAILED"
    )


def test_zero_cells_never_seal_as_passed(tmp_path: Path) -> None:
    repo, _ = make_repo(tmp_path)
    facts = make_facts(repo, commands=(), summary=Summary(total=0, passed=0, failed=0, skipped=0))
    assert facts.result == "FAILED"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"trigger": "cron"}, "trigger must be one of"),
        ({"finished_on": T0 - timedelta(seconds=1)}, "started_on is after finished_on"),
        ({"started_on": T0.replace(tzinfo=None)}, "timezone-aware"),
        ({"run_url": "ftp://ci/run/1"}, "run_url"),
    ],
)
def test_seal_input_rejects_bad_facts_naming_the_field(
    tmp_path: Path, change: dict, message: str
) -> None:
    repo, _ = make_repo(tmp_path)
    with pytest.raises(UsageError, match=message):
        make_facts(repo, **change)


def test_summary_must_add_up() -> None:
    with pytest.raises(UsageError, match="summary.total"):
        Summary(total=3, passed=1, failed=1, skipped=0)


def test_command_log_must_be_a_safe_relative_path() -> None:
    with pytest.raises(UsageError, match="escapes the bundle"):
        CommandRecord(
            id="x",
            argv=("true",),
            cwd=".",
            started_on=T0,
            finished_on=T0,
            exit_code=0,
            log="../x.log",
        )


def test_seal_refuses_missing_log_empty_dir_and_resealing(tmp_path: Path) -> None:
    repo, _ = make_repo(tmp_path)
    bundle = make_payload(tmp_path)
    (bundle / "logs" / "001-dist.log").unlink()
    with pytest.raises(UsageError, match="001-dist.log"):
        seal_bundle(bundle, make_facts(repo), repo=repo)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UsageError, match="empty"):
        seal_bundle(empty, make_facts(repo, commands=()), repo=repo)
    (bundle / "logs" / "001-dist.log").write_text("again\n")
    seal_bundle(bundle, make_facts(repo), repo=repo)
    with pytest.raises(UsageError, match="already sealed"):
        seal_bundle(bundle, make_facts(repo), repo=repo)


def test_seal_refuses_symlinks_in_the_payload(tmp_path: Path) -> None:
    repo, _ = make_repo(tmp_path)
    bundle = make_payload(tmp_path)
    (bundle / "logs" / "link.log").symlink_to(bundle / "logs" / "000-unit.log")
    with pytest.raises(BundleInvalid, match="symlink"):
        seal_bundle(bundle, make_facts(repo), repo=repo)


def test_seal_outside_a_git_checkout_is_a_usage_error(tmp_path: Path) -> None:
    repo, _ = make_repo(tmp_path)
    bundle = make_payload(tmp_path)
    elsewhere = tmp_path / "not-a-repo"
    elsewhere.mkdir()
    with pytest.raises(UsageError, match="not a git checkout"):
        seal_bundle(bundle, make_facts(repo), repo=elsewhere)


def test_write_atomic_replaces_and_leaves_no_temp_files(tmp_path: Path) -> None:
    target = tmp_path / "manifest.json"
    write_atomic(target, b"old")
    write_atomic(target, b"new")
    assert target.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["manifest.json"]


def test_archive_is_reproducible(sealed: tuple[Path, Path, str, dict], tmp_path: Path) -> None:
    bundle = sealed[0]
    first, second = (
        write_archive(bundle, tmp_path / "a.tar.gz"),
        write_archive(bundle, tmp_path / "b.tar.gz"),
    )
    assert first.read_bytes() == second.read_bytes()


_MUTATIONS = {
    "extra top-level field": lambda m: m.update(extra=1),
    "typo in predicate": lambda m: m["predicate"].update(summmary={}),
    "missing result": lambda m: m["predicate"].pop("result"),
    "unknown result": lambda m: m["predicate"].update(result="WARNED"),
    "short commit": lambda m: m["predicate"]["source"]["digest"].update(gitCommit="abc1234"),
    "uppercase digest": lambda m: m["subject"][0]["digest"].update(sha256="A" * 64),
    "not a timestamp": lambda m: m["predicate"]["run"].update(finishedOn="yesterday"),
    "local-time timestamp": lambda m: m["predicate"]["run"].update(
        finishedOn="2026-08-13T12:00:00+02:00"
    ),
    "run url not a uri": lambda m: m["predicate"]["artifact"].update(
        runUrl="https://exa mple.com/run"
    ),
    "secret variable": lambda m: m["predicate"]["environment"]["variables"].update(
        AWS_SECRET_ACCESS_KEY="x"
    ),
    "negative count": lambda m: m["predicate"]["summary"].update(skipped=-1),
    "newer major version": lambda m: m["predicate"].update(schemaVersion="2.0.0"),
    "no subjects": lambda m: m.update(subject=[]),
    "wrong predicate type": lambda m: m.update(predicateType="https://slsa.dev/provenance/v1"),
}


@pytest.mark.parametrize("mutation", sorted(_MUTATIONS))
def test_schema_rejects_each_mutation(sealed: tuple[Path, Path, str, dict], mutation: str) -> None:
    manifest = copy.deepcopy(sealed[3])
    _MUTATIONS[mutation](manifest)
    assert schema_errors(manifest), f"schema accepted: {mutation}"


def test_load_facts_reads_the_documented_json(tmp_path: Path) -> None:
    repo, _ = make_repo(tmp_path)
    facts_file = tmp_path / "facts.json"
    facts_file.write_text(
        json.dumps(
            {
                "campaign": {"path": str(repo / "campaigns" / "quick.toml")},
                "startedOn": "2026-08-13T10:00:00Z",
                "finishedOn": "2026-08-13T10:10:00Z",
                "summary": {"total": 1, "passed": 1, "failed": 0, "skipped": 0},
                "topology": {"hosts": 1, "worldSize": 1, "backends": ["gloo"], "devices": ["cpu"]},
                "boundaries": {"validated": ["a"], "notValidated": ["b"]},
                "commands": [],
            }
        )
    )
    facts = load_facts(facts_file, campaign_file=repo / "campaigns" / "quick.toml")
    assert (facts.campaign.name, facts.campaign.tier, facts.result) == ("quick", "cpu", "PASSED")
    facts_file.write_text('{"campaign": {}}')
    with pytest.raises(UsageError, match="campaign.path must be a str"):
        load_facts(facts_file)


def test_the_facts_example_in_the_docs_loads(tmp_path: Path) -> None:
    docs = (REPO_ROOT / "docs" / "evidence.md").read_text()
    example = json.loads(docs.split("```json\n", 1)[1].split("```", 1)[0])
    campaign = tmp_path / "cpu.toml"
    campaign.write_text('name = "cpu"\ntier = "cpu"\n')
    example["campaign"]["path"] = str(campaign)
    facts_file = tmp_path / "facts.json"
    facts_file.write_text(json.dumps(example))
    facts = load_facts(facts_file)
    assert (facts.campaign.name, facts.result, facts.commands[0].log) == (
        "cpu",
        "PASSED",
        "logs/000-unit.log",
    )
