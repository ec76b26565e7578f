"""Where the per-job OOB secret comes from.

The secret must reach every rank from outside the store it protects: from the launcher's environment
(``GEMSCOUT_OOB_SECRET``; ``torchrun`` passes the environment to every rank) or from configuration. Generating it on
rank 0 and publishing it through the same unauthenticated store would give it to anyone who can reach that store.
"""

from __future__ import annotations

import logging
import os
import secrets

from gemscout.errors import ConfigError

logger = logging.getLogger(__name__)

SECRET_ENV = "GEMSCOUT_OOB_SECRET"
MIN_SECRET_BYTES = 16
_INSECURE_DEV_SECRET = b"gemscout-insecure-dev-secret-do-not-use"


def generate_secret() -> str:
    """A fresh random secret for a launcher to export as ``GEMSCOUT_OOB_SECRET`` (64 hex characters)."""
    return secrets.token_hex(32)


def resolve_secret(secret: bytes | None, *, insecure_dev: bool = False) -> bytes:
    """The key to use: ``secret``, else ``GEMSCOUT_OOB_SECRET``, else the public dev key if ``insecure_dev``.

    Raises :class:`ConfigError` when there is none and ``insecure_dev`` is false, or when the environment's is short.
    """
    if secret is not None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ConfigError(
                f"OobConfig.secret must hold at least {MIN_SECRET_BYTES} bytes; use generate_secret()"
            )
        return secret
    from_env = os.environ.get(SECRET_ENV)
    if from_env:
        encoded = from_env.encode("utf-8")
        if len(encoded) < MIN_SECRET_BYTES:
            raise ConfigError(
                f"{SECRET_ENV} must hold at least {MIN_SECRET_BYTES} bytes; use gemscout.watch.generate_secret()"
            )
        return encoded
    if insecure_dev:
        logger.warning(
            "OOB channel runs with the public development key (insecure_dev=True): messages can be forged"
        )
        return _INSECURE_DEV_SECRET
    raise ConfigError(
        f"OobConfig.secret is unset and {SECRET_ENV} is empty: the launcher must give every rank the same per-job "
        "secret (export GEMSCOUT_OOB_SECRET=$(python -c 'import gemscout.watch as o; print(o.generate_secret())')), "
        "or pass insecure_dev=True for a local experiment"
    )
