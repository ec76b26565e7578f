"""Housekeeping of GEMINI's memory tier (:mod:`gemscout.gemini.shm`): who owns a rank's memory folder, removing the
folders dead jobs left behind, and describing a rank's memory tier for ``gemscout inspect``.

A rank's memory folder ``<memory_directory>/<run key>/node-<n>/rank-<r>`` records its owner in ``owner.json`` (pid,
process start time, token); the rank's disk folder holds the anchor ``memory.json`` (where the memory is, token).
The owner is alive while a process with that pid *and* that start time runs: the start time tells a reused pid
apart. These files were left by another process and are read like every such file (regular, bounded, never a hang).

A job killed outright leaves its memory in place for a restart of its ranks on the same node. Once its owner is dead
and nothing has touched the folder for a grace period, the next job on the node that opens its memory tier removes
it (:func:`sweep_dead`); a job short of room removes it at once rather than be refused. A folder of a live process
is never removed, and the walk tolerates folders that vanish under it (two jobs ending side by side).

This module imports nothing from :mod:`gemscout.gemini.shm`: the memory tier calls the sweep, not the other way.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from gemscout.errors import IntegrityError
from gemscout.files import load_json
from gemscout.gemini import store

OWNER = "owner.json"
ANCHOR = "memory.json"


def proc_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), or None if it is gone:
    with the pid, it names one process even after the pid is reused."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return raw.rsplit(b")", 1)[1].split()[19].decode()


def owner_alive(doc: dict[str, Any]) -> bool:
    """True if the process recorded in an ``owner.json`` still runs (same pid and start time)."""
    pid = doc.get("pid")
    if not isinstance(pid, int):
        return False
    start = proc_start(pid)
    return start is not None and start == doc.get("start")


def read_json(path: Path) -> dict[str, Any] | None:
    """A small owner or anchor file, read like every file another process left (regular, bounded, never a hang);
    None when it is missing or not such a JSON object."""
    try:
        doc = load_json(path, max_bytes=64 << 10, max_depth=4)
    except (OSError, IntegrityError):
        return None
    return doc if isinstance(doc, dict) else None


def remove_empty_parents(root: Path, stop: int) -> None:
    for parent in list(root.parents)[:stop]:
        try:
            parent.rmdir()
        except OSError:
            return


def sweep_dead(base: Path, *, keep: str | None, stale_after_s: float) -> list[Path]:
    """Remove rank folders under ``base`` whose owner process is dead and that nothing touched for
    ``stale_after_s`` seconds (a launcher restarting that job has had time to re-claim them), except those of run
    key ``keep`` (this job's: a restarted rank adopts its own). A folder of a live process is never removed.
    Returns the folders removed."""
    removed: list[Path] = []
    if not base.is_dir():
        return removed
    now = time.time()
    for root in _rank_folders(base):
        if root.parent.parent.name == keep:
            continue
        doc = read_json(root / OWNER)
        if doc is not None and owner_alive(doc):
            continue
        try:
            touched = max((p.stat().st_mtime for p in [root, *root.rglob("*")]), default=0.0)
        except OSError:
            continue  # changing under us: someone is using it
        if now - touched < stale_after_s:
            continue
        shutil.rmtree(root, ignore_errors=True)
        remove_empty_parents(root, stop=2)
        removed.append(root)
    return removed


def _subdirs(path: Path, prefix: str = "") -> list[Path]:
    """Sub-folders of ``path``; a folder removed while we look (another job's cleanup) is just not there."""
    try:
        with os.scandir(path) as it:
            return [
                Path(e.path)
                for e in it
                if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False)
            ]
    except OSError:
        return []


def _rank_folders(base: Path) -> list[Path]:
    """Every ``<key>/node-*/rank-*`` folder under the memory directory, tolerant of concurrent removal (pathlib's
    glob raises when a folder vanishes mid-walk: found when two jobs started and ended side by side)."""
    return [
        rank
        for key in _subdirs(base)
        for node in _subdirs(key, "node-")
        for rank in _subdirs(node, "rank-")
    ]


def describe(directory: Path, rank_root: Path) -> dict[str, Any] | None:
    """What the memory tier of one rank holds, from the anchor in its disk folder (``gemscout inspect``): the
    folder, whether its owner process is alive, and the published steps (own, and held per owner). None when the
    rank has no anchor or its memory folder is gone."""
    anchor = read_json(rank_root / ANCHOR)
    if anchor is None or not isinstance(anchor.get("path"), str):
        return None
    root = Path(anchor["path"])
    owner = read_json(root / OWNER)
    if owner is None or owner.get("token") != anchor.get("token"):
        return None
    paths = store.RankPaths(root)
    try:
        own = store.list_steps(paths.own)
        held = {str(o): store.list_steps(paths.replicas(o)) for o in paths.held_owners()}
    except OSError:  # a folder replaced by a file, no permission: the memory tier is not usable, say so as absent
        return None
    return {
        "path": str(root),
        "owner_pid": owner.get("pid"),
        "owner_alive": owner_alive(owner),
        "own": own,
        "held": held,
    }
