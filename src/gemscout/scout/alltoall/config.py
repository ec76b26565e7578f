"""When and how much SCOUT's AllToAll check replays (:class:`AllToAllConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from gemscout.config import require, strict_fields
from gemscout.scout.alltoall.plan import CASES

__all__ = ["AllToAllConfig"]


@strict_fields
@dataclass(kw_only=True, slots=True, frozen=True)
class AllToAllConfig:
    """When and how much the AllToAll check replays. A bad value raises ``ConfigError`` naming the field."""

    interval: int = 1
    """A step ``s`` is due when ``s % interval == 0``. Int >= 1."""
    cases: tuple[str, ...] = CASES
    """Which representative AllToAlls to replay (non-empty subset of :data:`CASES`)."""
    max_records: int = 64
    """Most recent AllToAll calls kept per group between checks (older ones are dropped). Int >= 1."""
    max_rows: int = 4096
    """Upper bound on the rows one rank sends in one replayed AllToAll. Int >= 1."""
    timeout: timedelta = timedelta(seconds=60)
    """Bound on every collective of a check; a rank that misses it raises ``CollectiveTimeout``."""

    def __post_init__(self) -> None:
        c = "AllToAllConfig"
        for name in ("interval", "max_records", "max_rows"):
            value = getattr(self, name)
            require(
                type(value) is int and value >= 1, c, name, f"must be an int >= 1, got {value!r}"
            )
        require(
            isinstance(self.cases, tuple | list)
            and len(self.cases) > 0
            and all(case in CASES for case in self.cases),
            c,
            "cases",
            f"must be a non-empty tuple drawn from {CASES}, got {self.cases!r}",
        )
        object.__setattr__(self, "cases", tuple(case for case in CASES if case in self.cases))
        require(
            isinstance(self.timeout, timedelta) and self.timeout.total_seconds() > 0,
            c,
            "timeout",
            f"must be a positive datetime.timedelta, got {self.timeout!r}",
        )
