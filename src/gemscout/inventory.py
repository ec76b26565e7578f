"""What a GEMINI checkpoint directory holds, read offline, and what a restart on it would restore.

:func:`inventory` walks ``<directory>/node-*/rank-*`` (own generations, replicas held for peers, the trust ledger)
and an optional durable tier, checks every file the way recovery does (header digest, identity, size; with
``verify=True`` every tensor digest too, and the SHA-256 sidecar of each durable promotion), and runs recovery's own
choice (:func:`gemscout.gemini.recovery.decide`) on what it found: the step, the per-rank sources, and why. Memory
is not visible offline, so the decision is the one a job restarted after *every* process died would make; a job
whose survivors still hold their slots may restore a newer step.

``gemscout inspect DIR`` (:mod:`gemscout.cli`) prints it. Nothing here writes.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gemscout import faultlog
from gemscout.config import TrustState
from gemscout.errors import ConfigError, IntegrityError
from gemscout.files import recorded_run_id
from gemscout.gemini import shm_sweep, store
from gemscout.gemini.durable import DurableTier
from gemscout.gemini.lifecycle import TrustLedger
from gemscout.gemini.recovery import RecoveryDecision, decide

__all__ = ["FileEntry", "Inventory", "RankEntry", "inventory"]

_RANK_DIR = re.compile(r"rank-([0-9]{1,9})")  # ASCII digits, fullmatch (see gemscout.gemini.store)
_NODE_DIR = re.compile(r"node-([0-9]{1,9})")


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One checkpoint file: ``kind`` "own" (the rank's own state) or "replica" (held for ``owner``) on disk, or
    "memory" / "memory_replica": the same in the rank's memory tier (gemini/shm.py)."""

    kind: str
    owner: int
    step: int
    path: str
    nbytes: int
    status: str
    """``verified`` (every digest checked), ``header-ok`` (header, identity and size checked; tensor digests are
    checked when recovery loads it) or ``unusable``."""
    reason: str = ""


@dataclass(slots=True)
class RankEntry:
    rank: int
    node: int | None
    files: list[FileEntry] = field(default_factory=list)
    trust: dict[int, str] = field(default_factory=dict)
    attempts: dict[int, int] = field(default_factory=dict)
    last_decision: dict[str, Any] | None = None
    problems: list[str] = field(default_factory=list)
    """What in the rank's folder could not be read at all (a folder that is a file, a malformed status.json)."""


@dataclass(slots=True)
class Inventory:
    directory: str
    run_id: str
    topology_digest: str
    world_size: int
    ranks: list[RankEntry]
    durable: list[dict[str, Any]]
    decision: RecoveryDecision
    verified: bool
    faults: list[dict[str, Any]] = field(default_factory=list)
    """Every FaultReport the ranks kept (``faults.jsonl``), oldest first; one report seen by several ranks (an SDC
    verdict is every peer's) is listed once, with ``reported_by`` naming them."""

    @property
    def unusable(self) -> list[str]:
        """Every file or promotion that recovery would refuse, with why."""
        bad = [
            f"{f.path}: {f.reason}" for r in self.ranks for f in r.files if f.status == "unusable"
        ]
        bad += [p for r in self.ranks for p in r.problems]
        return bad + [
            d["reason"] for d in self.durable if d["status"] == "unusable"
        ]  # "durable step N: why"

    def to_dict(self) -> dict[str, Any]:
        return {
            "directory": self.directory,
            "run_id": self.run_id,
            "topology_digest": self.topology_digest,
            "world_size": self.world_size,
            "verified": self.verified,
            "ranks": [
                {
                    **asdict(r),
                    "trust": {str(k): v for k, v in sorted(r.trust.items())},
                    "attempts": {str(k): v for k, v in sorted(r.attempts.items())},
                }
                for r in self.ranks
            ],
            "durable": self.durable,
            "decision": self.decision.to_dict(),
            "unusable": self.unusable,
            "faults": self.faults,
        }


def _rank_dirs(directory: Path) -> dict[int, tuple[int, Path]]:
    found: dict[int, tuple[int, Path]] = {}
    for node_dir in sorted(directory.iterdir()):
        node = _NODE_DIR.fullmatch(node_dir.name)
        if node is None or not node_dir.is_dir() or node_dir.is_symlink():
            continue
        for rank_dir in sorted(node_dir.iterdir()):
            m = _RANK_DIR.fullmatch(rank_dir.name)
            if m is not None and rank_dir.is_dir() and not rank_dir.is_symlink():
                found[int(m.group(1))] = (int(node.group(1)), rank_dir)
    return found


