"""The parent's half of the store process's protocol: what its stdout lines and its exit say.

The store process (:mod:`gemscout.watch._store_child`, which imports nothing of gemscout and so cannot share this
code) talks to its parent in lines: ``ready`` once it serves, ``swept <n> <json sample>`` for the foreign keys it
deleted since its last report, ``pressure <cap>`` when it holds 90 % of its memory cap, and free text otherwise
(``sweep-failed ...``, ``stuck: ...``, ``bind-failed: ...``, torch's own warnings). :func:`parse_line` reads one line;
:func:`death_cause` says, from its exit status and its last lines, why a store process is gone.
:class:`~gemscout.watch.store_server.StoreServer` does the reading, the bookkeeping and the supervision. Pure: no I/O.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

__all__ = ["ChildLine", "death_cause", "parse_line"]

_STUCK_EXIT = (
    75  # the store process was full to its cap and could not be swept for _store_child._STUCK_S
)
_TAIL_CHARS = 300  # of each line, kept for a death's cause

LineKind = Literal["ready", "swept", "pressure", "other"]


@dataclass(kw_only=True, slots=True, frozen=True)
class ChildLine:
    """One line of the store process, read."""

    kind: LineKind
    text: str
    """The line, cut to 300 characters (what a death's cause quotes)."""
    count: int | None = None
    """``swept``: the keys deleted since the last report; ``None`` when the line was cut (the child died writing
    it)."""
    sample: tuple[str, ...] | None = None
    """``swept``: some of their names; ``None`` when the line was cut."""


def parse_line(line: str) -> ChildLine:
    """Read one line (without its newline). A ``swept`` line cut short (the child died writing it) reads with
    ``count`` and ``sample`` as far as they are whole: its count comes again or never matters."""
    text = line[:_TAIL_CHARS]
    if line == "ready":
        return ChildLine(kind="ready", text=text)
    word, _, rest = line.partition(" ")
    if word == "pressure":
        return ChildLine(kind="pressure", text=text)
    if word != "swept":
        return ChildLine(kind="other", text=text)
    number, _, sample = rest.partition(" ")
    try:
        count = int(number)
    except ValueError:
        return ChildLine(kind="swept", text=text)
    try:
        parsed = json.loads(sample)
    except ValueError:
        return ChildLine(kind="swept", text=text, count=count)
    if not isinstance(parsed, list):  # not what the child writes: keep the count, drop the sample
        return ChildLine(kind="swept", text=text, count=count)
    names = tuple(str(s) for s in parsed)
    return ChildLine(kind="swept", text=text, count=count, sample=names)


def death_cause(
    pid: int, returncode: int | None, *, tail: Iterable[str], pressure: bool, cap_bytes: int
) -> str:
    """Why store process ``pid`` is gone: how it ended (``returncode`` as ``Popen`` gives it), whether it had
    neared its cap (``pressure``, of ``cap_bytes``), and its last lines (``tail``, oldest first) but the routine
    ``swept`` and ``pressure`` reports."""
    how = (
        f"was killed by {signal.Signals(-returncode).name}"
        if returncode is not None and returncode < 0
        else f"exited with {returncode}"
    )
    near = f", having reached 90 % of its {cap_bytes >> 20} MiB cap (a flood?)" if pressure else ""
    if returncode == _STUCK_EXIT:
        how = "exited: it was full to its memory cap and could not be swept (a flood that never paused)"
    last = " | ".join(line for line in tail if not line.startswith(("swept ", "pressure ")))[-600:]
    return f"store process {pid} {how}{near}" + (f"; its last output: {last}" if last else "")
