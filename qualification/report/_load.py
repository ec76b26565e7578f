"""Read a run directory or sealed bundle into one :class:`RunRecord`, whatever subset of files it has.

Three shapes reach the report: an unsealed run (``summary.json`` + ``campaign.toml`` + cells), a sealed run (the same
plus ``manifest.json``) and a bundle sealed by ``validation-evidence seal`` from facts (``manifest.json`` only, its
commands standing in for cells). Where both exist, the manifest is preferred for what it records (commit, result,
times, environment, boundaries), because it is the document a verifier checks; cells always come from
``summary.json``. Every file is untrusted input: shapes are checked as they are read and text is never marked safe.
"""

from __future__ import annotations

import json
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qualification.errors import UsageError
from qualification.evidence.manifest import MANIFEST_NAME

SUMMARY_NAME = "summary.json"
CAMPAIGN_NAME = "campaign.toml"


@dataclass(frozen=True, slots=True, kw_only=True)
class RunRecord:
    """What the report shows, normalised from whichever files the directory holds."""

    source: Path
    sealed: bool
    campaign: dict[str, Any]
    result: str
    """PASSED, FAILED or SKIPPED (nothing ran)."""
    counts: dict[str, int]
    commit: str | None
    dirty: bool | None
    ref: str | None
    started_at: str | None
    finished_at: str | None
    duration_s: float | None
    validated: list[dict[str, Any]]
    """``{"claim", "backed_by"}``: the claims this run backs (``backed_by`` empty when the record names no cells)."""
    not_validated: list[dict[str, Any]]
    """``{"claim", "reason"}``: every other boundary, and why."""
    scope: dict[str, Any] | None
    """The manifest's camelCase scope (from summary.json when unsealed); None when the record has none."""
    environment: list[tuple[str, str]]
    cells: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)


def _json_file(path: Path) -> dict[str, Any]:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path} cannot be read as JSON: {exc}") from exc
    except RecursionError as exc:
        raise UsageError(f"{path} is nested too deeply to be a run record") from exc
    if not isinstance(document, dict):
        raise UsageError(f"{path} is not a JSON object")
    return document


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _strings(value: Any) -> list[str]:
    return [str(item) for item in value] if isinstance(value, list) else []


def _inside(root: Path, relative: Any) -> Path | None:
    """``root / relative`` if it is a file that stays inside ``root``; a summary must not point the report elsewhere."""
    if not isinstance(relative, str) or not relative:
        return None
    path = (root / relative).resolve()
    return path if path.is_relative_to(root.resolve()) and path.is_file() else None


def load_run(source: Path) -> RunRecord:
    """Read ``source``; raises :class:`UsageError` when it is not a directory with a summary or a manifest."""
    if not source.is_dir():
        raise UsageError(
            f"{source} is not a directory; give a run directory or a sealed bundle directory"
        )
    summary_path, manifest_path = source / SUMMARY_NAME, source / MANIFEST_NAME
    if not summary_path.is_file() and not manifest_path.is_file():
        raise UsageError(
            f"{source} has neither {SUMMARY_NAME} nor {MANIFEST_NAME}; is it a `qualify run` directory?"
        )
    summary = _json_file(summary_path) if summary_path.is_file() else None
    manifest = _json_file(manifest_path) if manifest_path.is_file() else None
    predicate = _dict(manifest.get("predicate")) if manifest else {}
    campaign_file = _campaign_file(source / CAMPAIGN_NAME)

    notes = []
    if summary is not None:
        cells = [
            _summary_cell(source, raw)
            for raw in summary.get("cells") or []
            if isinstance(raw, dict)
        ]
        counts = _counts(_dict(summary.get("counts")))
        summary_result = str(summary.get("verdict", "")).upper() or "FAILED"
    else:
        cells = [
            _command_cell(raw) for raw in predicate.get("commands") or [] if isinstance(raw, dict)
        ]
        counts = _counts(_dict(predicate.get("summary")))
        summary_result = ""
    result = str(predicate.get("result") or summary_result or "FAILED")
    if summary_result and predicate.get("result") and summary_result != result:
        notes.append(
            f"summary.json says {summary_result} but the manifest records {result}; the manifest is shown"
        )

    source_facts, run = _dict(predicate.get("source")), _dict(predicate.get("run"))
    summary = summary or {}
    boundaries = (
        _dict(predicate.get("boundaries"))
        or _dict(summary.get("boundaries"))
        or _dict(campaign_file.get("boundaries"))
    )
    duration = summary.get("duration_s")
    return RunRecord(
        source=source,
        sealed=manifest is not None,
        campaign=_campaign(summary, predicate, campaign_file),
        result=result,
        counts=counts,
        commit=_dict(source_facts.get("digest")).get("gitCommit"),
        dirty=source_facts.get("dirty") if manifest else None,
        ref=source_facts.get("ref"),
        started_at=run.get("startedOn") or summary.get("started_at"),
        finished_at=run.get("finishedOn") or summary.get("finished_at"),
        duration_s=float(duration) if isinstance(duration, int | float) else None,
        validated=_validated(boundaries.get("validated")),
        not_validated=_not_validated(
            boundaries.get("notValidated", boundaries.get("not_validated"))
        ),
        scope=_scope(predicate.get("scope") if manifest else summary.get("scope")),
        environment=_environment(predicate)
        if manifest
        else _invocation(_dict(summary.get("invocation"))),
        cells=cells,
        notes=notes,
    )


