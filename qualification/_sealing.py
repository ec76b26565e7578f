"""Translate a run's ``summary.json`` into the evidence package's ``SealInput``.

The summary is the engine's record of what ran; sealing needs the same facts typed. Keeping the translation here
(rather than inside ``qualify run``) lets ``qualify seal DIR`` seal a run directory later from its summary alone.
"""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path
from typing import Any

from qualification.evidence.facts import (
    BackedClaim,
    Boundaries,
    CampaignRef,
    CommandRecord,
    Scope,
    SealInput,
    Summary,
    Topology,
    UnbackedClaim,
)


def seal_input(out_dir: Path, summary: dict[str, Any]) -> SealInput:
    """The seal facts of the run in ``out_dir`` described by ``summary``; CI facts come from GitHub's variables."""
    if (
        not isinstance(summary, dict)
        or summary.get("summary_version") != 2
        or not isinstance(summary.get("cells"), list)
    ):
        from qualification.errors import UsageError

        version = summary.get("summary_version") if isinstance(summary, dict) else None
        raise UsageError(
            f"{out_dir / 'summary.json'} is not a summary this qualify can seal (summary_version "
            f"{version!r}, expected 2: it records the run's scope); re-run the campaign"
        )
    cells = summary["cells"]
    commands = tuple(
        CommandRecord(
            id=cell["id"],
            argv=tuple(cell["argv"]),
            cwd=cell["cwd"],
            started_on=datetime.fromisoformat(cell["started_at"]),
            finished_on=datetime.fromisoformat(cell["finished_at"]),
            exit_code=cell["exit_code"],
            log=cell["log"],
        )
        for cell in cells
        if cell["exit_code"]
        is not None  # skipped cells and programs that do not exist ran no command
    )
    counts = summary["counts"]
    ran = [c["cell"] for c in cells if c["verdict"] != "skipped"] or [c["cell"] for c in cells]
    # Backends and devices are those of the cells that ran, not of the tier: a GPU-tier campaign whose cells train on
    # CPU over gloo must not claim NCCL.
    backends = tuple(sorted({str((c.get("params") or {}).get("backend", "gloo")) for c in ran}))
    gpu = any(str((c.get("params") or {}).get("device", "cpu")).startswith("cuda") for c in ran)
    return SealInput(
        campaign=CampaignRef(
            name=summary["campaign"]["name"],
            tier=summary["campaign"]["tier"],
            path=_campaign_file(out_dir, summary),
        ),
        commands=commands,
        summary=Summary(
            total=counts["total"],
            passed=counts["passed"],
            failed=counts["failed"],
            skipped=counts["skipped"],
            measured=counts.get("measured", 0),
        ),
        topology=Topology(
            hosts=1,
            world_size=max((c["world_size"] for c in ran), default=1),
            backends=backends,
            devices=_cuda_devices() if gpu else ("cpu",),
        ),
        boundaries=_boundaries(summary["boundaries"]),
        scope=_scope(summary.get("scope")),
        started_on=datetime.fromisoformat(summary["started_at"]),
        finished_on=datetime.fromisoformat(summary["finished_at"]),
        **_ci_facts(),
    )


def _boundaries(raw: dict[str, Any]) -> Boundaries:
    """The claims as the engine evaluated them (summary v2); a v1 summary's plain strings are left to sealing,
    which binds them to the run's commands."""
    validated = tuple(
        BackedClaim(claim=c["claim"], backed_by=tuple(c["backed_by"])) if isinstance(c, dict) else c
        for c in raw["validated"]
    )
    not_validated = tuple(
        UnbackedClaim(claim=c["claim"], reason=c["reason"]) if isinstance(c, dict) else c
        for c in raw["not_validated"]
    )
    return Boundaries(validated=validated, not_validated=not_validated)


def _scope(raw: dict[str, Any] | None) -> Scope | None:
    if raw is None:
        return None
    return Scope(
        cells_in_campaign=raw["cells_in_campaign"],
        campaign_cells_run=raw["campaign_cells_run"],
        cells_run=raw["cells_run"],
        filter=raw["filter"],
        seed_override=raw["seed_override"],
    )


def _campaign_file(out_dir: Path, summary: dict[str, Any]) -> Path:
    """The campaign's own path when it still holds the bytes that ran (it reads better), else the run's copy."""
    copy = out_dir / summary["campaign"]["file"]
    source = Path(summary["campaign"]["source_path"])
    if source.is_file() and source.read_bytes() == copy.read_bytes():
        return source
    return copy


def _cuda_devices() -> tuple[str, ...]:
    from qualification.engine import unmet_requirement

    if unmet_requirement("gpu") is not None:
        return ("cpu",)
    import torch

    return tuple(f"cuda:{i}" for i in range(torch.cuda.device_count()))


def _ci_facts() -> dict[str, Any]:
    """Trigger, runner, invocation id and run URL from GitHub Actions' variables; ``local`` elsewhere."""
    env = os.environ
    if env.get("GITHUB_ACTIONS") != "true":
        return {}
    from qualification.evidence.facts import TRIGGERS

    facts: dict[str, Any] = {}
    event = env.get("GITHUB_EVENT_NAME", "")
    if event in TRIGGERS:
        facts["trigger"] = event
    facts["runner"] = (
        "github-hosted" if env.get("RUNNER_ENVIRONMENT") == "github-hosted" else "self-hosted"
    )
    server, repo, run_id = (
        env.get("GITHUB_SERVER_URL"),
        env.get("GITHUB_REPOSITORY"),
        env.get("GITHUB_RUN_ID"),
    )
    if server and repo and run_id:
        facts["run_url"] = f"{server}/{repo}/actions/runs/{run_id}"
        facts["invocation_id"] = f"{facts['run_url']}/attempts/{env.get('GITHUB_RUN_ATTEMPT', '1')}"
    return facts
