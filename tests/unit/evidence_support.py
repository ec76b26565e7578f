"""Builders shared by the evidence tests: a throwaway git repo, a payload, run facts, and manifest surgery."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from qualification.evidence import (
    Boundaries,
    CampaignRef,
    CommandRecord,
    SealInput,
    Summary,
    Topology,
)
from qualification.evidence.manifest import MANIFEST_NAME, canonical_bytes

T0 = datetime(2026, 8, 13, 10, 0, tzinfo=UTC)
# A GIT_DIR inherited from a git hook would aim every command at the wrong repository.
_ENV = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
_GIT_IDENTITY = (
    "-c",
    "user.name=Evidence Test",
    "-c",
    "user.email=evidence@test.invalid",
    "-c",
    "commit.gpgsign=false",
)


def git(repo: Path, *args: str) -> str:
    """Run git in ``repo`` with a fixed identity; return stripped stdout. Raises on failure."""
    done = subprocess.run(
        ["git", *_GIT_IDENTITY, "-C", str(repo), *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
        env=_ENV,
    )
    return done.stdout.strip()


def make_repo(root: Path) -> tuple[Path, str]:
    """A repo on branch main with one commit holding ``campaigns/quick.toml``; returns (repo, commit)."""
    repo = root / "repo"
    (repo / "campaigns").mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    (repo / "campaigns" / "quick.toml").write_text('name = "quick"\ntier = "cpu"\n')
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "campaign")
    return repo, git(repo, "rev-parse", "HEAD")


def add_commit(repo: Path, name: str = "change.txt") -> str:
    """Commit one new file on the current branch; returns the new commit."""
    (repo / name).write_text(f"{name}\n")
    git(repo, "add", name)
    git(repo, "commit", "-q", "-m", f"add {name}")
    return git(repo, "rev-parse", "HEAD")


def make_payload(root: Path) -> Path:
    """A payload directory with two command logs and a report in a subfolder."""
    bundle = root / "bundle"
    (bundle / "logs").mkdir(parents=True)
    (bundle / "reports").mkdir()
    (bundle / "logs" / "000-unit.log").write_text("collected 3 items\n3 passed\n")
    (bundle / "logs" / "001-dist.log").write_text("rank 0 ok\nrank 1 ok\n")
    (bundle / "reports" / "cells.json").write_text('{"cells": 3}\n')
    return bundle


def make_facts(
    repo: Path, *, exit_codes: tuple[int, int] = (0, 0), failed: int = 0, **overrides: Any
) -> SealInput:
    """Run facts for the payload of :func:`make_payload`; ``overrides`` replace SealInput fields."""
    commands = tuple(
        CommandRecord(
            id=f"00{i}",
            argv=("python", "-m", "pytest", f"tests/{kind}"),
            cwd=".",
            started_on=T0 + timedelta(minutes=2 * i + 1),
            finished_on=T0 + timedelta(minutes=2 * i + 2),
            exit_code=exit_codes[i],
            log=f"logs/00{i}-{kind}.log",
        )
        for i, kind in enumerate(("unit", "dist"))
    )
    fields: dict[str, Any] = {
        "campaign": CampaignRef(name="quick", tier="cpu", path=repo / "campaigns" / "quick.toml"),
        "commands": commands,
        "summary": Summary(total=3, passed=3 - failed, failed=failed, skipped=0),
        "topology": Topology(hosts=1, world_size=2, backends=("gloo",), devices=("cpu", "cpu")),
        "boundaries": Boundaries(
            validated=("two-rank gloo recovery",), not_validated=("NCCL", "RDMA")
        ),
        "started_on": T0,
        "finished_on": T0 + timedelta(minutes=10),
    }
    fields.update(overrides)
    return SealInput(**fields)


def rewrite_manifest(bundle: Path, mutate: Callable[[dict[str, Any]], None]) -> None:
    """Load manifest.json, let ``mutate`` edit it in place, write it back canonically."""
    path = bundle / MANIFEST_NAME
    document = json.loads(path.read_bytes())
    mutate(document)
    path.write_bytes(canonical_bytes(document))