def _validated(raw: Any) -> list[dict[str, Any]]:
    """Claim records from any recorded shape: manifest 1.1 (``backedBy``), summary v2 (``backed_by``), a plain string
    (manifest 1.0, summary v1), or a campaign table (``cells``)."""
    claims = []
    for item in raw if isinstance(raw, list) else []:
        if isinstance(item, str):
            claims.append({"claim": item, "backed_by": []})
        elif isinstance(item, dict):
            backing = item.get("backedBy", item.get("backed_by", item.get("cells")))
            claims.append({"claim": str(item.get("claim", "")), "backed_by": _strings(backing)})
    return claims


def _not_validated(raw: Any) -> list[dict[str, Any]]:
    claims = []
    for item in raw if isinstance(raw, list) else []:
        if isinstance(item, str):
            claims.append({"claim": item, "reason": ""})
        elif isinstance(item, dict):
            claims.append(
                {"claim": str(item.get("claim", "")), "reason": str(item.get("reason", ""))}
            )
    return claims


def _scope(raw: Any) -> dict[str, Any] | None:
    """The scope in the manifest's camelCase, from either record (summary.json writes snake_case)."""
    if not isinstance(raw, dict):
        return None
    names = {
        "cells_in_campaign": "cellsInCampaign",
        "campaign_cells_run": "campaignCellsRun",
        "cells_run": "cellsRun",
        "seed_override": "seedOverride",
    }
    return {names.get(key, key): value for key, value in raw.items()}


