"""Out-of-band watching for a session: progress and collective fingerprints out, hangs and stalls in.

Every rank publishes its step counter, the collective it is inside (DDP's gradient all-reduces through a comm hook,
and the ``torch.distributed`` collectives when ``instrument_collectives``), and its DataLoader / checkpoint-I/O timings
to an authenticated TCPStore. Rank 0 (or every rank) runs a watchdog thread that reads them without the training
thread's help and reports a stall — naming the root rank where the evidence allows — as a ``FaultReport`` plus a
conservative ``RecoveryDecision``.

The store rank 0 serves listens on ``MASTER_ADDR``'s address only (loopback for a local job), not on every interface.
It is served by a child process of rank 0 with a memory cap of its own (:mod:`gemscout.watch.store_server`), so what
anyone sends to it never grows the training process; that process deletes any key that is not a rank's slot, exits
with rank 0, and its loss is a ``tamper`` finding (``store_lost``), never a hang or a crash. Rank 0 restarts it on the
same port (``WatchConfig.store.max_restarts`` times, with a backoff); every rank reconnects and re-publishes on its next
heartbeat, and a ``store_restored`` finding says watching resumed. Every attach draws a fresh random epoch that rank 0 gives
the others over the process group (not the store): messages of an earlier attach, replayed into the store, are
refused. Whatever fails authentication is reported as ``tamper`` and never becomes a hang.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import secrets
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gemscout.config import require, strict_fields
from gemscout.reports import FaultKind, FaultReport, Scope
from gemscout.watch.channel import OobChannel
from gemscout.watch.config import DEFAULT_NAMESPACE, OobConfig
from gemscout.watch.findings import StallFinding
from gemscout.watch.progress import ProgressConfig, ProgressPublisher
from gemscout.watch.records import PROGRESS_KEY
from gemscout.watch.stalls import InstrumentedLoader, StallConfig, checkpoint_io
from gemscout.watch.store_server import StoreServer, StoreServerConfig, StoreServerError
from gemscout.watch.watchdog import Watchdog, WatchdogConfig

log = logging.getLogger("gemscout.watch")
_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "barrier",
    "reduce",
    "gather",
    "scatter",
    "all_to_all_single",
)


@strict_fields
@dataclass(kw_only=True, slots=True, frozen=True)
class WatchConfig:
    """How the session watches for hangs and stalls out of band."""

    endpoint: str | None = None
    """``host:port`` of an existing TCPStore to use (it may hold other keys: nothing is swept; the epoch is
    ``TORCHELASTIC_RUN_ID``-``TORCHELASTIC_RESTART_COUNT`` when set). Default: rank 0 serves one on a free port of
    ``MASTER_ADDR``'s address only, and port and a random epoch are shared through the process group at attach."""
    secret: bytes | None = field(default=None, repr=False)
    """The per-job HMAC key; default ``GEMSCOUT_OOB_SECRET`` from the launcher's environment. Hidden from ``repr``."""
    insecure_dev: bool = False
    """Run without a secret (a public key): local experiments only."""
    stall_threshold: timedelta = timedelta(seconds=120)
    """No progress for this long is a hang. Keep it below the process group's collective timeout."""
    poll_interval: timedelta = timedelta(seconds=1)
    """How often the watchdog reads the store."""
    confirmations: int = 2
    """Polls (hangs) or rounds (DataLoader / checkpoint I/O) that must agree before a report."""
    section_absolute_s: float = 1.0
    """A DataLoader fetch or checkpoint I/O section is slow only past this many seconds ..."""
    section_relative: float = 3.0
    """... and this factor over the median of the other ranks."""
    watchdog_on: str = "rank0"
    """``rank0`` or ``all``: which ranks run a watchdog thread."""
    instrument_collectives: bool = True
    """Fingerprint collectives: DDP's all-reduces (comm hook) and ``torch.distributed`` calls (thin wrappers)."""
    host: str = field(default_factory=socket.gethostname)
    """The host name published with this rank's progress (maps a root rank to its node)."""
    store: StoreServerConfig = field(default_factory=StoreServerConfig)
    """How rank 0's store process runs (its memory cap, start and stop timeouts, how often it is restarted after it
    died: ``max_restarts``, ``restart_backoff``); unused with ``endpoint``."""

    def __post_init__(self) -> None:
        c = "WatchConfig"
        require(
            self.watchdog_on in ("rank0", "all"),
            c,
            "watchdog_on",
            f"must be 'rank0' or 'all', got {self.watchdog_on!r}",
        )
        require(
            isinstance(self.confirmations, int) and self.confirmations >= 1,
            c,
            "confirmations",
            "must be an int >= 1",
        )
        require(self.section_absolute_s > 0, c, "section_absolute_s", "must be > 0")
        require(self.section_relative >= 1.0, c, "section_relative", "must be >= 1.0")
        require(
            timedelta(0) < self.poll_interval < self.stall_threshold,
            c,
            "poll_interval",
            "must be > 0 and smaller than stall_threshold",
        )
        require(
            self.endpoint is None
            or (":" in self.endpoint and self.endpoint.rsplit(":", 1)[1].isdigit()),
            c,
            "endpoint",
            f"must be 'host:port', got {self.endpoint!r}",
        )


