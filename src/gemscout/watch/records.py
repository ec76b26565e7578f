"""The record a rank publishes about its progress, and its parsing (readers validate every field)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

PROGRESS_KEY = "progress"
"""Channel key under which every rank publishes its :class:`ProgressRecord`."""
DEFAULT_GROUP = "world"
"""Group name for the default process group; the watchdog takes every rank to be a member of it."""


@dataclass(kw_only=True, slots=True, frozen=True)
class CollectiveFingerprint:
    """The collective a rank is in (``active``) or last left: what the ranks of a group must agree on."""

    op: str
    group: str
    shapes: tuple[tuple[int, ...], ...]
    seq: int
    """1-based count of collectives this rank has entered on ``group``, this one included."""
    active: bool


@dataclass(kw_only=True, slots=True, frozen=True)
class ProgressRecord:
    """One rank's published progress. Built by the publisher, parsed (and validated) by readers."""

    rank: int
    host: str
    step: int
    events: int
    """Bumps on every step change, collective entry/exit and section entry/exit: any change means progress."""
    heartbeat: int
    """Bumps on every publish: a value that stops changing means the publishing process is gone."""
    closed: bool
    """The rank stopped publishing on purpose (training ended); it is not stalled."""
    collective: CollectiveFingerprint | None
    group_seqs: Mapping[str, int] = field(default_factory=dict)
    section: str | None = None
    """The timed section (``dataloader``, ``checkpoint_read``, ...) the rank is inside, if any."""
    timings: Mapping[str, tuple[tuple[int, float, int], ...]] = field(default_factory=dict)
    """Per section, the newest ``(round, seconds, step)`` entries, oldest first."""

    def to_payload(self) -> dict[str, Any]:
        """Plain JSON for :meth:`OobChannel.publish`."""
        coll = self.collective
        return {
            "rank": self.rank,
            "host": self.host,
            "step": self.step,
            "events": self.events,
            "heartbeat": self.heartbeat,
            "closed": self.closed,
            "collective": None
            if coll is None
            else {
                "op": coll.op,
                "group": coll.group,
                "shapes": [list(s) for s in coll.shapes],
                "seq": coll.seq,
                "active": coll.active,
            },
            "group_seqs": dict(self.group_seqs),
            "section": self.section,
            "timings": {
                name: [list(entry) for entry in entries] for name, entries in self.timings.items()
            },
        }

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> ProgressRecord:
        """Parse and validate; raises ``ValueError`` (or ``TypeError``/``KeyError``) on any malformed field."""
        coll_raw = payload["collective"]
        collective = None
        if coll_raw is not None:
            collective = CollectiveFingerprint(
                op=_str(coll_raw["op"]),
                group=_str(coll_raw["group"]),
                shapes=tuple(tuple(_int(d) for d in s) for s in coll_raw["shapes"]),
                seq=_int(coll_raw["seq"]),
                active=_bool(coll_raw["active"]),
            )
        section = payload["section"]
        return cls(
            rank=_int(payload["rank"]),
            host=_str(payload["host"]),
            step=_int(payload["step"]),
            events=_int(payload["events"]),
            heartbeat=_int(payload["heartbeat"]),
            closed=_bool(payload["closed"]),
            collective=collective,
            group_seqs={_str(g): _int(n) for g, n in payload["group_seqs"].items()},
            section=None if section is None else _str(section),
            timings={
                _str(name): tuple((_int(r), float(s), _int(st)) for r, s, st in entries)
                for name, entries in payload["timings"].items()
            },
        )


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {value!r}")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected a boolean, got {value!r}")
    return value
