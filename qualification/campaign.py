"""Campaign files: find, parse, validate against ``campaign.schema.json``, expand into cells.

A campaign is TOML. Its ``[[matrix]]`` entries are merged over ``[defaults]`` and each expands into the cartesian
product of its list-valued axes (topology, world_size, fault, seed). Everything is validated before anything runs;
every problem becomes a :class:`CampaignError` whose one-line message names the file, the key and, when it can be
found, the line.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import itertools
import json
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from qualification._schema_errors import describe_schema_error, toml_line_of
from qualification.errors import CampaignError, UsageError

#: The checkout this package lives in (for an editable install); campaigns/ is found beside it.
REPO_ROOT = Path(__file__).resolve().parents[1]

CELL_FIELDS = (
    "program",
    "workload",
    "topology",
    "world_size",
    "fault",
    "seed",
    "timeout_s",
    "params",
    "expect",
    "requires",
)
REQUIRED_CELL_FIELDS = (
    "program",
    "workload",
    "topology",
    "world_size",
    "fault",
    "seed",
    "timeout_s",
)
AXES = ("topology", "world_size", "fault", "seed")
MERGED_TABLES = ("params", "expect")


@cache
def load_schema(name: str) -> dict[str, Any]:
    """Load ``name`` (e.g. ``"campaign.schema.json"``) from ``qualification/schemas/`` (package data: the one copy)."""
    candidate = Path(__file__).resolve().parent / "schemas" / name
    if not candidate.is_file():
        raise FileNotFoundError(f"schema {name} is missing from qualification/schemas/")
    loaded: dict[str, Any] = json.loads(candidate.read_text(encoding="utf-8"))
    return loaded


@dataclass(kw_only=True, slots=True, frozen=True)
class Cell:
    """One run of one program under one fault: the unit the engine executes and judges."""

    id: str
    """Unique within the campaign: ``<campaign>/<program>[-<label>]-<topology>-w<N>-<fault>-s<seed>``."""
    program: str
    """Module under ``qualification.programs`` run as the cell's driver process."""
    workload: str
    topology: str
    world_size: int
    fault: dict[str, Any]
    """``kind`` plus the program's free keys (rank, step, phase, ...)."""
    seed: int
    timeout_s: float
    """Wall-clock limit of the whole process tree; past it the tree is terminated and the cell fails."""
    params: dict[str, Any]
    expect: dict[str, Any]
    requires: tuple[str, ...]
    """Capabilities the machine must have (``gpu``, ``gpu:2``, a module name); unmet means skipped."""

    @property
    def safe_id(self) -> str:
        """The id made safe as a single directory name."""
        return re.sub(r"[^A-Za-z0-9._-]", "_", self.id.replace("/", "__"))

    def to_json(self) -> dict[str, Any]:
        """The cell as written to ``cell.json`` (the program's input)."""
        record = dataclasses.asdict(self)
        record["requires"] = list(self.requires)
        return record


@dataclass(kw_only=True, slots=True, frozen=True)
class Claim:
    """One ``validated`` boundary and the cells that back it: it holds for a run only if every one of them ran and
    passed (:mod:`qualification.claims`)."""

    text: str
    cells: tuple[str, ...]
    """Patterns as for ``--filter`` (substring, or a glob over the id with or without ``<campaign>/``); empty: every
    cell of the campaign backs the claim (a plain string in the file)."""

    def backing(self, cell_ids: Sequence[str]) -> list[str]:
        """The ids among ``cell_ids`` that back this claim, in their order."""
        if not self.cells:
            return list(cell_ids)
        return [cell_id for cell_id in cell_ids if any(_matches(cell_id, p) for p in self.cells)]


@dataclass(kw_only=True, slots=True, frozen=True)
class Campaign:
    """A validated campaign file and the cells it expands to."""

    name: str
    tier: str
    description: str
    validated: tuple[str, ...]
    """The claims' texts, in file order (see ``claims`` for what backs each)."""
    not_validated: tuple[str, ...]
    path: Path
    source: bytes
    """The file exactly as read; copied into the run directory so the evidence shows what was run."""
    cells: tuple[Cell, ...]
    claims: tuple[Claim, ...] = ()
    """The ``validated`` boundaries with their backing cells."""


