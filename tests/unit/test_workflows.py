"""The GitHub workflows cannot run here, so their security-relevant shape is checked as data: least privilege, the
signing identity confined to one hosted job, the GPU runner reachable only by schedule or a maintainer's dispatch,
and evidence artifacts named by commit."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from qualification import campaign as campaigns
from qualification.engine import unmet_requirement
from qualification.evidence.cli import _parser as evidence_parser

pytestmark = pytest.mark.timeout(30)
WORKFLOWS = Path(__file__).resolve().parents[2] / ".github" / "workflows"
CI, GPU = "ci.yml", "gpu-qualification.yml"
GPU_LABELS = ["self-hosted", "linux", "gpu", "gpus-2"]


def load(name: str) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((WORKFLOWS / name).read_text())
    # YAML 1.1 reads the bare key `on` as the boolean True.
    document["on"] = document.pop(True, document.get("on"))
    return document


def steps(workflow: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (job_id, step) for job_id, job in workflow["jobs"].items() for step in job.get("steps", [])
    ]


def runs(workflow: dict[str, Any], job_id: str) -> str:
    return "\n".join(step.get("run", "") for step in workflow["jobs"][job_id]["steps"])


@pytest.fixture(params=[CI, GPU])
def workflow(request: pytest.FixtureRequest) -> dict[str, Any]:
    return load(request.param)


def test_top_level_permissions_are_read_only(workflow: dict[str, Any]) -> None:
    assert workflow["permissions"] == {"contents": "read"}


def test_only_the_sign_job_can_mint_an_oidc_token(workflow: dict[str, Any]) -> None:
    with_token = [
        job_id
        for job_id, job in workflow["jobs"].items()
        if (job.get("permissions") or {}).get("id-token") == "write"
    ]
    assert with_token == ["sign"]
    for job_id, job in workflow["jobs"].items():
        granted = job.get("permissions") or {}
        writes = {scope for scope, level in granted.items() if level == "write"}
        assert writes <= ({"id-token"} if job_id == "sign" else set()), (job_id, granted)
    sign = workflow["jobs"]["sign"]
    assert sign["runs-on"] == "ubuntu-latest"  # never the self-hosted runner
    assert sign["permissions"] == {"contents": "read", "id-token": "write"}


def test_the_sign_job_signs_keyless_with_a_command_the_cli_accepts(
    workflow: dict[str, Any],
) -> None:
    signing = [
        line.strip()
        for line in runs(workflow, "sign").splitlines()
        if line.strip().startswith("validation-evidence sign")
    ]
    assert len(signing) == 1
    argv = shlex.split(signing[0].replace('"$BUNDLE"', "bundle"))[1:]
    args = evidence_parser().parse_args(argv)
    assert (args.command, args.sign) == ("sign", "sigstore")
    verify = runs(workflow, "sign")
    assert "validation-evidence verify" in verify and '--expected-commit "$GITHUB_SHA"' in verify
    assert "--require-signature" in verify and "--cert-identity" in verify


def test_evidence_artifacts_are_named_by_commit(workflow: dict[str, Any]) -> None:
    artifacts = [
        (job_id, step["with"]["name"])
        for job_id, step in steps(workflow)
        if step.get("uses", "").startswith(
            ("actions/upload-artifact@", "actions/download-artifact@")
        )
    ]
    assert artifacts, "no artifact steps"
    for job_id, name in artifacts:
        assert "${{ github.sha }}" in name, (job_id, name)
    evidence = {
        job_id for job_id, name in artifacts if name == "qualification-evidence-${{ github.sha }}"
    }
    assert "sign" in evidence and len(evidence) == 2  # uploaded by the run, re-uploaded signed


def test_actions_are_pinned_by_major_version(workflow: dict[str, Any]) -> None:
    for job_id, step in steps(workflow):
        if "uses" in step:
            assert re.fullmatch(r"actions/[a-z-]+@v\d+", step["uses"]), (job_id, step["uses"])


def test_every_job_has_a_timeout(workflow: dict[str, Any]) -> None:
    for job_id, job in workflow["jobs"].items():
        assert 0 < job["timeout-minutes"] <= 120, job_id


def test_ci_runs_on_push_and_pull_request_and_qualifies_the_cpu_matrix() -> None:
    ci = load(CI)
    assert set(ci["on"]) == {"push", "pull_request"}
    assert {"lint", "types", "tests", "sign"} <= set(ci["jobs"])
    tests = runs(ci, "tests")
    assert 'qualify run cpu-matrix --out "$BUNDLE"' in tests
    assert (
        ci["jobs"]["tests"]["env"]["BUNDLE"] == "evidence/qualification-evidence-${{ github.sha }}"
    )
    assert (
        ci["jobs"]["tests"]["env"]["PIP_EXTRA_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    )
    # One package index in the job that holds the token.
    assert (
        "PIP_EXTRA_INDEX_URL" not in ci["env"]
        and "PIP_EXTRA_INDEX_URL" not in ci["jobs"]["sign"]["env"]
    )
    assert ci["jobs"]["sign"]["needs"] == "tests"


def test_gpu_workflow_runs_only_on_schedule_or_dispatch() -> None:
    gpu = load(GPU)
    assert set(gpu["on"]) == {
        "schedule",
        "workflow_dispatch",
    }  # never pull_request: no PR code on the runner
    assert gpu["on"]["schedule"] and all("cron" in entry for entry in gpu["on"]["schedule"])


def test_gpu_runner_is_reached_only_through_the_maintainer_gate() -> None:
    gpu = load(GPU)
    jobs = gpu["jobs"]
    self_hosted = [job_id for job_id, job in jobs.items() if "self-hosted" in job["runs-on"]]
    assert self_hosted == ["qualify"]
    assert jobs["qualify"]["runs-on"] == GPU_LABELS
    assert jobs["qualify"]["needs"] == "authorize"
    assert jobs["authorize"]["runs-on"] == "ubuntu-latest"
    gate = jobs["authorize"]["steps"][0]
    assert gate["env"]["MAINTAINERS"] == "${{ vars.GPU_MAINTAINERS }}"
    assert gate["env"]["ACTOR"] == "${{ github.actor }}"
    assert gate["env"]["TRIGGERING_ACTOR"] == "${{ github.triggering_actor }}"
    qualify = runs(gpu, "qualify")
    assert "pytest tests/gpu -m gpu" in qualify and "qualify run gpu-qualification" in qualify
    assert jobs["sign"]["needs"] == "qualify"


def test_gpu_campaign_cells_all_require_a_gpu() -> None:
    loaded = campaigns.load(campaigns.REPO_ROOT / "campaigns" / "gpu-qualification.toml")
    assert loaded.tier == "gpu" and loaded.cells
    assert all("gpu" in cell.requires for cell in loaded.cells)
    assert any(
        "NCCL/CUDA training cells arrive with the GPU tier" in line for line in loaded.not_validated
    )
    if (
        unmet_requirement("gpu") is not None
    ):  # on a CPU machine every cell is skipped, never run and failed
        assert all(unmet_requirement(r) for cell in loaded.cells for r in cell.requires)
