"""Straggler statistics: which rank (or host) is slow, from timings alone.

No process group here: the caller gathers the timings and feeds one round at a time. Three detectors share one
config (:mod:`.config`):

* :class:`ComputeStragglerDetector` (:mod:`.compute`) — every peer times the same replay; a rank is slow against the
  peer median or against its own recent past. The times fed in should be what the rank's work took, not how long it
  waited for a CPU: SCOUT subtracts the replaying thread's run-queue wait (:mod:`.runqueue`) before it compares.
* :class:`SustainedStragglerDetector` (:mod:`.sustained`) — a rank steadily a little slower than its peers: the
  median of its time over its peers' median (one median over recipes per cycle) across a window of at least
  ``sustained_window`` cycles and ``sustained_span_s`` seconds, past ``sustained_margin``. It finds the 20 % straggler that no single round's margins can tell from noise.
* :class:`CommStragglerDetector` (:mod:`.comm`) — the same collective timed in several process groups; the ranks
  common to every slow group, less any rank that also sits in a fast group, are the suspects, mapped to their host.

A rank is reported only after ``compute_confirmations`` (default 4) or, for communication, ``confirmations``
(default 2) consecutive slow rounds; one healthy round (or a round it is missing from) resets its count, so
intermittent blips never add up to a report. Measured on a loaded 2-core machine (the scout-straggler campaign's loaded-1000 cell): two compute
confirmations at fixed margins reported a healthy rank about once per cycle; four, with the run-queue wait subtracted
and the noise-scaled margin, never in 1,000 cycles. Once confirmed, every further slow round
reports again with the growing count. Detectors keep state across rounds and are not thread-safe: one thread calls
``observe``.
"""

from __future__ import annotations

from gemscout.scout.stragglers.comm import CommStragglerDetector, GroupTiming
from gemscout.scout.stragglers.compute import ComputeStragglerDetector, compute_reports
from gemscout.scout.stragglers.config import StragglerConfig
from gemscout.scout.stragglers.runqueue import run_queue_seconds, waited_since
from gemscout.scout.stragglers.sustained import SustainedStragglerDetector, job_clock

__all__ = [
    "CommStragglerDetector",
    "ComputeStragglerDetector",
    "GroupTiming",
    "StragglerConfig",
    "SustainedStragglerDetector",
    "compute_reports",
    "job_clock",
    "run_queue_seconds",
    "waited_since",
]
