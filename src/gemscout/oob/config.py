"""Configuration of one process's end of the out-of-band channel."""

from __future__ import annotations

from dataclasses import dataclass

from gemscout.errors import ConfigError
from gemscout.oob.secret import MIN_SECRET_BYTES


@dataclass(kw_only=True, slots=True, frozen=True)
class OobConfig:
    """How one process talks on the out-of-band channel."""

    rank: int | None
    """This process's rank, or ``None`` for a read-only observer (a watchdog outside the job)."""
    secret: bytes | None = None
    """The per-job HMAC key (>= 16 bytes). ``None``: read ``GEMSCOUT_OOB_SECRET`` from the environment."""
    insecure_dev: bool = False
    """Allow starting without any secret, with a public key. For local experiments only; never in a real job."""
    namespace: str = "gemscout/oob"
    """Prefix of every key this channel writes or reads; two jobs sharing one store need two namespaces."""
    max_message_bytes: int = 1 << 20
    """Larger stored values are rejected unread, so a hostile writer cannot make readers parse huge blobs."""

    def __post_init__(self) -> None:
        if self.rank is not None and self.rank < 0:
            raise ConfigError(f"OobConfig.rank must be >= 0 or None (observer), got {self.rank}")
        if self.secret is not None and len(self.secret) < MIN_SECRET_BYTES:
            raise ConfigError(
                f"OobConfig.secret must hold at least {MIN_SECRET_BYTES} bytes, got {len(self.secret)}; "
                "use gemscout.oob.generate_secret()"
            )
        if not self.namespace or self.namespace.startswith("/") or self.namespace.endswith("/"):
            raise ConfigError(
                f"OobConfig.namespace must be non-empty without leading/trailing '/', got {self.namespace!r}"
            )
        if self.max_message_bytes < 1024:
            raise ConfigError(f"OobConfig.max_message_bytes must be >= 1024, got {self.max_message_bytes}")
