"""The run facts the engine hands to :func:`~qualification.evidence.seal.seal_bundle`.

Each is a frozen dataclass, valid from construction: a bad value raises :class:`UsageError` naming the field, so an
inconsistent record never reaches a manifest. :func:`~qualification.evidence.facts_file.load_facts` reads the
same facts from JSON (for the CLI's ``seal --facts``); its keys are the manifest's camelCase names.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from qualification.errors import UsageError
from qualification.evidence.manifest import RESERVED_NAMES, path_problem

TRIGGERS = ("local", "push", "pull_request", "schedule", "workflow_dispatch", "release")


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise UsageError(f"seal input: {field} {message}")


def _aware(value: datetime, field: str) -> None:
    _require(
        isinstance(value, datetime) and value.tzinfo is not None,
        field,
        "must be a timezone-aware datetime",
    )


def timestamp(value: datetime) -> str:
    """RFC 3339 UTC with milliseconds and a trailing ``Z``, as in-toto requires. Truncation keeps order."""
    return value.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(kw_only=True, slots=True, frozen=True)
class CampaignRef:
    """The campaign that ran."""

    name: str
    """Campaign name, as in the campaign file."""
    tier: str
    """Qualification tier, e.g. ``cpu``, ``gpu-frequent``, ``release``."""
    path: Path
    """The campaign file; its SHA-256 is recorded so the exact matrix can be identified later."""

    def __post_init__(self) -> None:
        _require(bool(self.name) and bool(self.tier), "campaign.name/tier", "must be non-empty")
        _require(self.path.is_file(), "campaign.path", f"{self.path} is not a file")


@dataclass(kw_only=True, slots=True, frozen=True)
class CommandRecord:
    """One command the run executed, exactly as executed."""

    id: str
    """Stable id, unique within the run, e.g. ``000-cpu-matrix``."""
    argv: tuple[str, ...]
    """The argument vector, unexpanded by any shell."""
    cwd: str
    """Working directory (as the engine saw it)."""
    started_on: datetime
    finished_on: datetime
    exit_code: int
    log: str
    """Bundle-relative POSIX path of this command's stdout+stderr log; must exist in the bundle when sealing."""

    def __post_init__(self) -> None:
        where = f"commands[{self.id!r}]"
        _require(bool(self.id), f"{where}.id", "must be non-empty")
        _require(len(self.argv) > 0, f"{where}.argv", "must name a program")
        problem = path_problem(self.log)
        _require(problem is None, f"{where}.log", f"{self.log!r} {problem}")
        _require(self.log not in RESERVED_NAMES, f"{where}.log", f"{self.log!r} is a reserved name")
        _aware(self.started_on, f"{where}.started_on")
        _aware(self.finished_on, f"{where}.finished_on")
        _require(self.started_on <= self.finished_on, f"{where}.started_on", "is after finished_on")