def _check(
    path: Path, *, kind: str, owner: int, step: int, verify: bool, run_id: str
) -> tuple[FileEntry, str]:
    """The file's entry and the topology digest its header names ("" when unreadable)."""
    try:
        parsed = store.read_verified(path)[0] if verify else store.read_header(path)
        ident = parsed.identity
        problems = [
            f"{key} is {ident.get(key)!r}, expected {want!r}"
            for key, want in (("run_id", run_id), ("owner", owner), ("step", step))
            if want != "" and ident.get(key) != want
        ]
        if problems:
            raise IntegrityError("; ".join(problems))
        status, reason, topology = (
            ("verified" if verify else "header-ok"),
            "",
            str(ident.get("topology", "")),
        )
    except (
        Exception
    ) as exc:  # anything: the file is unusable, and the inventory goes on (as recovery does)
        status, reason, topology = "unusable", str(exc) or type(exc).__name__, ""
    try:
        size = path.lstat().st_size
    except OSError:
        size = 0
    return FileEntry(kind, owner, step, str(path), size, status, reason), topology


def inventory(
    directory: Path | str,
    *,
    durable_directory: Path | str | None = None,
    verify: bool = False,
    world_size: int | None = None,
    min_trust: TrustState = TrustState.CANDIDATE,
    max_attempts: int = 3,
) -> Inventory:
    """Read ``directory`` (a ``CheckpointConfig.directory``) and decide what a restart would restore.

    ``world_size``: the job's ranks when some rank's folder is gone entirely (default: the highest rank seen in a
    folder or as the owner of a held replica, plus one). Raises ``ConfigError`` when ``directory`` is not a
    GEMINI checkpoint directory.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ConfigError(
            f"gemscout inspect: {directory} is not a directory; give the CheckpointConfig.directory of the job"
        )
    ranks_found = _rank_dirs(directory)
    marker = directory / "run.json"
    if not ranks_found and not marker.exists():
        raise ConfigError(
            f"gemscout inspect: {directory} holds no GEMINI checkpoint (no run.json, no node-*/rank-* "
            "folders); give the CheckpointConfig.directory of the job"
        )
    run_id = recorded_run_id(directory)
    owners = {o for _, d in ranks_found.values() for o in _owners(store.RankPaths(d), [])}
    world = world_size or max([*ranks_found, *owners, -1]) + 1
    entries: list[RankEntry] = []
    topologies: Counter[str] = Counter()
    checked: list[tuple[RankEntry, FileEntry, str]] = []
    for rank in range(world):
        node, rank_dir = ranks_found.get(rank, (None, None))
        entry = RankEntry(rank, node)
        entries.append(entry)
        if rank_dir is None:
            continue
        paths = store.RankPaths(rank_dir)
        ledger = TrustLedger.load(paths.status)
        entry.trust = {s: st.value for s, st in ledger.states.items()}
        entry.attempts, entry.last_decision = dict(ledger.attempts), ledger.last_decision
        if ledger.load_problem:
            entry.problems.append(f"{paths.status}: {ledger.load_problem}")
        folders = [("own", rank, paths.own)] + [
            ("replica", o, paths.replicas(o)) for o in _owners(paths, entry.problems)
        ]
        memory = shm_sweep.describe(
            directory, rank_dir
        )  # the memory tier its anchor names (a killed process's slots)
        if memory is not None:
            mem = store.RankPaths(Path(memory["path"]))
            folders += [("memory", rank, mem.own)] + [
                ("memory_replica", o, mem.replicas(o)) for o in _owners(mem, entry.problems)
            ]
        for kind, owner, folder in folders:
            try:
                steps = sorted(store.list_steps(folder))
            except OSError as exc:
                entry.problems.append(f"{folder}: cannot be listed ({exc.strerror or exc})")
                continue
            for step in steps:
                f, topology = _check(
                    store.step_file(folder, step),
                    kind=kind,
                    owner=owner,
                    step=step,
                    verify=verify,
                    run_id=run_id,
                )
                checked.append((entry, f, topology))
                if topology:
                    topologies[topology] += 1
    topology = topologies.most_common(1)[0][0] if topologies else ""
    for (
        entry,
        f,
        theirs,
    ) in checked:  # a file of another topology is refused at recovery like a corrupt one
        if theirs not in ("", topology):
            f = FileEntry(
                f.kind,
                f.owner,
                f.step,
                f.path,
                f.nbytes,
                "unusable",
                f"written by another topology ({theirs}; most files say {topology})",
            )
        entry.files.append(f)
    durable = _durable(Path(durable_directory), run_id) if durable_directory is not None else []
    newest_durable = next((d["step"] for d in durable if d["status"] == "verified"), None)
    # As recovery sees them: the promotions refused above the newest that verifies (another run's are not ours).
    refused = [
        d["reason"]
        for d in durable
        if d["status"] == "unusable" and (newest_durable is None or d["step"] > newest_durable)
    ]
    decision = decide(
        [_proposal(e) for e in entries],
        run_id=run_id,
        topology_digest=topology,
        min_trust=min_trust,
        max_attempts=max_attempts,
        durable_step=newest_durable,
        durable_refused=refused,
    )
    faults = _faults([d for _, d in ranks_found.values()])
    return Inventory(
        str(directory), run_id, topology, world, entries, durable, decision, verify, faults
    )


def _owners(paths: store.RankPaths, problems: list[str]) -> list[int]:
    try:
        return paths.held_owners()
    except OSError as exc:
        problems.append(f"{paths.root / 'replicas'}: cannot be listed ({exc.strerror or exc})")
        return []


def _faults(folders: list[Path]) -> list[dict[str, Any]]:
    merged: dict[str, dict[str, Any]] = {}
    for folder in folders:
        for doc in faultlog.read_reports(folder):
            by = doc.pop("reported_by", None)
            key = json.dumps(
                {k: v for k, v in doc.items() if k not in ("timestamp", "evidence")}, sort_keys=True
            )
            entry = merged.setdefault(key, {**doc, "reported_by": []})
            entry["timestamp"] = min(
                entry.get("timestamp", doc.get("timestamp", 0)), doc.get("timestamp", 0)
            )
            if by is not None and by not in entry["reported_by"]:
                entry["reported_by"].append(by)
    return sorted(merged.values(), key=lambda d: (d.get("timestamp", 0), d.get("step", 0)))


def _proposal(entry: RankEntry) -> dict[str, Any]:
    """What this rank would propose at a restart: a new process adopts the memory tier its killed predecessor left
    (see gemini/shm.py), so those slots and replicas count as memory, and a step in memory is not looked up on disk."""
    usable = [f for f in entry.files if f.status != "unusable"]
    memory = [f.step for f in usable if f.kind == "memory"]
    held: dict[str, list[int]] = {}
    memory_held: dict[str, list[int]] = {}
    for f in usable:
        if f.kind == "memory_replica":
            memory_held.setdefault(str(f.owner), []).append(f.step)
    for f in usable:
        if f.kind == "replica" and f.step not in memory_held.get(str(f.owner), []):
            held.setdefault(str(f.owner), []).append(f.step)
    states = {s: TrustState(v) for s, v in entry.trust.items()}
    return {
        "rank": entry.rank,
        "memory": memory,
        "memory_held": memory_held,
        "held": held,
        "own": [f.step for f in usable if f.kind == "own" and f.step not in memory],
        "unusable": [
            f"rank {entry.rank} {_describe(f)}: {f.reason}"
            for f in entry.files
            if f.status == "unusable"
        ]
        + [f"rank {entry.rank} {p}" for p in entry.problems],
        "rejected": sorted(s for s, st in states.items() if st == TrustState.REJECTED),
        "trust": {str(s): st.value for s, st in states.items()},
        "attempts": {str(s): n for s, n in entry.attempts.items()},
    }


def _describe(f: FileEntry) -> str:
    """Recovery's own words for the file (see :func:`gemscout.gemini.proposal.propose`)."""
    return {
        "own": f"own step {f.step}",
        "memory": f"memory step {f.step}",
        "memory_replica": f"in-memory replica of rank {f.owner} step {f.step}",
    }.get(f.kind, f"replica of rank {f.owner} step {f.step}")


def _durable(directory: Path, run_id: str) -> list[dict[str, Any]]:
    """Every promotion, newest first, with its sidecar check (the SHA-256 of every file)."""
    tier = DurableTier(directory, run_id=run_id)
    out = []
    for step in tier.steps():
        try:
            sidecar = tier.verify(step)
            if run_id and sidecar.get("run_id") != run_id:
                out.append(
                    {
                        "step": step,
                        "status": "foreign",
                        "sharded": bool(sidecar.get("sharded")),
                        "reason": f"belongs to run {sidecar.get('run_id')!r}, not {run_id!r}: not this job's",
                    }
                )
                continue
            out.append(
                {
                    "step": step,
                    "status": "verified",
                    "reason": "",
                    "sharded": bool(sidecar.get("sharded")),
                }
            )
        except (IntegrityError, OSError) as exc:
            out.append({"step": step, "status": "unusable", "reason": str(exc), "sharded": False})
    return out