def finding_to_report(finding: StallFinding) -> FaultReport:
    evidence = dict(finding.evidence)
    evidence["recommendation"] = finding.recommendation
    # A tamper finding's ranks own the touched slots; they are not culprits of anything.
    culprits = finding.ranks and finding.kind != "tamper"
    return FaultReport(
        kind=FaultKind(finding.kind),
        scope=Scope.RANK if culprits else Scope.PEER_GROUP,
        ranks=finding.ranks,
        step=finding.step if finding.step is not None else 0,
        recipe=None,
        evidence=evidence,
        confirmations=finding.confirmations,
        reason=finding.reason,
        host=finding.host,
        timestamp=finding.timestamp,
    )


class Watch:
    """One rank's end of the out-of-band watch. Construct on every rank (collective when no endpoint is given)."""

    def __init__(
        self,
        config: WatchConfig,
        *,
        rank: int,
        world_size: int,
        on_report: Callable[[FaultReport, StallFinding], None],
    ) -> None:
        self.config, self.rank, self.world_size = config, rank, world_size
        self._server: StoreServer | None = None
        self._unpatch: list[Callable[[], None]] = []
        self.watchdog: Watchdog | None = None
        host, port, epoch = self._endpoint()
        try:
            self._attach(host, port, epoch, on_report)
        except BaseException:
            self.close()
            raise

    def _attach(
        self,
        host: str,
        port: int,
        epoch: str,
        on_report: Callable[[FaultReport, StallFinding], None],
    ) -> None:
        config, rank, world_size = self.config, self.rank, self.world_size
        oob = OobConfig(
            rank=rank, secret=config.secret, insecure_dev=config.insecure_dev, epoch=epoch
        )
        self.channel = OobChannel.connect(host=host, port=port, config=oob, is_master=False)
        self.publisher = ProgressPublisher(
            self.channel, config=ProgressConfig(host=config.host)
        ).start()
        self.reports: list[FaultReport] = []
        self._on_report = on_report
        if config.watchdog_on == "all" or rank == 0:
            observer = OobChannel.connect(
                host=host,
                port=port,
                config=OobConfig(
                    rank=None, secret=config.secret, insecure_dev=config.insecure_dev, epoch=epoch
                ),
                is_master=False,
            )
            self.watchdog = Watchdog(
                observer,
                world_size=world_size,
                config=WatchdogConfig(
                    stall_threshold=config.stall_threshold,
                    poll_interval=config.poll_interval,
                    confirmations=config.confirmations,
                ),
                stall_config=StallConfig(
                    absolute_threshold=timedelta(seconds=config.section_absolute_s),
                    relative_factor=config.section_relative,
                    confirmations=config.confirmations,
                ),
                callbacks=[self._deliver],
                # Rank 0's watchdog follows the store process, which sweeps the store itself (another rank's sees
                # the store only through its connection).
                store=self._server,
            ).start()
        if config.instrument_collectives:
            self._patch_collectives()

    def _endpoint(self) -> tuple[str, int, str]:
        if self.config.endpoint is not None:
            host, port = self.config.endpoint.rsplit(":", 1)
            run = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '')}"
            return host, int(port), re.sub(r"[^0-9A-Za-z_.-]", "_", run.strip("-"))[:64]
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        # Port and epoch travel over the process group, which an outsider of the store cannot write to.
        shared = torch.zeros(3, dtype=torch.int64)
        failure: Exception | None = None
        if self.rank == 0:
            # The store lives as long as this object, in a process of its own; clients connect to it by host and
            # port. It listens on the job's address only: TCPStore's own server would listen on every interface.
            try:
                self._server = StoreServer.start(
                    host, 0, namespace=DEFAULT_NAMESPACE, world_size=self.world_size, keys=(PROGRESS_KEY,),
                    config=self.config.store,
                )  # fmt: skip
                shared[0] = self._server.port
            except (OSError, StoreServerError) as exc:
                failure, shared[0] = (
                    exc,
                    -1,
                )  # the others must learn it now, not wait on a store that never comes
            shared[1], shared[2] = secrets.randbits(62), secrets.randbits(62)
        try:
            dist.broadcast(shared, src=0)
        except BaseException:
            if self._server is not None:
                self._server.close()
            raise
        if int(shared[0].item()) < 0:
            if failure is not None:
                raise StoreServerError(
                    f"gemscout watch: rank 0 could not serve the out-of-band store: {failure}"
                )
            raise StoreServerError(
                "gemscout watch: rank 0 could not serve the out-of-band store (rank 0's error says why)"
            )
        epoch = f"{int(shared[1]):016x}{int(shared[2]):016x}"
        return host, int(shared[0].item()), epoch

    @property
    def store_server(self) -> StoreServer | None:
        """The process serving the out-of-band store (rank 0 without ``endpoint``), else ``None``."""
        return self._server

    def _deliver(self, finding: StallFinding) -> None:
        report = finding_to_report(finding)
        self.reports.append(report)
        log.warning("gemscout watch: %s", report.reason)
        self._on_report(report, finding)

    def step(self, n: int) -> None:
        self.publisher.step(n)

    def instrument_dataloader(self, loader: Iterable[Any]) -> InstrumentedLoader[Any]:
        return InstrumentedLoader(loader, self.publisher)

    def checkpoint_io(self, kind: str) -> Any:
        return checkpoint_io(self.publisher, kind)  # type: ignore[arg-type]

    def ddp_comm_hook(self, ddp: torch.nn.Module) -> None:
        """Fingerprint DDP's gradient all-reduces (only when the caller has registered no comm hook of its own)."""
        publisher = self.publisher

        # No annotations: DDP checks them literally, and this module's are strings (postponed evaluation).
        def hook(state, bucket):  # type: ignore[no-untyped-def]
            tensor = bucket.buffer()
            publisher.enter_collective("all_reduce", "world", [list(tensor.shape)])
            # DDP without a hook scales by the reciprocal; x * (1/n) is not x / n bit for bit (n = 3), and watching
            # must not change the training numbers.
            tensor.mul_(1.0 / dist.get_world_size())
            fut = dist.all_reduce(tensor, async_op=True).get_future()

            def done(f):  # type: ignore[no-untyped-def]
                publisher.exit_collective()
                return f.value()[0]

            return fut.then(done)

        try:
            ddp.register_comm_hook(None, hook)  # type: ignore[operator]
        except RuntimeError as exc:  # a hook is already registered: keep the caller's
            log.info("gemscout watch: DDP comm hook not installed (%s)", exc)

    def ride(self, timer: Any) -> None:
        """Fingerprint DDP's gradient all-reduces through SCOUT's job-collective timer (which holds DDP's one comm
        hook) instead of a comm hook of the watch's own."""
        publisher = self.publisher
        timer.register_around_collective(
            lambda shape: publisher.enter_collective("all_reduce", "world", [shape]),
            publisher.exit_collective,
        )

    def _patch_collectives(self) -> None:
        publisher = self.publisher
        for name in _COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None or getattr(original, "_gemscout_watch", False):
                continue

            @functools.wraps(original)
            def wrapper(
                *args: Any, __name: str = name, __orig: Any = original, **kwargs: Any
            ) -> Any:
                tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
                shapes = [list(tensor.shape)] if tensor is not None else []
                if kwargs.get("async_op"):
                    return __orig(*args, **kwargs)
                publisher.enter_collective(__name, "world", shapes)
                try:
                    return __orig(*args, **kwargs)
                finally:
                    publisher.exit_collective()

            wrapper._gemscout_watch = True  # type: ignore[attr-defined]
            setattr(dist, name, wrapper)
            self._unpatch.append(functools.partial(setattr, dist, name, original))

    def close(self) -> None:
        for undo in self._unpatch:
            undo()
        self._unpatch.clear()
        if self.watchdog is not None:
            try:
                self.watchdog.stop()
            except Exception as exc:
                log.warning("gemscout watch: %s", exc)
        publisher = getattr(self, "publisher", None)  # absent when attaching failed
        if publisher is not None:
            try:
                publisher.stop()
            except Exception as exc:
                log.warning("gemscout watch: %s", exc)
        if self._server is not None:
            self._server.close()  # after the last 'closed' record: it is the store the publisher writes to