@dataclass(kw_only=True, slots=True, frozen=True)
class Summary:
    """Cell counts; ``total`` must equal ``passed + failed + skipped + measured``."""

    total: int
    passed: int
    failed: int
    skipped: int
    measured: int = 0
    """Measurement cells (benchmarks, overhead): read, never counted as passed."""

    def __post_init__(self) -> None:
        counts = (self.total, self.passed, self.failed, self.skipped, self.measured)
        _require(
            all(isinstance(n, int) and n >= 0 for n in counts),
            "summary",
            "counts must be integers >= 0",
        )
        _require(
            self.total == self.passed + self.failed + self.skipped + self.measured,
            "summary.total",
            "!= passed+failed+skipped+measured",
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class Scope:
    """Which part of the campaign ran. ``None`` for a field of :class:`SealInput` means the whole campaign, one
    command per cell (what a facts file that says nothing about scope describes)."""

    cells_in_campaign: int
    campaign_cells_run: int
    cells_run: int
    filter: str | None = None
    seed_override: int | None = None

    def __post_init__(self) -> None:
        counts = (self.cells_in_campaign, self.campaign_cells_run, self.cells_run)
        _require(
            all(isinstance(n, int) and n >= 0 for n in counts),
            "scope",
            "counts must be integers >= 0",
        )
        _require(
            self.campaign_cells_run <= min(self.cells_in_campaign, self.cells_run),
            "scope.campaign_cells_run",
            "exceeds the cells in the campaign or the cells run",
        )
        _require(
            self.filter is None or bool(self.filter), "scope.filter", "must be None or non-empty"
        )

    @property
    def complete(self) -> bool:
        return (
            self.filter is None
            and self.seed_override is None
            and self.campaign_cells_run == self.cells_in_campaign == self.cells_run
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class Topology:
    """What the run was spread over."""

    hosts: int
    world_size: int
    backends: tuple[str, ...]
    """Process-group backends used, e.g. ``("gloo",)``."""
    devices: tuple[str, ...]
    """Devices used, e.g. ``("cpu",)`` or ``("cuda:0", "cuda:1")``."""

    def __post_init__(self) -> None:
        _require(
            self.hosts >= 1 and self.world_size >= 1, "topology.hosts/world_size", "must be >= 1"
        )
        _require(
            len(set(self.backends)) == len(self.backends), "topology.backends", "has duplicates"
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class BackedClaim:
    """A claim this run backs, with the ids of the cells (or commands) that back it."""

    claim: str
    backed_by: tuple[str, ...]

    def __post_init__(self) -> None:
        _require(bool(self.claim), "boundaries.validated[].claim", "must be non-empty")
        _require(
            len(self.backed_by) > 0,
            f"boundaries.validated[{self.claim!r}]",
            "names no backing cell",
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class UnbackedClaim:
    """A boundary this run does not validate, and why (declared by the campaign, or a backing cell skipped, ...)."""

    claim: str
    reason: str

    def __post_init__(self) -> None:
        _require(
            bool(self.claim) and bool(self.reason),
            "boundaries.not_validated[]",
            "needs a claim and a reason",
        )


DECLARED = "declared not validated by the campaign"


@dataclass(kw_only=True, slots=True, frozen=True)
class Boundaries:
    """What this qualification shows, and what it explicitly does not (one sentence each).

    A plain string under ``validated`` is a claim backed by every command of the run: sealing keeps it validated
    only if every command exited 0. A plain string under ``not_validated`` is declared by the campaign."""

    validated: tuple[BackedClaim | str, ...]
    not_validated: tuple[UnbackedClaim | str, ...]

    def resolve(
        self, commands: tuple[CommandRecord, ...]
    ) -> tuple[list[BackedClaim], list[UnbackedClaim]]:
        """Every claim as a record: plain strings bound to the commands that back them (or moved, with why)."""
        validated: list[BackedClaim] = []
        not_validated: list[UnbackedClaim] = []
        failing = [c for c in commands if c.exit_code != 0]
        for claim in self.validated:
            if isinstance(claim, BackedClaim):
                validated.append(claim)
            elif not commands:
                not_validated.append(
                    UnbackedClaim(claim=claim, reason="not run: the run recorded no command")
                )
            elif failing:
                shown = ", ".join(f"{c.id} exited {c.exit_code}" for c in failing[:2])
                not_validated.append(
                    UnbackedClaim(
                        claim=claim,
                        reason=f"failed: {len(failing)} of {len(commands)} backing commands ({shown})",
                    )
                )
            else:
                validated.append(BackedClaim(claim=claim, backed_by=tuple(c.id for c in commands)))
        for item in self.not_validated:
            not_validated.append(
                item
                if isinstance(item, UnbackedClaim)
                else UnbackedClaim(claim=item, reason=DECLARED)
            )
        return validated, not_validated


@dataclass(kw_only=True, slots=True, frozen=True)
class SealInput:
    """The run facts only the engine knows. Everything else is gathered while sealing."""

    campaign: CampaignRef
    commands: tuple[CommandRecord, ...]
    summary: Summary
    topology: Topology
    boundaries: Boundaries
    started_on: datetime
    finished_on: datetime
    trigger: str = "local"
    """One of :data:`TRIGGERS` (CI event name, or ``local``)."""
    runner: str = "local"
    """Who ran it: ``local``, ``github-hosted``, ``self-hosted``, or a builder id."""
    invocation_id: str | None = None
    """Unique id of this run (CI run URL + attempt); a fresh UUID when None."""
    artifact_name: str | None = None
    """Name of the uploaded artifact; ``qualification-evidence-<commit>`` when None."""
    run_url: str | None = None
    """http(s) URL of the CI run that produced the bundle, or None."""
    package_name: str = "gemscout"
    scope: Scope | None = None
    """What part of the campaign ran; None: all of it, one command per cell."""

    def __post_init__(self) -> None:
        _aware(self.started_on, "started_on")
        _aware(self.finished_on, "finished_on")
        _require(self.started_on <= self.finished_on, "started_on", "is after finished_on")
        _require(self.trigger in TRIGGERS, "trigger", f"must be one of {', '.join(TRIGGERS)}")
        ids = [c.id for c in self.commands]
        _require(len(set(ids)) == len(ids), "commands", "have duplicate ids")
        for command in self.commands:
            inside = (
                self.started_on <= command.started_on and command.finished_on <= self.finished_on
            )
            _require(inside, f"commands[{command.id!r}]", "ran outside started_on..finished_on")
        url_ok = self.run_url is None or self.run_url.startswith(("https://", "http://"))
        _require(url_ok, "run_url", "must be an http(s) URL or None")

    @property
    def result(self) -> str:
        """The campaign's result, as the verifier re-derives it (:func:`result_of`)."""
        return result_of(
            self.summary.passed,
            self.summary.failed,
            self.summary.skipped,
            self.summary.measured,
            [c.exit_code for c in self.commands],
        )

    @property
    def effective_scope(self) -> Scope:
        if self.scope is not None:
            return self.scope
        return Scope(
            cells_in_campaign=self.summary.total,
            campaign_cells_run=self.summary.total,
            cells_run=self.summary.total,
        )


RESULTS = ("PASSED", "PASSED-WITH-SKIPS", "MEASURED", "FAILED")


def result_of(passed: int, failed: int, skipped: int, measured: int, exit_codes: list[int]) -> str:
    """FAILED when a cell failed, a command exited non-zero, or nothing ran (a campaign whose cells were all skipped
    proves nothing); MEASURED when only measurement cells ran; PASSED-WITH-SKIPS when a cell was skipped; else PASSED.
    Scope (a narrowed run) is recorded apart and does not change the result."""
    if failed or any(code != 0 for code in exit_codes) or passed + measured == 0:
        return "FAILED"
    if passed == 0:
        return "MEASURED"
    return "PASSED-WITH-SKIPS" if skipped else "PASSED"
