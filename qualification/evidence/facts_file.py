"""Reading run facts from a JSON facts file: the CLI's ``seal --facts``.

:func:`load_facts` turns the document (keys are the manifest's camelCase names, see docs/evidence.md) into a
:class:`~qualification.evidence.facts.SealInput`; a missing or mistyped key raises :class:`UsageError` naming the file
and the key, never a ``KeyError``.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from qualification.errors import UsageError
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


def load_facts(path: Path, *, campaign_file: Path | None = None) -> SealInput:
    """Read :class:`SealInput` from the JSON file at ``path`` (see docs/evidence.md for the shape).

    ``campaign_file`` replaces ``campaign.path``. A campaign name or tier missing from the facts is read from the
    campaign file's top-level ``name`` and ``tier`` keys. Raises :class:`UsageError` naming the file and the key.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"cannot read facts file {path}: {exc.strerror}") from exc
    except ValueError as exc:
        raise UsageError(f"facts file {path} is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise UsageError(f"facts file {path} is nested too deeply to be run facts") from exc
    reader = _Reader(path)
    campaign = reader.get(data, "campaign", dict)
    campaign_path = campaign_file or Path(reader.get(campaign, "path", str, "campaign."))
    name, tier = campaign.get("name"), campaign.get("tier")
    if not (name and tier):
        declared = _read_toml(campaign_path)
        name, tier = name or declared.get("name"), tier or declared.get("tier")
    summary = reader.get(data, "summary", dict)
    topology = reader.get(data, "topology", dict)
    boundaries = reader.get(data, "boundaries", dict)
    return SealInput(
        campaign=CampaignRef(name=str(name or ""), tier=str(tier or ""), path=campaign_path),
        commands=tuple(
            CommandRecord(
                id=reader.get(c, "id", str, "commands[]."),
                argv=tuple(reader.get(c, "argv", list, "commands[].")),
                cwd=reader.get(c, "cwd", str, "commands[]."),
                started_on=reader.time(c, "startedOn", "commands[]."),
                finished_on=reader.time(c, "finishedOn", "commands[]."),
                exit_code=reader.get(c, "exitCode", int, "commands[]."),
                log=reader.get(c, "log", str, "commands[]."),
            )
            for c in reader.get(data, "commands", list)
        ),
        summary=Summary(
            **{
                k: reader.get(summary, k, int, "summary.")
                for k in ("total", "passed", "failed", "skipped")
            },
            measured=reader.get(summary, "measured", int, "summary.")
            if "measured" in summary
            else 0,
        ),
        topology=Topology(
            hosts=reader.get(topology, "hosts", int, "topology."),
            world_size=reader.get(topology, "worldSize", int, "topology."),
            backends=tuple(reader.get(topology, "backends", list, "topology.")),
            devices=tuple(reader.get(topology, "devices", list, "topology.")),
        ),
        boundaries=Boundaries(
            validated=tuple(
                reader.claim(item, "validated")
                for item in reader.get(boundaries, "validated", list, "boundaries.")
            ),
            not_validated=tuple(
                reader.claim(item, "notValidated")
                for item in reader.get(boundaries, "notValidated", list, "boundaries.")
            ),
        ),
        scope=reader.scope(data.get("scope")),
        started_on=reader.time(data, "startedOn"),
        finished_on=reader.time(data, "finishedOn"),
        trigger=data.get("trigger", "local"),
        runner=data.get("runner", "local"),
        invocation_id=data.get("invocationId"),
        artifact_name=data.get("artifactName"),
        run_url=data.get("runUrl"),
    )


class _Reader:
    """Typed lookups in a facts document that fail with the file and the key, never a KeyError."""

    def __init__(self, path: Path) -> None:
        self._path = path

    def get(self, data: Any, key: str, kind: type, where: str = "") -> Any:
        value = data.get(key) if isinstance(data, Mapping) else None
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise UsageError(f"facts file {self._path}: {where}{key} must be a {kind.__name__}")
        return value

    def claim(self, item: Any, where: str) -> Any:
        """A boundary: a plain string, or ``{"claim", "backedBy"}`` / ``{"claim", "reason"}`` as the manifest has."""
        if isinstance(item, str):
            return item
        text = self.get(item, "claim", str, f"boundaries.{where}[].")
        if where == "validated":
            backed = self.get(item, "backedBy", list, "boundaries.validated[].")
            return BackedClaim(claim=text, backed_by=tuple(str(cell) for cell in backed))
        return UnbackedClaim(
            claim=text, reason=self.get(item, "reason", str, "boundaries.notValidated[].")
        )

    def scope(self, data: Any) -> Scope | None:
        if data is None:
            return None
        seed = data.get("seedOverride") if isinstance(data, Mapping) else None
        filter_expr = data.get("filter") if isinstance(data, Mapping) else None
        if (seed is not None and not isinstance(seed, int)) or (
            filter_expr is not None and not isinstance(filter_expr, str)
        ):
            raise UsageError(
                f"facts file {self._path}: scope.seedOverride must be an int, scope.filter a string"
            )
        return Scope(
            cells_in_campaign=self.get(data, "cellsInCampaign", int, "scope."),
            campaign_cells_run=self.get(data, "campaignCellsRun", int, "scope."),
            cells_run=self.get(data, "cellsRun", int, "scope."),
            filter=filter_expr,
            seed_override=seed,
        )

    def time(self, data: Any, key: str, where: str = "") -> datetime:
        text = self.get(data, key, str, where)
        try:
            value = datetime.fromisoformat(text)
        except ValueError as exc:
            raise UsageError(
                f"facts file {self._path}: {where}{key} is not an RFC 3339 time: {text!r}"
            ) from exc
        if value.tzinfo is None:
            raise UsageError(
                f"facts file {self._path}: {where}{key} has no timezone (end it with Z)"
            )
        return value.astimezone(UTC)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except OSError as exc:
        raise UsageError(f"cannot read campaign file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"campaign file {path} is not valid TOML: {exc}") from exc
