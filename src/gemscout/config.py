"""Shared enums and the strict-config helper. Each component owns its own config dataclass."""

from __future__ import annotations

import dataclasses
import difflib
import enum
from typing import Any, TypeVar

from gemscout.errors import ConfigError

T = TypeVar("T")


class TrustState(enum.StrEnum):
    """How far a checkpoint is trusted. Order matters: later states are stronger."""

    CANDIDATE = "candidate"
    RECOVERY_VERIFIED = "recovery_verified"
    DURABLE = "durable"
    REJECTED = "rejected"

    @property
    def rank(self) -> int:
        return {"rejected": -1, "candidate": 0, "recovery_verified": 1, "durable": 2}[self.value]


def strict_fields(cls: type[T]) -> type[T]:
    """Make an unknown keyword a ConfigError that names it and the closest known field."""
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    original = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - known)
        if unknown:
            name = unknown[0]
            close = difflib.get_close_matches(name, known, n=1)
            hint = (
                f"; did you mean {close[0]!r}?"
                if close
                else f"; known fields: {', '.join(sorted(known))}"
            )
            raise ConfigError(f"{cls.__name__}: unknown field {name!r}{hint}")
        original(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


def require(cond: bool, cls: str, field: str, message: str) -> None:
    """Raise ConfigError naming ``cls.field`` unless ``cond``."""
    if not cond:
        raise ConfigError(f"{cls}.{field}: {message}")
