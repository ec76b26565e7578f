"""One error hierarchy for the runtime.

Every error a user can meet derives from :class:`GemscoutError`. Each class carries the process exit code that a
launcher script should use when the error ends the job (documented in ``docs/gemini.md``):

==========================  =====  ==========================================================
error                       exit   meaning
==========================  =====  ==========================================================
ConfigError                 2      bad configuration; the message names the field and the fix
RunMismatchError            2      a checkpoint belongs to another run or topology
IntegrityError              3      bytes on disk or on the wire do not match their digest
ReplicaUnavailable          3      no verified copy of a shard can be found
RecoveryError               4      recovery cannot proceed (decision STOP); never a restart loop
CollectiveTimeout           5      a blocking call passed its timeout
==========================  =====  ==========================================================
"""

from __future__ import annotations


class GemscoutError(Exception):
    """Base of every gemscout error."""

    exit_code: int = 1


class ConfigError(GemscoutError, ValueError):
    """A configuration value is invalid. The message names the field and what would be accepted."""

    exit_code = 2


class RunMismatchError(GemscoutError):
    """A checkpoint was written by another run or for another topology and must not be loaded."""

    exit_code = 2


class IntegrityError(GemscoutError):
    """Stored or transferred bytes do not match their recorded digest, or the digest is missing (fail closed)."""

    exit_code = 3


class ReplicaUnavailable(GemscoutError):
    """No verifiable copy of the requested shard exists on any source."""

    exit_code = 3


class RecoveryError(GemscoutError):
    """Recovery cannot proceed: every source is exhausted or attempts are spent. The decision is STOP."""

    exit_code = 4


class CollectiveTimeout(GemscoutError, TimeoutError):
    """A blocking operation (collective, transfer, flush, wait) passed its timeout."""

    exit_code = 5


class EvidenceError(GemscoutError):
    """An evidence object is malformed (used by tools that read gemscout outputs)."""

    exit_code = 1
