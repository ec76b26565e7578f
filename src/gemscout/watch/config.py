"""Configuration of one process's end of the out-of-band channel."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gemscout.errors import ConfigError
from gemscout.watch.secret import MIN_SECRET_BYTES

_EPOCH = re.compile(r"[0-9A-Za-z_.-]{0,64}")
DEFAULT_NAMESPACE = "gemscout/oob"


@dataclass(kw_only=True, slots=True, frozen=True)
class OobConfig:
    """How one process talks on the out-of-band channel."""

    rank: int | None
    """This process's rank, or ``None`` for a read-only observer (a watchdog outside the job)."""
    secret: bytes | None = field(default=None, repr=False)
    """The per-job HMAC key (>= 16 bytes). ``None``: read ``GEMSCOUT_OOB_SECRET`` from the environment. Never shown
    by ``repr``: configurations end up in logs."""
    insecure_dev: bool = False
    """Allow starting without any secret, with a public key. For local experiments only; never in a real job."""
    namespace: str = DEFAULT_NAMESPACE
    """Prefix of every key this channel writes or reads; two jobs sharing one store need two namespaces. It is inside
    the MAC, so a message cannot be moved from one namespace to another."""
    epoch: str = ""
    """This run's identity (up to 64 of ``[0-9A-Za-z_.-]``), inside the MAC: a message of another epoch (an earlier
    incarnation of the job under the same secret) is refused as a replay. ``Watch`` draws a random one per attach and
    gives it to every rank over the process group; ``""`` only for a channel used on its own."""
    max_message_bytes: int = 1 << 18
    """Larger stored values are rejected unread, so a hostile writer cannot make readers parse huge blobs."""

    def __post_init__(self) -> None:
        if self.rank is not None and (type(self.rank) is not int or self.rank < 0):
            raise ConfigError(
                f"OobConfig.rank must be an int >= 0 or None (observer), got {self.rank!r}"
            )
        if self.secret is not None and len(self.secret) < MIN_SECRET_BYTES:
            raise ConfigError(
                f"OobConfig.secret must hold at least {MIN_SECRET_BYTES} bytes, got {len(self.secret)}; "
                "use gemscout.watch.generate_secret()"
            )
        if (
            not self.namespace
            or self.namespace.startswith("/")
            or self.namespace.endswith("/")
            or "\0" in self.namespace
        ):
            raise ConfigError(
                f"OobConfig.namespace must be non-empty without leading/trailing '/', got {self.namespace!r}"
            )
        if not isinstance(self.epoch, str) or not _EPOCH.fullmatch(self.epoch):
            raise ConfigError(
                f"OobConfig.epoch must be up to 64 characters of [0-9A-Za-z_.-], got {self.epoch!r}"
            )
        if self.max_message_bytes < 1024:
            raise ConfigError(
                f"OobConfig.max_message_bytes must be >= 1024, got {self.max_message_bytes}"
            )
