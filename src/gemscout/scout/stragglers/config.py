"""The thresholds both straggler detectors judge by, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gemscout.errors import ConfigError

__all__ = ["StragglerConfig"]


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_count(value: object) -> bool:
    return type(value) is int


@dataclass(kw_only=True, slots=True, frozen=True)
class StragglerConfig:
    """Thresholds for both straggler detectors. Every field is validated; a bad value raises ``ConfigError``."""

    relative_margin: float = 1.1
    """Slow means time > relative_margin x reference (peer median, or fastest group). Finite, > 1.0."""
    absolute_margin_s: float = 0.002
    """...and time - reference > absolute_margin_s seconds. Finite, >= 0."""
    confirmations: int = 2
    """Consecutive slow rounds before a communication straggler is reported (R). Int >= 1."""
    compute_confirmations: int = 4
    """Consecutive slow rounds of one recipe before a compute straggler is reported. Int >= 1. Replay times on a
    loaded host have heavy tails that can hit one rank a few rounds running: two reported healthy ranks there, four
    none in 1,000 measured cycles (the scout-straggler campaign's loaded-1000 cell runs them)."""
    baseline_window: int = 16
    """How many of a rank's own healthy rounds its temporal baseline (a rolling median) remembers. Int >= 1."""
    baseline_min_samples: int = 4
    """Healthy rounds a rank needs before its baseline counts as evidence. Int in [1, baseline_window]."""
    baseline_margin: float = 1.5
    """A rank is slow against its own baseline past baseline_margin x baseline (and the absolute margin). > 1.0."""
    noise_factor: float = 6.0
    """The absolute margin is at least noise_factor x the replay's measured noise (compute detector). Finite, >= 0;
    0 turns the noise scaling off."""
    noise_window: int = 32
    """Healthy rounds whose per-rank excess over the median the noise estimate keeps. Int >= 2."""
    sustained_window: int = 64
    """SCOUT cycles of a rank's time over its peers' median (one median per cycle over the recipes it replayed) that
    the sustained check keeps (:mod:`~gemscout.scout.stragglers.sustained`). Int >= 0; 0 turns the check off.
    Shorter windows see a healthy rank that shares a core with other load for a while as steadily slow: on a loaded
    2-core host four ranks' window medians reached 1.28x over 16 cycles and 1.10x over 64 in 1,000 cycles."""
    sustained_margin: float = 1.15
    """A rank is steadily slow when the median of that window is past sustained_margin x its peers'. > 1.0."""
    sustained_span_s: float = 30.0
    """...and the window covers at least this many seconds: it keeps replays until both ``sustained_window`` of them
    and this span are covered. A host that shares a core with other work for a few seconds makes one rank steadily
    slower for as long; with a cycle every step of a fast model, 64 cycles are a few seconds of that (a 2-rank test
    on a busy CI machine was named so). Finite, >= 0; 0 bounds the window by count alone."""

    def __post_init__(self) -> None:
        for name in ("relative_margin", "baseline_margin", "sustained_margin"):
            value = getattr(self, name)
            if not _is_number(value) or value <= 1.0:
                raise ConfigError(
                    f"StragglerConfig.{name} must be a finite number > 1.0 (e.g. 1.1), got {value!r}"
                )
        if not _is_number(self.absolute_margin_s) or self.absolute_margin_s < 0:
            raise ConfigError(
                f"StragglerConfig.absolute_margin_s must be a finite number of seconds >= 0 (e.g. 0.002), "
                f"got {self.absolute_margin_s!r}"
            )
        for name in ("confirmations", "compute_confirmations", "baseline_window"):
            value = getattr(self, name)
            if not _is_count(value) or value < 1:
                raise ConfigError(f"StragglerConfig.{name} must be an int >= 1, got {value!r}")
        if not _is_count(self.sustained_window) or self.sustained_window < 0:
            raise ConfigError(
                f"StragglerConfig.sustained_window must be an int >= 0 (0 turns it off), got {self.sustained_window!r}"
            )
        if not _is_number(self.sustained_span_s) or self.sustained_span_s < 0:
            raise ConfigError(
                f"StragglerConfig.sustained_span_s must be a finite number of seconds >= 0 (e.g. 30), "
                f"got {self.sustained_span_s!r}"
            )
        if not _is_number(self.noise_factor) or self.noise_factor < 0:
            raise ConfigError(
                f"StragglerConfig.noise_factor must be a finite number >= 0 (e.g. 6), got {self.noise_factor!r}"
            )
        if not _is_count(self.noise_window) or self.noise_window < 2:
            raise ConfigError(
                f"StragglerConfig.noise_window must be an int >= 2, got {self.noise_window!r}"
            )
        if (
            not _is_count(self.baseline_min_samples)
            or not 1 <= self.baseline_min_samples <= self.baseline_window
        ):
            raise ConfigError(
                f"StragglerConfig.baseline_min_samples must be an int in [1, baseline_window={self.baseline_window}], "
                f"got {self.baseline_min_samples!r}"
            )

    def past_margins(
        self, seconds: float, reference: float, absolute_s: float | None = None
    ) -> bool:
        """True when ``seconds`` is past both the relative and the absolute margin over ``reference``
        (``absolute_s``: a noise-scaled absolute margin instead of ``absolute_margin_s``)."""
        margin = self.absolute_margin_s if absolute_s is None else absolute_s
        return seconds > self.relative_margin * reference and seconds - reference > margin
