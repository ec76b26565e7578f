"""Errors of the qualification harness and the exit codes its tools return.

The CLI has one handler: a :class:`QualificationError` becomes a one-line message on stderr and ``exit_code``.

====  =======================================================================
code  meaning
====  =======================================================================
0     success (campaign passed; bundle valid and CURRENT)
1     a cell failed, or a bundle is invalid (digests, schema, consistency)
2     usage or configuration error (bad campaign file, bad flag); nothing ran
3     bundle valid but STALE: main has moved past its commit
4     bundle commit differs from ``--expected-commit``
5     signature missing where required, invalid, or made by another key
6     bundle valid but its commit is NOT-ON-MAIN, or freshness is UNKNOWN
7     bundle valid but PARTIAL (narrowed by --filter / --seed, or no scope recorded) under ``--require-complete``
====  =======================================================================
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_STALE = 3
EXIT_COMMIT_MISMATCH = 4
EXIT_SIGNATURE = 5
EXIT_NOT_ON_MAIN = 6
EXIT_INCOMPLETE = 7


class QualificationError(Exception):
    """Base of harness errors; ``exit_code`` is what the CLI returns."""

    exit_code: int = EXIT_FAILED


class UsageError(QualificationError):
    """Bad flag, bad campaign file, unknown key: nothing was run."""

    exit_code = EXIT_USAGE


class CampaignError(UsageError):
    """A campaign file is malformed or fails its schema. The message names the file and the key."""


class CellFailure(QualificationError):
    """One or more cells failed their expectations, crashed or timed out."""

    exit_code = EXIT_FAILED


class BundleInvalid(QualificationError):
    """An evidence bundle failed a verification check (digest, schema, intake, consistency)."""

    exit_code = EXIT_FAILED


class SignatureInvalid(BundleInvalid):
    """The bundle's signature is missing where required, does not verify, or was made by another key."""

    exit_code = EXIT_SIGNATURE


class CommitMismatch(BundleInvalid):
    """The bundle was made from another commit than the one expected."""

    exit_code = EXIT_COMMIT_MISMATCH
