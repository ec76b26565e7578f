"""What happened to a cell, and its verdict.

PASSED iff the driver exited 0, ``result.json`` is present, schema-valid and names this cell, the program's own status
is ``passed``, and every expectation holds (:mod:`qualification.expect`). Anything else is FAILED with the first
reason that applies, stated precisely enough to act on. SKIPPED is decided before a cell runs (unmet requirement).
A measurement cell (its result lists ``targets``) that would pass is MEASURED instead, its reason naming each target
met or missed: a measurement is evidence to read, and a missed target must never read as PASSED.
"""

from __future__ import annotations

import enum
import json
import signal
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from qualification import expect
from qualification._schema_errors import describe_schema_error
from qualification.campaign import Cell, load_schema


class Verdict(enum.StrEnum):
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"
    MEASURED = "measured"


@dataclass(kw_only=True, slots=True)
class CellOutcome:
    """What happened to one cell. Paths are relative to the run directory."""

    cell: Cell
    verdict: Verdict
    reason: str
    """Why: the unmet expectation (expected vs observed), the timeout, the exit code, the bad result.json."""
    duration_s: float = 0.0
    pid: int | None = None
    """The driver's pid, which is also its session and process-group id."""
    exit_code: int | None = None
    """The driver's exit status; negative for a signal; None when it never ran (skipped)."""
    timed_out: bool = False
    argv: list[str] = field(default_factory=list)
    cwd: str | None = None
    log: str | None = None
    result_file: str | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    result: dict[str, Any] | None = None
    """The program's result.json when present and schema-valid."""
    swept_pids: list[int] = field(default_factory=list)
    """Processes still alive after the driver exited or timed out, which the engine then killed."""

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {
            "id": self.cell.id,
            "verdict": str(self.verdict),
            "reason": self.reason,
            "duration_s": round(self.duration_s, 3),
            "pid": self.pid,
            "exit_code": self.exit_code,
            "timed_out": self.timed_out,
            "argv": self.argv,
            "cwd": self.cwd,
            "log": self.log,
            "result": self.result_file,
            "started_at": iso(self.started_at) if self.started_at else None,
            "finished_at": iso(self.finished_at) if self.finished_at else None,
            "swept_pids": self.swept_pids,
            "cell": self.cell.to_json(),
        }
        for key in ("observed", "metrics", "timeline", "message"):
            record[key] = self.result.get(key) if self.result else None
        if self.result and "targets" in self.result:
            record["targets"] = self.result["targets"]
        return record

    @property
    def missed_targets(self) -> list[dict[str, Any]]:
        """The targets a measurement cell missed (empty for any other cell)."""
        targets = self.result.get("targets", []) if self.result else []
        return [t for t in targets if not t["met"]]


def now() -> datetime:
    return datetime.now(UTC)


def iso(moment: datetime) -> str:
    """RFC 3339 UTC with milliseconds and a ``Z``, the form the evidence manifest uses."""
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def judge(outcome: CellOutcome, cell_dir: Path, out_dir: Path) -> None:
    """Fill in verdict, reason and result: PASSED iff exit 0, a valid result.json, status passed, expectations met."""
    cell = outcome.cell
    result, problem = _read_result(cell_dir / "result.json", cell)
    if result is not None:
        outcome.result, outcome.result_file = result, relative(cell_dir / "result.json", out_dir)
    said = f"; program said: {result['message']}" if result and result["message"] else ""
    if outcome.timed_out:
        outcome.reason = (
            f"timed out after {cell.timeout_s:g} s; process tree terminated (see {outcome.log})"
        )
    elif outcome.exit_code != 0:
        outcome.reason = f"crashed: {_describe_exit(outcome.exit_code)}{said} (see {outcome.log})"
    elif problem or result is None:
        outcome.reason = problem or "result.json missing"
    elif result["status"] != "passed":
        outcome.reason = f"program reported status {result['status']!r}{said}"
    else:
        mismatches = expect.check(
            cell.expect,
            result["observed"],
            params=cell.params,
            fault=cell.fault,
            cell={"world_size": cell.world_size, "seed": cell.seed},
        )
        if mismatches:
            outcome.reason = "; ".join(mismatches)
        elif "targets" in result:
            outcome.verdict = Verdict.MEASURED
            outcome.reason = describe_targets(result["targets"])
        else:
            outcome.verdict = Verdict.PASSED
            outcome.reason = (
                f"all {len(cell.expect)} expectations met" if cell.expect else "no expectations"
            )
    if outcome.swept_pids and not outcome.timed_out:
        # Not a failure of what the cell checks, but the evidence must show that its program did not clean up.
        outcome.reason += (
            f"; the engine ended {len(outcome.swept_pids)} process(es) the cell left running"
        )


def describe_targets(targets: list[dict[str, Any]]) -> str:
    """``measured: 2 of 3 targets met; missed: scout throughput (-4.1 % < -3 %)``."""
    missed = [t for t in targets if not t["met"]]
    text = f"measured: {len(targets) - len(missed)} of {len(targets)} targets met"
    if missed:
        text += "; missed: " + "; ".join(
            f"{t['name']} ({t['detail']})" if t["detail"] else t["name"] for t in missed
        )
    return text


def _read_result(path: Path, cell: Cell) -> tuple[dict[str, Any] | None, str | None]:
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import best_match

    if not path.is_file():
        return None, "the program exited 0 but wrote no result.json"
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        return None, f"result.json is not valid JSON: {exc}"
    error = best_match(
        Draft202012Validator(load_schema("cell-result.schema.json")).iter_errors(result)
    )
    if error is not None:
        return None, f"result.json fails its schema: {describe_schema_error(error)[1]}"
    if result["cell_id"] != cell.id:
        return None, f"result.json is for cell {result['cell_id']!r}, not {cell.id!r}"
    return result, None


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def relative(path: Path, root: Path) -> str:
    """``path`` relative to the run directory, as a POSIX string (how the summary and the manifest name files)."""
    return path.relative_to(root).as_posix()