def _campaign_file(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return {}  # the summary and manifest carry what the report needs; a broken copy only loses a fallback


def _campaign(
    summary: dict[str, Any], predicate: dict[str, Any], campaign_file: dict[str, Any]
) -> dict[str, Any]:
    from_summary, from_manifest = _dict(summary.get("campaign")), _dict(predicate.get("campaign"))
    merged = {**campaign_file, **from_summary, **from_manifest}
    return {
        "name": str(merged.get("name") or "unnamed campaign"),
        "tier": str(merged.get("tier") or "?"),
        "description": str(merged.get("description") or ""),
        "path": str(from_manifest.get("path") or from_summary.get("source_path") or ""),
    }


def _counts(raw: dict[str, Any]) -> dict[str, int]:
    return {
        key: int(raw[key]) if isinstance(raw.get(key), int) else 0
        for key in ("total", "passed", "failed", "skipped", "measured")
    }


def _summary_cell(root: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """One summary record, with the program's own ``result.json`` filling any result field the summary lacks."""
    cell_id = str(raw.get("id", "?"))
    result_path = _inside(root, raw.get("result"))
    if result_path is not None and any(
        key not in raw for key in ("observed", "metrics", "timeline", "message")
    ):
        try:
            raw = {**json.loads(result_path.read_text(encoding="utf-8")), **raw}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            pass  # the engine already judged this file; the verdict and reason say what was wrong with it
    spec = _dict(raw.get("cell"))
    return {
        "id": cell_id,
        "campaign": cell_id.split("/", 1)[0] if "/" in cell_id else "",
        "name": cell_id.split("/", 1)[-1],
        "verdict": str(raw.get("verdict", "failed")),
        "reason": str(raw.get("reason") or ""),
        "duration_s": raw.get("duration_s")
        if isinstance(raw.get("duration_s"), int | float)
        else None,
        "exit_code": raw.get("exit_code") if isinstance(raw.get("exit_code"), int) else None,
        "timed_out": raw.get("timed_out") is True,
        "swept": len(raw.get("swept_pids") or []),
        "topology": str(spec.get("topology", "")),
        "world_size": spec.get("world_size"),
        "fault": _fault_label(_dict(spec.get("fault"))),
        "seed": spec.get("seed"),
        "expect": _dict(spec.get("expect")),
        "scope": {
            "params": _dict(spec.get("params")),
            "fault": _dict(spec.get("fault")),
            "cell": {"world_size": spec.get("world_size"), "seed": spec.get("seed")},
        },
        "observed": _dict(raw.get("observed")),
        "metrics": _dict(raw.get("metrics")),
        "timeline": _timeline(raw.get("timeline")),
        "message": str(raw.get("message") or ""),
        "log": str(raw.get("log") or ""),
        "targets": [t for t in raw.get("targets") or [] if isinstance(t, dict)],
    }


def _fault_label(fault: dict[str, Any]) -> str:
    """``sigkill (rank=1, step=4)`` from a fault table; ``none`` stays ``none``."""
    details = ", ".join(f"{key}={value}" for key, value in fault.items() if key != "kind")
    kind = str(fault.get("kind", ""))
    return f"{kind} ({details})" if details else kind


def _command_cell(raw: dict[str, Any]) -> dict[str, Any]:
    """A manifest command as a cell, for bundles sealed from facts (they have commands, not cells)."""
    code = raw.get("exitCode")
    argv = raw.get("argv")
    return {
        "id": str(raw.get("id", "?")),
        "campaign": "",
        "name": str(raw.get("id", "?")),
        "verdict": "passed" if code == 0 else "failed",
        "reason": f"exit code {code}: {shlex.join(str(a) for a in argv) if isinstance(argv, list) else ''}",
        "duration_s": None,
        "exit_code": code if isinstance(code, int) else None,
        "timed_out": False,
        "swept": 0,
        "topology": "",
        "world_size": None,
        "fault": "",
        "seed": None,
        "expect": {},
        "scope": {},
        "observed": {},
        "metrics": {},
        "timeline": [],
        "message": "",
        "log": str(raw.get("log") or ""),
        "targets": [],
    }


def _timeline(raw: Any) -> list[dict[str, Any]]:
    events = []
    for item in raw if isinstance(raw, list) else []:
        if (
            isinstance(item, dict)
            and isinstance(item.get("t"), int | float)
            and not isinstance(item.get("t"), bool)
        ):
            rank = item.get("rank")
            events.append(
                {
                    "t": float(item["t"]),
                    "event": str(item.get("event", "")),
                    "detail": str(item.get("detail", "")),
                    "rank": rank if isinstance(rank, int) and not isinstance(rank, bool) else None,
                }
            )
    return sorted(events, key=lambda e: e["t"])


def _environment(predicate: dict[str, Any]) -> list[tuple[str, str]]:
    env, topo = _dict(predicate.get("environment")), _dict(predicate.get("topology"))
    package, run, artifact = (
        _dict(predicate.get("package")),
        _dict(predicate.get("run")),
        _dict(predicate.get("artifact")),
    )
    cpu = _dict(env.get("cpu"))
    gpus = [
        f"{g.get('index')}: {g.get('name')} ({g.get('memoryMiB')} MiB)"
        for g in env.get("gpus") or []
        if isinstance(g, dict)
    ]
    variables = _dict(env.get("variables"))
    return [
        ("python", f"{env.get('python')} ({env.get('implementation')})"),
        ("platform", str(env.get("platform"))),
        ("torch", str(env.get("torch") or "not installed")),
        ("cpu", f"{cpu.get('count')} × {cpu.get('model')}"),
        ("gpus", "; ".join(gpus) or "none"),
        (
            "topology",
            f"{topo.get('hosts')} host(s), world size {topo.get('worldSize')}, backends "
            f"{', '.join(_strings(topo.get('backends'))) or '-'}, devices "
            f"{', '.join(_strings(topo.get('devices'))) or '-'}",
        ),
        (
            "variables",
            " ".join(f"{k}={v}" for k, v in sorted(variables.items())) or "none recorded",
        ),
        ("package", f"{package.get('name')} {package.get('version')}"),
        (
            "run",
            f"trigger {run.get('trigger')}, runner {run.get('runner')}, invocation {run.get('invocationId')}",
        ),
        (
            "artifact",
            f"{artifact.get('name')}"
            + (f" ({artifact['runUrl']})" if artifact.get("runUrl") else ""),
        ),
    ]


def _invocation(invocation: dict[str, Any]) -> list[tuple[str, str]]:
    argv = invocation.get("argv")
    rows = [
        ("command", shlex.join(str(a) for a in argv) if isinstance(argv, list) else "?"),
        ("cwd", str(invocation.get("cwd", "?"))),
    ]
    rows += [
        (key, str(invocation[key]))
        for key in ("jobs", "filter", "seed_override", "grace_s")
        if invocation.get(key) is not None
    ]
    return rows + [
        (
            "inventory",
            "not recorded: python, platform, torch and hardware are recorded when the run is "
            "sealed (`qualify seal DIR`)",
        )
    ]
