"""Input checks and formatting both detectors share: one round's step, times and host map."""

from __future__ import annotations

import math
from collections.abc import Mapping


def check_round(step: int, last_step: int | None) -> None:
    if type(step) is not int or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if last_step is not None and step <= last_step:
        # A repeated step would count one observation twice towards confirmation.
        raise ValueError(f"step must increase from round to round: got {step} after {last_step}")


def check_seconds(what: str, seconds: object) -> None:
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not math.isfinite(seconds)
        or seconds < 0
    ):
        raise ValueError(f"{what} must be a finite number of seconds >= 0, got {seconds!r}")


def check_hosts(rank_to_host: Mapping[int, str] | None) -> Mapping[int, str]:
    if rank_to_host is None:
        return {}
    for rank, host in rank_to_host.items():
        if not isinstance(host, str) or not host:
            raise ValueError(f"rank_to_host[{rank!r}] must be a non-empty host name, got {host!r}")
    return rank_to_host


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"
