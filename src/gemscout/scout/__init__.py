"""SCOUT: detection and localization of faulty and slow ranks.

A plain re-export list of the package's main names; every module stays reachable by its own path.
"""

from gemscout.scout.consensus import C3Result, Verdict, c3
from gemscout.scout.digests import digest_many, tensor_digest
from gemscout.scout.preconditions import Precondition, check_preconditions, judge
from gemscout.scout.reports import FaultKind, FaultReport, Scope
from gemscout.scout.stragglers import CommStragglerDetector, ComputeStragglerDetector, GroupTiming, StragglerConfig

__all__ = [
    "C3Result",
    "CommStragglerDetector",
    "ComputeStragglerDetector",
    "FaultKind",
    "FaultReport",
    "GroupTiming",
    "Precondition",
    "Scope",
    "StragglerConfig",
    "Verdict",
    "c3",
    "check_preconditions",
    "digest_many",
    "judge",
    "tensor_digest",
]
