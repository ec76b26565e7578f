"""SCOUT: detection and localization of faulty and slow ranks.

A plain re-export list of the package's main names; every module stays reachable by its own path.
"""

from gemscout.reports import FaultKind, FaultReport, Scope
from gemscout.scout.config import ScoutConfig
from gemscout.scout.consensus import C3Result, Verdict, c3
from gemscout.scout.cycle import CycleResult
from gemscout.scout.digests import digest_many, tensor_digest
from gemscout.scout.engine import Scout
from gemscout.scout.preconditions import Precondition, check_preconditions, judge
from gemscout.scout.recipes import Catalog, Recipe, RecipeKind
from gemscout.scout.replay import ReplayContext, ReplayHook
from gemscout.scout.rotation import RotationTracker
from gemscout.scout.stragglers import (
    CommStragglerDetector,
    ComputeStragglerDetector,
    GroupTiming,
    StragglerConfig,
)

__all__ = [
    "C3Result",
    "Catalog",
    "CommStragglerDetector",
    "ComputeStragglerDetector",
    "CycleResult",
    "FaultKind",
    "FaultReport",
    "GroupTiming",
    "Precondition",
    "Recipe",
    "RecipeKind",
    "ReplayContext",
    "ReplayHook",
    "RotationTracker",
    "Scope",
    "Scout",
    "ScoutConfig",
    "StragglerConfig",
    "Verdict",
    "c3",
    "check_preconditions",
    "digest_many",
    "judge",
    "tensor_digest",
]