def campaigns_dir() -> Path:
    """Where campaigns are looked up by name: ``./campaigns`` if it exists, else the checkout's ``campaigns/``."""
    local = Path.cwd() / "campaigns"
    return local if local.is_dir() else REPO_ROOT / "campaigns"


def campaign_files() -> list[Path]:
    """Every ``*.toml`` in :func:`campaigns_dir`, sorted by name."""
    return sorted(campaigns_dir().glob("*.toml"))


def resolve(ref: str) -> Path:
    """Turn a campaign name (``quickstart``) or a path (``x/y.toml``) into an existing file; raise ``UsageError``."""
    as_path = Path(ref)
    if as_path.is_file():
        return _relative_to_cwd(as_path)
    if ref.endswith(".toml") or "/" in ref or "\\" in ref:
        raise UsageError(f"campaign file {ref} does not exist")
    by_name = campaigns_dir() / f"{ref}.toml"
    if by_name.is_file():
        return _relative_to_cwd(by_name)
    known = ", ".join(p.stem for p in campaign_files()) or "none"
    raise UsageError(f"no campaign named {ref!r} in {campaigns_dir()} (known: {known})")


def load(ref: str | Path) -> Campaign:
    """Read, validate and expand a campaign given by name or path.

    Raises ``CampaignError`` (exit code 2) for bad TOML, a schema violation, a cell missing a required field after
    merging defaults, or two cells with the same id; ``UsageError`` when the file cannot be found.
    """
    path = resolve(str(ref))
    source = path.read_bytes()
    try:
        text = source.decode("utf-8")
        document = tomllib.loads(text)
    except UnicodeDecodeError as exc:
        raise CampaignError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise CampaignError(f"{path}: invalid TOML: {exc}") from None
    except RecursionError:
        raise CampaignError(
            f"{path}: nested too deeply to be a campaign (arrays or tables inside each other)"
        ) from None
    try:
        validate_document(document, path=path, text=text)
    except RecursionError:
        raise CampaignError(
            f"{path}: nested too deeply to be a campaign (arrays or tables inside each other)"
        ) from None
    cells = expand(document, path=path)
    boundaries = document["boundaries"]
    claims = _claims(boundaries["validated"], cells, path=path)
    return Campaign(
        name=document["name"],
        tier=document["tier"],
        description=document["description"],
        validated=tuple(claim.text for claim in claims),
        not_validated=tuple(boundaries["not_validated"]),
        path=path,
        source=source,
        cells=tuple(cells),
        claims=claims,
    )


def _claims(raw: Sequence[Any], cells: Sequence[Cell], *, path: Path) -> tuple[Claim, ...]:
    """The schema-valid ``validated`` entries as claims; a pattern that matches no cell is an error, since a claim
    backed by nothing would be validated by nothing."""
    ids = [cell.id for cell in cells]
    claims = []
    for index, entry in enumerate(raw):
        if isinstance(entry, str):
            claim = Claim(text=entry, cells=())
        else:
            claim = Claim(text=entry["claim"], cells=tuple(entry["cells"]))
        for pattern in claim.cells:
            if not any(_matches(cell_id, pattern) for cell_id in ids):
                raise CampaignError(
                    f"{path}: boundaries.validated[{index}] names cells {pattern!r}, which match none of the "
                    f"{len(ids)} cells; name cells the campaign has (substring or glob of their ids)"
                )
        claims.append(claim)
    return tuple(claims)


def validate_document(document: Mapping[str, Any], *, path: Path, text: str = "") -> None:
    """Validate a parsed campaign against the schema; raise ``CampaignError`` naming the first offending key."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import best_match

    validator = Draft202012Validator(load_schema("campaign.schema.json"))
    error = best_match(validator.iter_errors(document))
    if error is not None:
        anchor, what = describe_schema_error(error, load_schema("campaign.schema.json"))
        line = toml_line_of(text, error.absolute_path, anchor)
        raise CampaignError(f"{path}{f':{line}' if line else ''}: {what}")


def expand(document: Mapping[str, Any], *, path: Path) -> list[Cell]:
    """Expand the (already schema-valid) matrix into cells, in file order then axis order."""
    name = document["name"]
    defaults = document.get("defaults", {})
    cells: list[Cell] = []
    origin: dict[str, int] = {}
    for index, entry in enumerate(document["matrix"]):
        merged = _merge(defaults, entry)
        missing = [f for f in REQUIRED_CELL_FIELDS if f not in merged]
        if missing:
            raise CampaignError(
                f"{path}: matrix[{index}] has no '{missing[0]}' (set it in the entry or in [defaults])"
            )
        axes = [_as_axis(merged[axis]) for axis in AXES]
        for topology, world_size, fault, seed in itertools.product(*axes):
            cell = Cell(
                id=_cell_id(name, merged, topology, world_size, fault, seed),
                program=merged["program"],
                workload=merged["workload"],
                topology=topology,
                world_size=world_size,
                fault=dict(fault),
                seed=seed,
                timeout_s=float(merged["timeout_s"]),
                params=dict(merged.get("params", {})),
                expect=dict(merged.get("expect", {})),
                requires=tuple(merged.get("requires", ())),
            )
            if cell.id in origin:
                raise CampaignError(
                    f"{path}: matrix[{index}] and matrix[{origin[cell.id]}] both make cell {cell.id!r}; "
                    "give the entries distinct 'label's"
                )
            origin[cell.id] = index
            cells.append(cell)
    return cells


def select(cells: Sequence[Cell], expr: str | None) -> list[Cell]:
    """Keep the cells whose id matches ``expr``: comma-separated alternatives, each a substring of the id or a glob
    (``*?[``) matching the whole id or the id after ``<campaign>/``. No match at all is a ``UsageError``."""
    if not expr:
        return list(cells)
    patterns = [p.strip() for p in expr.split(",") if p.strip()]
    chosen = [c for c in cells if any(_matches(c.id, p) for p in patterns)]
    if not chosen:
        raise UsageError(f"--filter {expr!r} matches none of the {len(cells)} cells")
    return chosen


def override_seed(cells: Iterable[Cell], seed: int) -> list[Cell]:
    """Give every cell ``seed``; cells that then coincide (they differed only by seed) are kept once."""
    if seed < 0:
        raise UsageError(f"--seed must be >= 0, got {seed}")
    result: dict[str, Cell] = {}
    for cell in cells:
        new_id = re.sub(r"-s\d+$", f"-s{seed}", cell.id)
        result.setdefault(new_id, dataclasses.replace(cell, id=new_id, seed=seed))
    return list(result.values())


def _relative_to_cwd(path: Path) -> Path:
    # Shown in messages and recorded in the evidence: campaigns/quickstart.toml reads better than /home/.../...
    resolved = path.resolve()
    return (
        resolved.relative_to(Path.cwd().resolve())
        if resolved.is_relative_to(Path.cwd().resolve())
        else resolved
    )


def _matches(cell_id: str, pattern: str) -> bool:
    if any(ch in pattern for ch in "*?["):
        # A glob matches the whole id, or the id without its campaign prefix ("selftest-pass-*").
        return fnmatch.fnmatchcase(cell_id, pattern) or fnmatch.fnmatchcase(
            cell_id.split("/", 1)[-1], pattern
        )
    return pattern in cell_id


def _merge(defaults: Mapping[str, Any], entry: Mapping[str, Any]) -> dict[str, Any]:
    merged = {**defaults, **entry}
    for table in MERGED_TABLES:
        if table in defaults and table in entry:
            merged[table] = {**defaults[table], **entry[table]}
    return merged


def _as_axis(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [value]


def _cell_id(
    campaign: str,
    merged: Mapping[str, Any],
    topology: str,
    world_size: int,
    fault: Mapping[str, Any],
    seed: int,
) -> str:
    head = merged["program"] + (f"-{merged['label']}" if "label" in merged else "")
    return f"{campaign}/{head}-{topology}-w{world_size}-{fault_slug(fault)}-s{seed}"


def fault_slug(fault: Mapping[str, Any]) -> str:
    """``kind`` then each other key and value, sorted by key: ``sigkill-rank1-step4``.

    Every key takes part so that two faults of one kind (rank 1 vs rank 2) never share an id; a table or list value
    contributes a short digest of its canonical JSON.
    """
    parts = [str(fault["kind"])]
    for key in sorted(k for k in fault if k != "kind"):
        value = fault[key]
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, int | float | str):
            text = re.sub(r"[^A-Za-z0-9.]+", "_", str(value))
        else:
            canonical = json.dumps(value, sort_keys=True, separators=(",", ":"))
            text = hashlib.sha256(canonical.encode()).hexdigest()[:6]
        parts.append(f"{key}{text}")
    return "-".join(parts)
